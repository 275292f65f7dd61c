"""Frozen models as Ray groups: reward models (several, summed) and the reference, ZeRO-3 sharded over
2 ranks of a 2-CPU Ray cluster, equal to the same models in one process; ``--reward.offload`` /
``--ref.offload``; ``--train.colocate_critic_reward`` placing critic and reward group together."""

import pytest
import torch

from rlhforge.cli.train_ppo_ray import main, parse_rl_args
from tests.model_helpers import tiny_reward_model
from tests.rl.helpers import per_step, rl_args

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_rms(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("rms")
    a = tiny_reward_model(tiny_model_dir, root / "a", head_std=0.5, reward_mean=0.25, reward_std=2.0)
    b = tiny_reward_model(tiny_model_dir, root / "b", head_std=1.5, reward_mean=-0.5, reward_std=0.5)
    return f"{a},{b}"


def _ray_group(name, factory, args, n):
    from rlhforge.distributed.placement import plan_placement
    from rlhforge.distributed.ray_group import RayWorkerGroup, create_placement_groups

    plan = plan_placement({name: n}, device="cpu")
    pgs = create_placement_groups(plan)
    group = RayWorkerGroup(name, factory, args, num_workers=n, pg=pgs[name], share=1.0, device="cpu",
                           env={"RLHFORGE_RAY_WORKER": "1", "OMP_NUM_THREADS": "1"})
    group.placement_groups = list(pgs.values())
    return group


def _seqs(n=7):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(5, 100, (int(torch.randint(4, 15, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_reward_group_zero3_scores_and_sums_like_the_driver(ray_cluster, tiny_model_dir, two_rms, tmp_path):
    """2 reward models in a 2-rank ZeRO-3 reward group (offloaded between uses) give the driver's
    per-model rewards (each normalised with its own mean/std); the source sums them (OpenRLHF 0.6)."""
    import asyncio

    from rlhforge.distributed.launch import close_groups
    from rlhforge.workers.reward import RewardGroupScorer, RewardWorker
    from rlhforge.models.loading import load_tokenizer
    from rlhforge.rewards.base import RewardBatch
    from rlhforge.rewards.sources import RewardModelSource, RewardModels, reward_model_paths

    argv = rl_args(tiny_model_dir, tmp_path / "o", "--reward.remote_url", "None", "--reward.model_name_or_path", two_rms,
                   "--reward.normalize_enable", "--reward.num_gpus_per_node", "2", "--reward.offload",
                   "--ds.strategy", "deepspeed", "--ds.zero_stage", "3", "--train.workers", "ray")
    cfg = parse_rl_args(argv)
    tok = load_tokenizer(str(tiny_model_dir))
    paths = reward_model_paths(two_rms)
    seqs = _seqs()
    from rlhforge.rewards.sources import reward_ds_config, reward_model_config

    local = RewardModels(paths, reward_model_config(cfg), reward_ds_config(cfg), torch.device("cpu"),
                         pad_token_id=tok.pad_token_id, normalize=True, micro_batch_size=2)
    expected = local.score(seqs)
    group = _ray_group("reward", RewardWorker, (cfg, tok), 2)
    try:
        got = RewardGroupScorer(group).score(seqs)
        stats = group.call("offload_stats")  # [rank][model]
        src = RewardModelSource(RewardGroupScorer(group), paths, remote=True)
        half = len(seqs) // 2
        batch = RewardBatch(queries=[""] * len(seqs), prompts=[""] * len(seqs), responses=[""] * len(seqs),
                            labels=[None] * len(seqs), datasources=[None] * len(seqs),
                            prompt_ids=[s[:half] for s in seqs], response_ids=[s[half:] for s in seqs])
        out = asyncio.run(src(batch))
    finally:
        close_groups(group)
    assert len(got) == len(seqs) and all(len(r) == 2 for r in got)
    for row, ref in zip(got, expected):
        assert row == pytest.approx(ref, abs=1e-5)
    assert expected[0][0] != pytest.approx(expected[0][1], abs=1e-3)  # two different models
    assert out.rewards == pytest.approx([r[0] + r[1] for r in expected], abs=1e-5)
    assert out.extra_logs["reward_model_1"] == pytest.approx([r[1] for r in expected], abs=1e-5)
    full = sum(p.numel() for p in local.models[0].model.parameters())
    for rank in stats:
        for s in rank:  # ZeRO-3 over 2 ranks: each holds about half; parameters offloaded by DeepSpeed
            assert (s["kind"], s["mode"], s["dtype"]) == ("deepspeed", "deepspeed_offload_param", "float32")
            assert s["local_numel"] <= full // 2 + 1024


def test_sharded_ref_logprobs_equal_the_unsharded_ref(ray_cluster, tiny_model_dir, tmp_path):
    """The reference under ZeRO-3 over 2 Ray ranks (and with --ref.offload) equals the one-process reference
    to 1e-6."""
    from rlhforge.workers.experience import ExperienceSample
    from rlhforge.distributed.launch import close_groups
    from rlhforge.workers.actor import RefWorker
    from rlhforge.models.loading import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    samples = [ExperienceSample(s, [0] * 3 + [1] * (len(s) - 3), 0.0, 0.0) for s in _seqs(5)]
    base = rl_args(tiny_model_dir, tmp_path / "o", "--ds.strategy", "deepspeed")
    unsharded = RefWorker(parse_rl_args([*base, "--ds.zero_stage", "2"]), tok, torch.device("cpu"))
    expected = unsharded.logprobs(samples, 2, 1.0)
    assert unsharded.offload_stats()["kind"] == "deepspeed"
    cfg = parse_rl_args([*base, "--ds.zero_stage", "3", "--ref.num_gpus_per_node", "2", "--ref.offload"])
    group = _ray_group("ref", RefWorker, (cfg, tok), 2)
    try:
        got = group.map_gather("logprobs", samples, 2, 1.0)
        stats = group.call("offload_stats")
    finally:
        close_groups(group)
    for a, b in zip(got, expected):
        assert a.shape == b.shape
        assert float((a - b).abs().max()) <= 1e-6
    full = unsharded.offload_stats()["local_numel"]
    assert all(s["mode"] == "deepspeed_offload_param" and s["local_numel"] <= full // 2 + 1024 for s in stats)


def test_ppo_with_reward_group_beside_the_critic_matches_one_process(ray_cluster, tiny_model_dir, two_rms, tmp_path):
    """PPO with 2 reward models: actor+ref and critic+reward (--train.colocate_critic_reward) on the
    2-CPU cluster give the rewards of the one-process run; KL to the reference is exactly 0 at step 1."""
    args = ["--reward.remote_url", "None", "--reward.model_name_or_path", two_rms, "--reward.normalize_enable"]
    single = tmp_path / "single"
    assert main(rl_args(tiny_model_dir, single, *args, "--train.workers", "local", estimator="gae", steps=1)) == 0
    ray_args = [*args, "--train.workers", "ray", "--train.colocate_actor_ref", "--train.colocate_critic_reward"]
    ray_run = tmp_path / "ray"
    assert main(rl_args(tiny_model_dir, ray_run, *ray_args, estimator="gae", steps=1)) == 0
    for key in ("rollout/reward_mean", "rollout/reward_model_0", "rollout/reward_model_1"):
        assert per_step(ray_run, key)[1] == pytest.approx(per_step(single, key)[1], abs=1e-5), key
    assert per_step(single, "rollout/reward_model_0")[1] != pytest.approx(per_step(single, "rollout/reward_model_1")[1])
    assert per_step(ray_run, "actor/kl_ref") == {1: 0.0} and per_step(single, "actor/kl_ref") == {1: 0.0}


def test_colocate_critic_reward_is_what_makes_it_fit(ray_cluster, tiny_model_dir, two_rms, tmp_path, capsys):
    """Without the flag the same layout needs 3 bundles on the 2-CPU cluster: refused before any model loads."""
    args = ["--reward.remote_url", "None", "--reward.model_name_or_path", two_rms, "--train.workers", "ray",
            "--train.colocate_actor_ref"]
    with pytest.raises(SystemExit) as err:
        main(rl_args(tiny_model_dir, tmp_path / "r", *args, estimator="gae", steps=1))
    assert err.value.code == 2
    msg = capsys.readouterr().err
    assert "need 3 CPU bundle(s)" in msg and "reward 1" in msg and "add --train.colocate_critic_reward" in msg, msg
