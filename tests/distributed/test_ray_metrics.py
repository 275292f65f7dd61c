"""The training metrics of one RL step do not depend on the number of data-parallel ranks.

One PPO-with-critic (gae) RL step of the real trainer on the same FIXED trajectories
(``tests/trainers/fixed_rollouts.py``: no generation, so both runs train on identical tokens and
rewards), once with the actor and critic in this process (1 rank) and once as 2 Ray ranks each
(``--actor.num_gpus_per_node 2 --critic.num_gpus_per_node 2 --train.colocate_all`` on the 2-CPU Ray
cluster), same strategy (plain torch; DDP over gloo in the Ray workers). The step has 2 optimizer
steps of 4 samples (each rank gets 2 of them, with different token counts), so on the second one
the PPO and value clips bind, approx KL is non-zero, and the values have moved.

Every logged actor/critic metric of the step must agree to ~1e-5: the losses (token means over the
global batch), and the token-weighted means (entropy, clip fractions, approx KL, values mean),
which each rank accumulates as its share of the global token count and which must therefore be
*summed* over ranks, not averaged.
"""

from __future__ import annotations

import pytest
import torch

from rlhforge.cli.train_ppo_ray import build_trainer, parse_rl_args
from tests.rl.helpers import rl_args, write_reward
from tests.trainers.fixed_rollouts import N, fixed_trajectories, rollout_batch

pytestmark = pytest.mark.slow

KEYS = ["actor/policy_loss", "actor/entropy", "actor/clip_frac", "actor/approx_kl", "critic/value_loss",
        "critic/clip_frac", "critic/values_mean"]


def _step_metrics(model_dir, out, reward, *layout) -> dict[str, float]:
    args = rl_args(model_dir, out, "--reward.remote_url", reward,
                   "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", N, "--train.batch_size", "4",
                   "--train.micro_batch_size", "1", "--rollout.micro_batch_size", "4",
                   "--actor.adam.lr", "1e-2", "--actor.eps_clip", "0.1",
                   "--critic.adam.lr", "1e-3", "--critic.lr_warmup_ratio", "0", "--critic.value_clip", "0.05",
                   "--algo.kl.init_coef", "0",  # no reference model: fewer Ray actors
                   "--ds.strategy", "torch", "--logger.progress_bar", "off", *layout, estimator="gae", steps=1)
    trainer = build_trainer(parse_rl_args(args))
    try:
        return trainer.step(rollout_batch(fixed_trajectories(trainer, seed=2), 0))
    finally:
        trainer.logger.close()
        if trainer.actor.world_size > 1:
            from rlhforge.distributed.launch import close_groups

            close_groups(trainer.actor, trainer.ref, trainer.critic)


def test_rl_step_metrics_match_between_one_and_two_ranks(ray_cluster, tiny_model_dir, tmp_path):
    reward = str(write_reward(tmp_path / "reward.py"))
    single = _step_metrics(tiny_model_dir, tmp_path / "single", reward, "--train.workers", "local")
    dp = _step_metrics(tiny_model_dir, tmp_path / "ray", reward, "--actor.num_gpus_per_node", "2",
                       "--critic.num_gpus_per_node", "2", "--train.colocate_all")
    # the step did something worth comparing: the clips bound on the second optimizer step
    assert single["actor/clip_frac"] > 0 and single["critic/clip_frac"] > 0, single
    assert single["actor/approx_kl"] > 0 and single["critic/values_mean"] != 0, single
    report = {k: (single[k], dp[k], dp[k] / single[k] if single[k] else float("nan")) for k in KEYS}
    bad = {k: v for k, v in report.items() if abs(v[1] - v[0]) > 1e-5 * max(1.0, abs(v[0]))}
    assert not bad, "metric: (1 rank, 2 Ray ranks, ratio)\n" + "\n".join(f"{k}: {v}" for k, v in bad.items())
