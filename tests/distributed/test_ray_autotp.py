"""GRPO with DeepSpeed AutoTP in the actor (--ds.tensor_parallel_size 2): 2 Ray actor workers forming one
tensor-parallel group (data-parallel size 1) on a 2-CPU Ray cluster match the single-process DeepSpeed run
on the same seed (losses, grad norms, token-weighted metrics and the exported weights, which the AutoTP
gather rebuilds from the split layers); and the start-up refusals that remain."""

import pytest

from rlhforge.cli.train_ppo_ray import main, parse_rl_args
from rlhforge.config.batching import plan_rl_batches
from rlhforge.config.parsing import ConfigError
from tests.rl.helpers import per_step, rl_args, write_reward

COMMON = ["--ds.strategy", "deepspeed", "--ds.zero_stage", "1"]  # AutoTP trains with ZeRO 0-2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_autotp_actor_matches_single_process(ray_cluster, tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    reward = str(write_reward(tmp_path / "r.py"))
    single = tmp_path / "single"
    assert main(rl_args(tiny_model_dir, single, "--reward.remote_url", reward, *COMMON,
                        "--train.workers", "local")) == 0
    tp = tmp_path / "tp"
    assert main(rl_args(tiny_model_dir, tp, "--reward.remote_url", reward, *COMMON, "--actor.num_gpus_per_node", "2",
                        "--train.colocate_all", "--ds.tensor_parallel_size", "2", "--ckpt.save_steps", "1")) == 0
    # the step-2 rollouts come from weights synced out of the split layers: equal rollouts = a right gather
    assert per_step(tp, "rollout/reward_mean") == per_step(single, "rollout/reward_mean")
    # (not actor/clip_frac: a count of ratios past 1 +- eps, where a token sitting on the boundary flips
    # with float noise of 1e-7; the continuous ratio_mean / approx_kl are compared instead)
    for key in ["actor/policy_loss", "actor/grad_norm", "actor/entropy", "actor/ratio_mean", "actor/approx_kl"]:
        a, b = per_step(single, key), per_step(tp, key)
        assert a.keys() == b.keys() == {1, 2}, key
        for step in a:  # each sample counted once, not once per tensor-parallel rank
            assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-6), (key, step)
    assert any(abs(v) > 1e-4 for v in per_step(single, "actor/policy_loss").values())  # a real update happened
    assert per_step(single, "actor/grad_norm")[1] > 1e-3
    wa, wb = load_file(single / "model.safetensors"), load_file(tp / "model.safetensors")
    assert wa.keys() == wb.keys()
    for name in wa:  # the export gathers the column/row-split q/k/v/o/gate/up/down back to full shapes
        assert wb[name].shape == wa[name].shape, name
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-4
    # AutoTP really split the actor: each rank's DeepSpeed checkpoint holds half of every decoder linear
    # layer (column-parallel q/k/v/gate/up by rows, row-parallel o/down by columns), and the two halves of
    # the final step are the exported full weights
    import torch

    parts = [torch.load(tp / "ckpts" / "step_2" / "deepspeed" / f"mp_rank_0{r}_model_states.pt", weights_only=False)
             for r in (0, 1)]
    assert [(p["mp_world_size"], p["dp_world_size"]) for p in parts] == [(2, 1), (2, 1)]
    split = {k for k, v in parts[0]["module"].items() if v.shape != wb[k].shape}
    assert len(split) == 14  # 7 linear layers x 2 decoder layers
    for name in split:
        dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
        torch.testing.assert_close(torch.cat([p["module"][name].float() for p in parts], dim), wb[name], rtol=0,
                                   atol=0, msg=name)


def test_rl_batch_arithmetic_divides_by_the_tensor_parallel_size():
    kw = dict(rollout_batch_size=4, n_samples_per_prompt=2, train_batch_size=8, micro_batch_size=2,
              rollout_micro_batch_size=8, num_prompts=32)
    assert plan_rl_batches(world_size=4, tp_size=2, **kw).grad_accum_steps == 2  # 8 / (2 x 2 dp ranks)
    assert plan_rl_batches(world_size=2, tp_size=2, **kw).grad_accum_steps == 4  # 8 / (2 x 1 dp rank)
    assert plan_rl_batches(world_size=4, **kw).grad_accum_steps == 1
    with pytest.raises(ConfigError, match="must divide the 3 actor ranks"):
        plan_rl_batches(world_size=3, tp_size=2, **kw)
    with pytest.raises(ConfigError, match=r"2 data-parallel ranks \(8 ranks / tensor-parallel 4\) = 8"):
        plan_rl_batches(world_size=8, tp_size=4, **{**kw, "micro_batch_size": 4, "train_batch_size": 4})


BASE = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "builtin:arithmetic",
        "--reward.remote_url", "builtin:arithmetic", "--rollout.batch_size", "8", "--train.batch_size", "8",
        "--rollout.n_samples_per_prompt", "2", "--algo.advantage.estimator", "group_norm",
        "--ds.strategy", "deepspeed", "--ds.zero_stage", "1", "--ds.tensor_parallel_size", "2"]


@pytest.mark.parametrize("extra, match", [
    (["--train.workers", "local"], "which are Ray workers"),
    (["--actor.num_gpus_per_node", "3"], "must divide the 3 training ranks"),
    (["--actor.num_gpus_per_node", "2", "--ds.zero_stage", "3"], "ZeRO stages 0-2"),
    (["--actor.num_gpus_per_node", "2", "--algo.advantage.estimator", "gae"], "AutoTP in the actor only"),
    (["--actor.num_gpus_per_node", "2", "--ds.lora.rank", "4"], "with LoRA"),
    (["--actor.num_gpus_per_node", "4", "--ds.packing_samples", "--ds.ring_attn_size", "2"], "use one of the two"),
    (["--actor.num_gpus_per_node", "2", "--ds.strategy", "torch"], "needs the DeepSpeed strategy"),
], ids=["no_ray", "indivisible", "zero3", "critic", "lora", "ring", "torch_strategy"])
def test_rl_autotp_startup_refusals(extra, match):
    with pytest.raises(ConfigError, match=match) as err:
        parse_rl_args([*BASE, *extra])
    assert "--ds.tensor_parallel_size 2" in str(err.value)


def test_rl_autotp_layout_is_accepted():
    cfg = parse_rl_args([*BASE, "--actor.num_gpus_per_node", "4"])  # 2 data-parallel x 2 tensor-parallel
    assert cfg.ds.tensor_parallel_size == 2
    with pytest.raises(ConfigError, match=r"actor data-parallel workers \(1 x 2 = 2\)"):
        parse_rl_args([*BASE, "--actor.num_gpus_per_node", "4", "--train.batch_size", "3", "--rollout.batch_size", "3",
                       "--train.micro_batch_size", "1"])
