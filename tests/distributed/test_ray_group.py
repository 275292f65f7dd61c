"""The Ray worker group itself: ranks, sharded calls in input order, failures named."""

import pytest

from rlhforge.distributed.groups import WorkerError
from rlhforge.distributed.placement import plan_placement

pytestmark = pytest.mark.slow


def _group(ray, factory, n=2, name="probe"):
    from rlhforge.distributed.ray_group import RayWorkerGroup, create_placement_groups

    plan = plan_placement({name: n}, device="cpu")
    pg = create_placement_groups(plan)[name]
    return RayWorkerGroup(name, factory, (), num_workers=n, pg=pg, share=1.0, device="cpu"), pg


def test_ranks_process_group_and_sharded_calls(ray_cluster):
    class Probe:  # defined here so Ray ships it by value
        def __init__(self):
            import os

            import torch.distributed as dist

            dist.init_process_group("gloo")
            self.rank = int(os.environ["RANK"])

        def whoami(self):
            import os

            import torch
            import torch.distributed as dist

            t = torch.tensor([float(self.rank + 1)])
            dist.all_reduce(t)
            return self.rank, int(os.environ["WORLD_SIZE"]), float(t)

        def tag(self, items):
            return [(x, self.rank) for x in items]

        def boom(self, items):
            raise ValueError(f"bad item {items[0]!r}")

    from ray.util.placement_group import remove_placement_group

    group, pg = _group(ray_cluster, Probe)
    try:
        assert group.call("whoami") == [(0, 2, 3.0), (1, 2, 3.0)]  # a real gloo all-reduce across the actors
        items = ["aaaa", "b", "cc", "ddd", "e"]
        out = group.map_gather("tag", items)
        assert [x for x, _ in out] == items  # input order back
        assert {r for _, r in out} == {0, 1}
        with pytest.raises(WorkerError, match=r"probe worker rank \d failed in boom: ValueError: bad item"):
            group.map_train("boom", items[:4])  # 4 items: two per rank, no padding needed
        ray_cluster.kill(group.hosts[1])
        with pytest.raises(WorkerError, match=r"probe worker rank 1 died during whoami .*checkpoints already written are intact"):
            group.call("whoami")
    finally:
        group.close()
        remove_placement_group(pg)
