"""--deadline.*: a hung rank is named within --deadline.worker_call_s, a collective whose peer never
arrives raises within --deadline.collective_s (gloo's timeout, set from the launcher's environment),
and the family's aliases set the older flags."""

import time

import pytest

from rlhforge.config.deadline import COLLECTIVE_TIMEOUT_ENV
from rlhforge.distributed.groups import WorkerError
from rlhforge.distributed.placement import plan_placement

pytestmark = pytest.mark.slow


class Napper:  # shipped by value to the Ray actors
    def __init__(self):
        import os

        import torch

        from rlhforge.backend.device import init_process_group

        init_process_group(torch.device("cpu"))  # the group's timeout comes from the environment
        self.rank = int(os.environ["RANK"])

    def nap_on(self, rank: int, seconds: float) -> int:
        import time

        if self.rank == rank:
            time.sleep(seconds)
        return self.rank

    def reduce_unless(self, rank: int, seconds: float) -> float:
        import time

        import torch
        import torch.distributed as dist

        if self.rank == rank:  # never joins: its peer's all-reduce waits for it
            time.sleep(seconds)
            return -1.0
        t = torch.ones(1)
        dist.all_reduce(t)
        return float(t)


def _group(call_timeout_s, collective_s):
    from rlhforge.distributed.ray_group import RayWorkerGroup, create_placement_groups

    pg = create_placement_groups(plan_placement({"probe": 2}, device="cpu"))["probe"]
    group = RayWorkerGroup("probe", Napper, (), num_workers=2, pg=pg, share=1.0, device="cpu",
                           env={COLLECTIVE_TIMEOUT_ENV: str(collective_s)}, call_timeout_s=call_timeout_s)
    return group, pg


def test_a_hung_rank_is_named_within_the_call_deadline_and_a_lost_peer_within_the_collective_one(ray_cluster):
    from ray.util.placement_group import remove_placement_group

    group, pg = _group(call_timeout_s=6.0, collective_s=2.0)
    try:
        assert group.call("nap_on", 1, 0.0) == [0, 1]
        assert group.call("reduce_unless", -1, 0.0) == [2.0, 2.0]  # the group works

        t0 = time.monotonic()
        with pytest.raises(WorkerError, match=r"probe worker rank\(s\) 1 gave no answer within "
                                              r"--deadline.worker_call_s 6 s during nap_on"):
            group.call("nap_on", 1, 60.0)
        assert time.monotonic() - t0 < 20
    finally:
        group.close()
        remove_placement_group(pg)

    group, pg = _group(call_timeout_s=8.0, collective_s=2.0)
    try:
        t0 = time.monotonic()
        # rank 0's all-reduce ends at the collective deadline (2 s) with an error that is named before
        # rank 1, still asleep, is reported as hung
        with pytest.raises(WorkerError, match=r"probe worker rank 0 failed in reduce_unless: .*"):
            group.call("reduce_unless", 1, 60.0)
        assert time.monotonic() - t0 < 20
    finally:
        group.close()
        remove_placement_group(pg)


def test_the_family_names_set_the_older_flags_and_bad_values_are_refused():
    from rlhforge.cli.train_ppo_ray import parse_rl_args
    from rlhforge.config.parsing import ConfigError

    base = ["--actor.model_name_or_path", "unused", "--data.prompt_dataset", "builtin:arithmetic",
            "--reward.remote_url", "builtin:arithmetic", "--rollout.batch_size", "8", "--train.batch_size", "8"]
    cfg = parse_rl_args([*base, "--deadline.engine_request_s", "7", "--deadline.weight_sync_s=9", "--deadline.reward_s",
                         "4", "--deadline.env_step_s", "5", "--deadline.env_episode_s", "50",
                         "--deadline.collective_s", "60"], validate=False)
    assert (cfg.vllm.request_timeout_s, cfg.vllm.sync_timeout_s, cfg.reward.timeout) == (7, 9, 4)
    assert (cfg.train.agent_step_timeout, cfg.train.agent_episode_timeout, cfg.deadline.collective_s) == (5, 50, 60)
    with pytest.raises(ConfigError, match=r"--deadline.worker_call_s must be a number of seconds > 0 \(got 0.0\)"):
        parse_rl_args([*base, "--deadline.worker_call_s", "0"])
