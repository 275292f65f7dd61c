"""RL with the actor (and critic) as 2 data-parallel Ray workers under DeepSpeed ZeRO-2/3 (and FSDP2)
on a 2-CPU Ray cluster matches the single-process trainer on the same seed. The ZeRO-3 PPO case batches by
token budget on the Ray side (every forward a collective: the ranks must agree on their pass counts) against
fixed micro-batches in the single process, and resumes from step 1."""

import shutil

import pytest
import torch

from rlhforge.cli.train_ppo_ray import main
from tests.rl.helpers import metrics, per_step, rl_args, write_reward

pytestmark = pytest.mark.slow


def _run(model, out, reward, estimator, stage, *extra):
    backend = ["--ds.strategy", "fsdp2"] if stage == "fsdp2" else ["--ds.strategy", "deepspeed", "--ds.zero_stage", stage]
    args = rl_args(model, out, "--reward.remote_url", reward, *backend, *extra, estimator=estimator, steps=2)
    if estimator == "gae":
        args += ["--algo.kl.init_coef", "0.01"]  # a reference model too
    assert main(args) == 0
    return out


@pytest.mark.parametrize("estimator, stage", [("gae", "3"), ("group_norm", "2"), ("gae", "2"), ("group_norm", "3"),
                                             ("gae", "fsdp2")],
                         ids=["ppo_critic_zero3", "grpo_zero2_lora", "ppo_critic_zero2", "grpo_zero3", "ppo_critic_fsdp2"])
