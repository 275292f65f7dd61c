"""Token-budget dynamic batching with 2 data-parallel Ray workers (actor, critic and reference under
DeepSpeed ZeRO-3, every forward a collective) matches the single-process run with fixed micro-batches."""

import pytest

from rlhforge.cli.train_ppo_ray import main
from tests.rl.helpers import per_step, rl_args, write_reward

pytestmark = pytest.mark.slow


def test_ray_dynamic_batching_matches_fixed_single_process(ray_cluster, tiny_model_dir, tmp_path):
    reward = str(write_reward(tmp_path / "r.py"))
    common = ["--reward.remote_url", reward, "--ds.strategy", "deepspeed", "--ds.zero_stage", "3",
              "--algo.kl.init_coef", "0.01"]
    single = tmp_path / "single"
    assert main(rl_args(tiny_model_dir, single, *common, "--train.workers", "local", estimator="gae")) == 0
    dp = tmp_path / "ray"
    budget = ["--ds.packing_samples", "--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "40",
              "--rollout.max_tokens_per_gpu", "48"]
    assert main(rl_args(tiny_model_dir, dp, *common, *budget, "--actor.num_gpus_per_node", "2",
                        "--critic.num_gpus_per_node", "2", "--train.colocate_all", estimator="gae")) == 0
    assert per_step(dp, "rollout/reward_mean") == per_step(single, "rollout/reward_mean")
    passes = per_step(dp, "actor/micro_batches")
    # 2 samples per rank and optimizer step, each over half the 40-token budget: one pass each
    assert passes == per_step(dp, "critic/micro_batches") == {1: 2.0, 2: 2.0}
    assert per_step(single, "actor/micro_batches") == {1: 2.0, 2: 2.0}  # 4 samples per optimizer step: 2 pairs
    for key in ["actor/policy_loss", "actor/grad_norm", "actor/kl_ref", "critic/value_loss", "critic/grad_norm"]:
        a, b = per_step(single, key), per_step(dp, key)
        assert a.keys() == b.keys() == {1, 2}, key
        for step in a:
            assert b[step] == pytest.approx(a[step], rel=1e-3, abs=1e-5), (key, step)
