"""Every sample records the weights version that generated it (Trajectory.policy_version) and each
step logs the batch's version lag: with oversampling, groups buffered from an earlier step are one
version behind while the batch's own staleness is 0 (the case a batch-level number hides).

Worked by hand (rollout.batch_size 4 groups, 6 generated per call, every group accepted):
step 1 generates 6 at version 0, trains 4, buffers 2; step 2 trains the 2 buffered (version 0, lag 1)
and 2 of 6 new (version 1, lag 0), buffers 4; step 3 trains the 4 buffered (version 1, lag 1) and
generates nothing."""

import pytest

from rlhforge.cli.train_ppo_ray import main
from tests.rl.helpers import per_step, rl_args


def test_buffered_groups_report_their_own_version(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    assert main(rl_args(tiny_model_dir, out, "--rollout.vllm_generate_batch_size", "6", steps=3)) == 0
    assert per_step(out, "rollout/groups_from_buffer") == {1: 0.0, 2: 2.0, 3: 4.0}
    assert per_step(out, "rollout/version_lag_mean") == {1: 0.0, 2: 0.5, 3: 1.0}
    assert per_step(out, "rollout/version_lag_max") == {1: 0.0, 2: 1.0, 3: 1.0}
    assert per_step(out, "rollout/policy_version_min") == {1: 0.0, 2: 0.0, 3: 1.0}
    assert per_step(out, "async/staleness") == {1: 0.0, 2: 0.0, 3: 0.0}  # the batch-level number misses it


def test_a_trajectory_without_a_version_is_left_out():
    from rlhforge.agents.types import Trajectory
    from rlhforge.trainers.rl.metrics import version_lag

    def traj(v):
        return Trajectory([1, 2], 1, [(1, 2)], [0.0], "stop", policy_version=v, policy_version_end=v)

    assert version_lag([traj(-1)], 5) == {}
    assert version_lag([traj(3), traj(5), traj(-1)], 5) == pytest.approx(
        {"rollout/version_lag_mean": 1.0, "rollout/version_lag_max": 2.0, "rollout/version_lag_end_min": 0.0,
         "rollout/policy_version_min": 3.0})
