"""Several generation engines behind one ``GenerationEngine`` (:class:`EngineRouter`), as
``--vllm.num_engines N`` builds them (:func:`rlhforge.rollout.vllm_engine.build_vllm_engines`).

The router needs nothing of vLLM: any engines with ``generate`` / ``update_weights`` / ``sleep`` /
``wake_up`` (and, optionally, a ``load`` and ``close``) can stand behind it.
"""

from __future__ import annotations

import asyncio
from typing import Sequence

import torch

from rlhforge.rollout.engine import GenerationOutput, SamplingParams, params_per_prompt

__all__ = ["EngineRouter", "named_pairs"]


def named_pairs(named_tensors) -> list[tuple[str, torch.Tensor]]:
    """A state dict or ``(name, tensor)`` pairs as a list of ``(str name, tensor)`` pairs."""
    items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
    return [(str(k), v) for k, v in items]


class EngineRouter:
    """Several engines behind one ``GenerationEngine``: each request goes to the least-loaded engine.

    A batch is split by prompt: requests with the same prompt ids (the samples of one GRPO group)
    stay together on one engine (its prefix cache then serves them), and each group goes to the
    engine whose outstanding work (prompt + max new tokens, in flight plus already assigned in this
    batch) is smallest. The sub-batches run concurrently; outputs come back in request order.
    ``update_weights``, ``sleep`` and ``wake_up`` go to every engine.
    """

    def __init__(self, engines: Sequence):
        if not engines:
            raise ValueError("EngineRouter needs at least one engine")
        self.engines = list(engines)

    def assign(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> list[int]:
        """Engine index of each request."""
        load = [float(getattr(e, "load", 0)) for e in self.engines]
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, p in enumerate(prompts):
            groups.setdefault(tuple(p), []).append(i)
        out = [0] * len(prompts)
        # biggest groups first (longest-processing-time rule), ties by first appearance
        for key, members in sorted(groups.items(), key=lambda kv: -sum(len(kv[0]) + params[i].max_new_tokens
                                                                       for i in kv[1])):
            work = sum(len(key) + params[i].max_new_tokens for i in members)
            target = min(range(len(self.engines)), key=lambda j: (load[j], j))
            load[target] += work
            for i in members:
                out[i] = target
        return out

    async def generate(self, prompts, params, vision: Sequence | None = None) -> list[GenerationOutput]:
        params = params_per_prompt(prompts, params, vision)
        where = self.assign(prompts, params)
        jobs, index = [], []
        for j, engine in enumerate(self.engines):
            idx = [i for i, w in enumerate(where) if w == j]
            if idx:
                index.append(idx)
                sub = {} if vision is None else {"vision": [vision[i] for i in idx]}
                jobs.append(engine.generate([prompts[i] for i in idx], [params[i] for i in idx], **sub))
        results = await asyncio.gather(*jobs)
        out: list[GenerationOutput | None] = [None] * len(prompts)
        for idx, res in zip(index, results):
            for i, o in zip(idx, res):
                out[i] = o
        return out  # type: ignore[return-value]

    def update_weights(self, named_tensors) -> None:
        pairs = named_pairs(named_tensors)
        for engine in self.engines:
            engine.update_weights(pairs)

    def sync_reports(self) -> list[tuple[str, list]]:
        """``(engine name, its workers' reports)`` of the last sync, for every engine."""
        return [(f"{name} {i}", reps) for i, e in enumerate(self.engines) for name, reps in e.sync_reports()]

    def probe_logprobs(self, prompts) -> list[tuple[str, list[list[float]]]]:
        """Every engine's scoring of the post-sync probe (rlhforge.backend.sync_probe), each named."""
        return [(f"{name} {i}", rows) for i, e in enumerate(self.engines)
                if hasattr(e, "probe_logprobs") for name, rows in e.probe_logprobs(prompts)]

    def sleep(self) -> None:
        for engine in self.engines:
            engine.sleep()

    def wake_up(self) -> None:
        for engine in self.engines:
            engine.wake_up()

    def close(self) -> None:
        for engine in self.engines:
            getattr(engine, "close", lambda: None)()
