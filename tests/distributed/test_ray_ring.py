"""GRPO and PPO with ring attention in the actor (--ds.ring_attn_size 2): 2 Ray actor workers forming one ring
(data-parallel size 1) on a 2-CPU Ray cluster match the single-process packed run on the same seed."""

import pytest

from rlhforge.cli.train_ppo_ray import main
from tests.rl.helpers import per_step, rl_args, write_reward

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("estimator", ["group_norm", "gae"], ids=["grpo", "ppo_critic"])
def test_ray_ring_attention_actor_matches_single_process(ray_cluster, tiny_model_dir, tmp_path, estimator):
    """PPO: the critic (1 worker, whole sequences) runs beside the actor's ring."""
    reward = str(write_reward(tmp_path / "r.py"))
    common = ["--reward.remote_url", reward, "--ds.packing_samples", "--ds.strategy", "deepspeed",
              "--ds.zero_stage", "2"]
    single = tmp_path / "single"
    assert main(rl_args(tiny_model_dir, single, *common, "--train.workers", "local", estimator=estimator)) == 0
    ring = tmp_path / "ring"
    assert main(rl_args(tiny_model_dir, ring, *common, "--actor.num_gpus_per_node", "2", "--train.colocate_all",
                        "--ds.ring_attn_size", "2", "--ds.ring_attn_head_stride", "1", estimator=estimator)) == 0
    assert per_step(ring, "rollout/reward_mean") == per_step(single, "rollout/reward_mean")  # same rollouts
    keys = ["actor/policy_loss", "actor/grad_norm", "actor/entropy"]
    for key in keys + (["critic/value_loss", "critic/grad_norm"] if estimator == "gae" else []):
        a, b = per_step(single, key), per_step(ring, key)
        assert a.keys() == b.keys() == {1, 2}, key
        for step in a:
            assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-6), (key, step)
    assert any(abs(v) > 1e-4 for v in per_step(single, "actor/policy_loss").values())  # a real update happened
    from safetensors.torch import load_file

    wa, wb = load_file(single / "model.safetensors"), load_file(ring / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-4