def test_ray_data_parallel_matches_single_process(ray_cluster, tiny_model_dir, tmp_path, estimator, stage):
    reward = str(write_reward(tmp_path / "r.py"))
    # hybrid-engine sleep on one of them: a no-op on CPU devices, and it must not change anything
    sleep = ["--ds.enable_sleep"] if (estimator, stage) == ("group_norm", "3") else []
    if (estimator, stage) == ("group_norm", "2"):  # LoRA: the driver's engine gets the merged weights
        sleep += ["--ds.lora.rank", "8", "--ds.lora.alpha", "16"]
    single = _run(tiny_model_dir, tmp_path / "single", reward, estimator, stage, "--train.workers", "local", *sleep)
    ray_args = ["--actor.num_gpus_per_node", "2", "--critic.num_gpus_per_node", "2", "--train.colocate_all", *sleep,
                "--ckpt.save_steps", "1"]
    if (estimator, stage) == ("gae", "3"):  # token-budget dynamic batching on the Ray side only
        ray_args += ["--ds.packing_samples", "--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "40",
                     "--rollout.max_tokens_per_gpu", "48"]
    dp = _run(tiny_model_dir, tmp_path / "ray", reward, estimator, stage, *ray_args)
    # same rollouts: identical rewards at every step (generation saw the same weights)
    assert per_step(dp, "rollout/reward_mean") == per_step(single, "rollout/reward_mean")
    assert len(per_step(dp, "rollout/reward_mean")) == 2
    keys = ["actor/policy_loss", "actor/grad_norm", "actor/kl_ref"] + (
        ["critic/value_loss", "critic/grad_norm"] if estimator == "gae" else [])
    for key in keys:
        a, b = per_step(single, key), per_step(dp, key)
        assert a.keys() == b.keys() == {1, 2}, key
        for step in a:
            assert b[step] == pytest.approx(a[step], rel=1e-3, abs=1e-5), (key, step)
    assert any(abs(v) > 1e-4 for v in per_step(single, "actor/policy_loss").values())  # a real update happened
    # the exported policy (or LoRA adapter) equals the single-process one
    from safetensors.torch import load_file

    name = "adapter_model.safetensors" if (single / "adapter_model.safetensors").exists() else "model.safetensors"
    wa, wb = load_file(single / name), load_file(dp / name)
    assert wa.keys() == wb.keys()
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-4
    assert "perf/peak_memory_gb" in metrics(dp)[-1]
    if (estimator, stage) != ("gae", "3"):
        return
    # 2 samples per rank and optimizer step, each over half the 40-token budget: one pass each (the single
    # process: 4 samples per optimizer step in fixed pairs)
    assert per_step(dp, "actor/micro_batches") == per_step(dp, "critic/micro_batches") == {1: 2.0, 2: 2.0}
    assert per_step(single, "actor/micro_batches") == {1: 2.0, 2: 2.0}
    # resume: every rank reloads its ZeRO-3 shard (actor and critic) from step 1 and step 2 is the same again
    resumed = tmp_path / "resumed"
    shutil.copytree(dp, resumed)
    shutil.rmtree(resumed / "ckpts" / "step_2")
    (resumed / "ckpts" / "latest").write_text("step_1")
    _run(tiny_model_dir, resumed, reward, estimator, stage, *ray_args, "--ckpt.load_enable")
    for key in ["rollout/reward_mean", *keys]:
        assert per_step(resumed, key)[2] == pytest.approx(per_step(dp, key)[2], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("transport", ["channel", "object_store"])
def test_engine_generates_with_the_synced_weights(ray_cluster, tiny_model_dir, tmp_path, transport):
    """After training, the driver's HF engine holds exactly the weights the actor group exported, and its
    greedy outputs equal those of a model loaded from that export. (vLLM engines with Ray workers are
    engine actors: tests/distributed/test_engine_actors.py.)"""
    from safetensors.torch import load_file

    from rlhforge.cli.train_ppo_ray import build_trainer, parse_rl_args
    from rlhforge.distributed.launch import close_groups
    from rlhforge.rollout.engine import SamplingParams
    from rlhforge.rollout.hf_engine import HFEngine

    out = tmp_path / "run"
    extra = ["--vllm.sync_with_ray"] if transport == "object_store" else ["--vllm.sync_bucket_mb", "1"]
    cfg = parse_rl_args(rl_args(tiny_model_dir, out, "--reward.remote_url", str(write_reward(tmp_path / "r.py")),
                                "--ds.strategy", "deepspeed", "--ds.zero_stage", "3", "--actor.num_gpus_per_node", "2",
                                "--train.colocate_all", *extra, steps=1))
    trainer = build_trainer(cfg)
    try:
        assert (getattr(trainer.actor, "receiver", None) is not None) == (transport != "object_store")
        trainer.fit()
    finally:
        trainer.logger.close()
        close_groups(trainer.actor, trainer.ref, trainer.critic)
    exported = load_file(out / "model.safetensors")
    initial = load_file(tiny_model_dir / "model.safetensors")
    assert any(not torch.equal(exported[k], initial[k]) for k in exported)  # the step changed the weights
    engine_state = trainer.engine.model.state_dict()
    for name, w in exported.items():
        assert torch.equal(engine_state[name], w), name
    reference = HFEngine.from_pretrained(str(out), trainer.tokenizer)
    prompts = [p.ids for p in trainer.prompts[:8]]
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)  # within the engine's max_model_len
    try:
        assert [o.token_ids for o in trainer.engine.generate_sync(prompts, greedy)] == \
            [o.token_ids for o in reference.generate_sync(prompts, greedy)]
    finally:
        getattr(trainer.engine, "close", lambda: None)()


def test_cli_starts_its_own_ray_and_names_a_failing_worker(tiny_model_dir, tmp_path):
    """No cluster address: the command starts a local Ray; a critic rank that cannot load its model
    stops the run with exit code 4 and a message naming the model, the rank and the call. (The folder
    exists, with a config but no weights: a missing folder is refused at start-up, exit 2, before Ray.)"""
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    broken = tmp_path / "no_such_critic"
    broken.mkdir()
    shutil.copy(Path(tiny_model_dir) / "config.json", broken / "config.json")  # no weights: the load fails in the rank
    root = Path(__file__).parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    env.pop("RAY_ADDRESS", None)
    args = rl_args(tiny_model_dir, tmp_path / "run", "--reward.remote_url", str(write_reward(tmp_path / "r.py")),
                   "--train.workers", "ray", "--train.colocate_all",  # one actor and one critic worker: a fast start
                   "--critic.model_name_or_path", str(tmp_path / "no_such_critic"), estimator="gae", steps=1)
    proc = subprocess.run([sys.executable, "-m", "rlhforge.cli.train_ppo_ray", *args], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert "Started a local Ray instance" in proc.stderr + proc.stdout
    assert "error: critic worker rank 0 failed in building critic:" in proc.stderr
    assert "no_such_critic" in proc.stderr
    assert not (tmp_path / "run" / "model.safetensors").exists()
