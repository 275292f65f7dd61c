"""What a vLLM engine changes in the process it starts in: torch.compile off for a CPU engine's calls,
and the heap frozen before vLLM's start-up collects it (used by :mod:`rlhforge.rollout.vllm_engine`)."""

from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def cpu_eager():
    """torch.compile off for a CPU engine's calls (the engine itself is eager there: ``enforce_eager``).

    vLLM still compiles a few helpers with inductor on first use, e.g. the rank count of the sampled
    token's log-prob (``batched_count_greater_than``): about 3 s of C++ code generation in the first
    generation of every process, then a guard check per decode step, for a ``(x >= v).sum(-1)``.
    rlhforge compiles nothing itself; a user's own torch.compile'd code running in another thread
    during a generation runs eagerly for that while."""
    import torch._dynamo

    with torch._dynamo.config.patch(disable=True):
        yield


def freeze_heap() -> None:
    """Collect once, then move every object this process holds out of the collector's sight (``gc.freeze``).

    An engine in the trainer's process starts in a large heap (torch, transformers, the trainer's
    objects), and vLLM's start-up runs full collections over all of it: two in its model loader and one
    before it freezes the heap itself, plus the automatic ones while its modules import. On CPU that was
    ~0.7 s each. Once the heap is frozen they only see what vLLM creates. It is what vLLM does at the end
    of its start-up in any case (``freeze_gc_heap``: collect, then freeze), only earlier."""
    gc.collect()
    gc.freeze()
