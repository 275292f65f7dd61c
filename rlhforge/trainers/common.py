"""Small pieces every trainer loop uses: seeding, data order, per-rank micro-batches, resume."""

from __future__ import annotations

import random
from typing import Callable, Sequence

import numpy as np
import torch


def seed_everything(seed: int, full_determinism: bool = False) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if full_determinism:
        torch.use_deterministic_algorithms(True, warn_only=True)


def epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    """Deterministic shuffle per epoch, independent of any other RNG use (exact resume)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=g).tolist()


def step_indices(order: Sequence[int], step_in_epoch: int, batch_size: int, rank: int, world_size: int) -> list[int]:
    """The sample indices rank ``rank`` trains on at this optimizer step (contiguous shard)."""
    batch = order[step_in_epoch * batch_size : (step_in_epoch + 1) * batch_size]
    per_rank = batch_size // world_size
    return list(batch[rank * per_rank : (rank + 1) * per_rank])


def micro_batches(
    indices: list[int], lengths: Callable[[int], int], *, micro_batch_size: int, max_tokens: int = 0
) -> list[list[int]]:
    """Fixed-size micro-batches, or token-budget ones when ``max_tokens > 0``."""
    from rlhforge.data.packing import token_budget_batches

    if max_tokens > 0:
        groups = token_budget_batches([lengths(i) for i in indices], max_tokens)
        return [[indices[j] for j in group] for group in groups]
    return [indices[i : i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]


def pad_micro_batch_count(strategy, batches: list[list[int]]) -> list[list[int] | None]:
    """Every rank must run the same number of forward/backward passes (ZeRO-3 gathers, DDP hooks).
    Ranks with fewer micro-batches get ``None`` entries: a zero-weighted pass on a dummy sample."""
    count = strategy.all_reduce(torch.tensor(float(len(batches))), op="max")
    return batches + [None] * (int(count.item()) - len(batches))
