"""Token-budget micro-batch planning (``--train.dynamic_batch_enable``): pure functions of lengths.

A dynamic-batching optimizer step (or no-grad pass) on one data-parallel rank is planned in three
moves, the middle one being the only collective (done by the caller):

1. :func:`count_micro_batches`: how many micro-batches this rank needs so that each holds at most
   ``max_tokens`` tokens (first-fit decreasing, :func:`rlhforge.data.packing.token_budget_batches`;
   a sample longer than the budget gets a micro-batch of its own).
2. the caller agrees on ``k = max`` of the counts over the DP ranks (one ``all_reduce(max)``), so
   every rank runs the same number of forward/backward passes: the collectives inside them (ZeRO's
   reduce-scatter and parameter gathers, DDP's all-reduce on the last micro-batch) line up.
3. :func:`balanced_partition`: the rank's samples split into exactly ``k`` micro-batches of near-equal
   total length (Karmarkar-Karp largest differencing, k-way), so the passes cost about the same.

:func:`plan_micro_batches` chains 1 and 3 for one process. Everything is deterministic (ties broken by
index) and returns lists of sample indices: every index exactly once, ascending inside a micro-batch,
micro-batches longest total first.

With ``k`` from step 2 a micro-batch may hold more than ``max_tokens`` tokens (the budget decides the
count; the partition then balances); this is OpenRLHF's behaviour too. The loss of a step does not
depend on the grouping: the trainer normalises every micro-batch by the step's global token (or
sequence) count.
"""

from __future__ import annotations

import heapq
from typing import Callable, Sequence

from rlhforge.data.packing import split_into_micro_batches, token_budget_batches

__all__ = ["count_micro_batches", "balanced_partition", "plan_micro_batches", "micro_batch_groups", "padding_stats"]


def count_micro_batches(lengths: Sequence[int], max_tokens: int) -> int:
    """Micro-batches of at most ``max_tokens`` tokens that hold ``lengths`` (first-fit decreasing); 0 if empty."""
    return len(token_budget_batches(lengths, max_tokens)) if len(lengths) else 0


def balanced_partition(lengths: Sequence[int], k: int) -> list[list[int]]:
    """Split indices ``0..len(lengths)-1`` into exactly ``k`` groups of near-equal total length.

    Karmarkar-Karp largest differencing: every item starts as a k-tuple of bins (itself in one, the
    rest empty); the two tuples with the largest spread (max - min bin sum) are merged by pairing the
    heaviest bin of one with the lightest of the other, until one tuple is left. With positive
    lengths and ``k <= len(lengths)`` no group is empty. Groups come heaviest first (ties: smallest
    first index), indices ascending inside a group.
    """
    lengths = [int(n) for n in lengths]
    n = len(lengths)
    if k < 1:
        raise ValueError(f"k must be >= 1 (got {k})")
    if k > n:
        raise ValueError(f"cannot split {n} samples into {k} non-empty micro-batches")
    if any(x < 1 for x in lengths):
        raise ValueError("lengths must be >= 1")
    # heap entries: (-spread, tie, bins) with bins a list of (sum, indices) sorted heaviest first
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for i in sorted(range(n), key=lambda j: (-lengths[j], j)):
        bins = [(lengths[i], [i])] + [(0, []) for _ in range(k - 1)]
        heap.append((-lengths[i], i, bins))
    heapq.heapify(heap)
    tie = n
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        merged.sort(key=lambda bin_: (-bin_[0], min(bin_[1], default=n)))
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
        tie += 1
    groups = [sorted(idx) for _, idx in heap[0][2]]
    return sorted(groups, key=lambda g: (-sum(lengths[i] for i in g), g[0]))


def plan_micro_batches(lengths: Sequence[int], max_tokens: int, num_micro_batches: int | None = None
                       ) -> list[list[int]]:
    """Token-budget micro-batches of one rank: ``num_micro_batches`` (the count agreed over the DP
    ranks; None: this rank's own :func:`count_micro_batches`) balanced groups of indices."""
    k = count_micro_batches(lengths, max_tokens) if num_micro_batches is None else int(num_micro_batches)
    return balanced_partition(lengths, k) if lengths else []


def micro_batch_groups(lengths: Sequence[int], micro_batch_size: int, max_tokens: int | None,
                       agree: Callable[[int], int] | None = None) -> list[list[int]]:
    """Index groups, one per micro-batch, of one rank's samples of ``lengths``: consecutive chunks of
    ``micro_batch_size`` when ``max_tokens`` is None; else ``agree(own first-fit count)`` (the max over
    the DP ranks; None: this rank alone) length-balanced groups (:func:`plan_micro_batches`)."""
    if max_tokens is None:
        return split_into_micro_batches(range(len(lengths)), micro_batch_size)
    k = count_micro_batches(lengths, max_tokens)
    return plan_micro_batches(lengths, max_tokens, agree(k) if agree is not None else k)


def padding_stats(groups: Sequence[Sequence[int]], lengths: Sequence[int]) -> dict[str, float]:
    """What a padded layout of ``groups`` computes: ``passes``, ``real_tokens``, ``padded_tokens``
    (sum over groups of ``len(group) * longest``) and ``padding_fraction`` = 1 - real / padded."""
    real = sum(int(lengths[i]) for g in groups for i in g)
    padded = sum(len(g) * max(int(lengths[i]) for i in g) for g in groups if g)
    return {"passes": float(len(groups)), "real_tokens": float(real), "padded_tokens": float(padded),
            "padding_fraction": 1.0 - real / padded if padded else 0.0}
