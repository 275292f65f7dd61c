"""A DeepSpeed run in a process whose default process group was destroyed after an earlier DeepSpeed
run (an in-process vLLM engine tears it down on shutdown) must work: DeepSpeed's cached groups
(``deepspeed.utils.groups``) are dropped before the new ``init_distributed``, not reused ("Group ... is
not registered")."""

import pytest

from rlhforge.cli.train_ppo_ray import main
from tests.rl.helpers import per_step, rl_args, write_reward

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DS = ["--ds.strategy", "deepspeed", "--ds.zero_stage", "2", "--train.workers", "local"]


def test_deepspeed_runs_again_after_the_default_group_was_destroyed(tiny_model_dir, tmp_path):
    import torch.distributed as dist
    from deepspeed.utils import groups

    reward = str(write_reward(tmp_path / "r.py"))
    assert main(rl_args(tiny_model_dir, tmp_path / "first", "--reward.remote_url", reward, *DS, steps=1)) == 0
    assert dist.is_initialized() and groups._WORLD_GROUP is not None  # DeepSpeed cached its world clone
    dist.destroy_process_group()  # what an in-process vLLM engine's shutdown does
    assert main(rl_args(tiny_model_dir, tmp_path / "second", "--reward.remote_url", reward, *DS, steps=1)) == 0
    dist.get_global_rank(groups._WORLD_GROUP, 0)  # the new clone belongs to the new default group
    first, second = per_step(tmp_path / "first", "actor/policy_loss"), per_step(tmp_path / "second", "actor/policy_loss")
    assert first.keys() == second.keys() == {1} and second[1] == pytest.approx(first[1], rel=1e-6, abs=1e-9)
