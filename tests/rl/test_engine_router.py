"""EngineRouter (several generation engines behind one): least-loaded routing, order, fan-out. No vLLM needed."""

import asyncio

import pytest

from rlhforge.rollout.engine import GenerationOutput, SamplingParams
from rlhforge.rollout.vllm_engine import EngineRouter, iter_buckets


class FakeEngine:
    def __init__(self, name, load=0):
        self.name, self.load, self.calls, self.synced, self.slept = name, load, [], [], 0

    async def generate(self, prompts, params):
        self.calls.append([list(p) for p in prompts])
        return [GenerationOutput([self.name, len(p)], [0.0, 0.0], "length") for p in prompts]

    def update_weights(self, named):
        self.synced.append(dict(named))

    def sleep(self):
        self.slept += 1

    def wake_up(self):
        pass


def test_groups_stay_together_and_go_to_the_least_loaded_engine():
    a, b = FakeEngine(0), FakeEngine(1, load=100)  # b is busy
    router = EngineRouter([a, b])
    sp = SamplingParams(max_new_tokens=10)
    prompts = [[1, 2, 3]] * 4 + [[7] * 50] * 2 + [[9]]
    where = router.assign(prompts, [sp] * len(prompts))
    assert len({where[i] for i in range(4)}) == 1 and where[4] == where[5]  # a group stays on one engine
    # the biggest group (2 x 60 tokens) goes first, to the idle engine (0 -> 120); the next (4 x 13) to the
    # then least-loaded busy one (100 -> 152); the last (11) back to engine 0 (120 -> 131)
    assert where == [1, 1, 1, 1, 0, 0, 0]
    outs = asyncio.run(router.generate(prompts, [sp] * len(prompts)))
    assert [o.token_ids[1] for o in outs] == [len(p) for p in prompts]  # request order kept
    assert [o.token_ids[0] for o in outs] == where


def test_even_split_without_load_and_fan_out():
    engines = [FakeEngine(i) for i in range(3)]
    router = EngineRouter(engines)
    prompts = [[i, i + 1] for i in range(6)]
    where = router.assign(prompts, [SamplingParams(max_new_tokens=4)] * 6)
    assert sorted(where) == [0, 0, 1, 1, 2, 2]
    router.update_weights({"w": 1})
    router.sleep()
    assert all(e.synced == [{"w": 1}] and e.slept == 1 for e in engines)
    with pytest.raises(ValueError, match="at least one engine"):
        EngineRouter([])


def test_buckets_hold_several_tensors_and_respect_the_size():
    import torch

    named = [(f"t{i}", torch.zeros(256)) for i in range(10)]  # 1 KiB each
    buckets = list(iter_buckets(named, 4096))
    assert [len(b) for b in buckets] == [4, 4, 2]
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    assert [len(b) for b in iter_buckets([("big", torch.zeros(4096))] + named[:1], 1024)] == [1, 1]
