"""RL with the actor (and critic) as 2 data-parallel Ray workers under DeepSpeed ZeRO-2/3 on a
2-CPU Ray cluster matches the single-process trainer on the same seed."""

import pytest

from rlhforge.cli.train_ppo_ray import main
from tests.rl.helpers import metrics, per_step, rl_args, write_reward

pytestmark = pytest.mark.slow


def _run(model, out, reward, estimator, stage, *extra):
    args = rl_args(model, out, "--reward.remote_url", reward, "--ds.strategy", "deepspeed", "--ds.zero_stage", stage,
                   *extra, estimator=estimator, steps=2)
    if estimator == "gae":
        args += ["--algo.kl.init_coef", "0.01"]  # a reference model too
    assert main(args) == 0
    return out


@pytest.mark.parametrize("estimator, stage", [("gae", "3"), ("group_norm", "2"), ("gae", "2"), ("group_norm", "3")],
                         ids=["ppo_critic_zero3", "grpo_zero2", "ppo_critic_zero2", "grpo_zero3"])
def test_ray_data_parallel_matches_single_process(ray_cluster, tiny_model_dir, tmp_path, estimator, stage):
    reward = str(write_reward(tmp_path / "r.py"))
    # hybrid-engine sleep on one of them: a no-op on CPU devices, and it must not change anything
    sleep = ["--ds.enable_sleep"] if (estimator, stage) == ("group_norm", "3") else []
    single = _run(tiny_model_dir, tmp_path / "single", reward, estimator, stage, "--train.workers", "local", *sleep)
    dp = _run(tiny_model_dir, tmp_path / "ray", reward, estimator, stage, "--actor.num_gpus_per_node", "2",
              "--critic.num_gpus_per_node", "2", "--train.colocate_all", *sleep)
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
    # the exported policy equals the single-process one
    from safetensors.torch import load_file

    wa, wb = load_file(single / "model.safetensors"), load_file(dp / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-4
    assert "perf/peak_memory_gb" in metrics(dp)[-1]
