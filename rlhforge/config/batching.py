"""All derived batch counts come from here (one tested function).

Algorithmic sizes are global (``train.batch_size`` samples per optimizer step over all ranks);
performance knobs are per device (``train.micro_batch_size``, ``train.max_tokens_per_device``).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhforge.config.parsing import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    batch_size: int
    """Samples per optimizer step, all ranks together."""
    world_size: int
    micro_batch_size: int
    """Samples per micro-batch on one device (upper bound when a token budget is used)."""
    per_rank_batch: int
    """Samples each rank processes per optimizer step."""
    grad_accum_steps: int
    """Micro-batches per optimizer step on each rank (fixed-size micro-batching)."""
    steps_per_epoch: int
    """Optimizer steps per pass over the data (a trailing partial batch is dropped)."""
    total_steps: int
    """Optimizer steps in the whole run."""


def plan_batches(
    *, num_samples: int, batch_size: int, micro_batch_size: int, world_size: int, max_epochs: int, max_steps: int = -1
) -> BatchPlan:
    """Derive gradient accumulation and step counts, or fail showing the arithmetic."""
    if batch_size <= 0 or micro_batch_size <= 0:
        raise ConfigError(
            f"train.batch_size ({batch_size}) and train.micro_batch_size ({micro_batch_size}) must be positive"
        )
    if batch_size % (micro_batch_size * world_size):
        raise ConfigError(
            f"train.batch_size {batch_size} is not divisible by train.micro_batch_size {micro_batch_size} x "
            f"{world_size} ranks = {micro_batch_size * world_size}"
        )
    per_rank = batch_size // world_size
    steps_per_epoch = num_samples // batch_size
    if steps_per_epoch == 0:
        raise ConfigError(
            f"the training data has {num_samples} samples, fewer than one optimizer step "
            f"(train.batch_size {batch_size}); lower train.batch_size or add data"
        )
    total = steps_per_epoch * max_epochs
    if max_steps > 0:
        total = min(total, max_steps)
    return BatchPlan(
        batch_size=batch_size,
        world_size=world_size,
        micro_batch_size=micro_batch_size,
        per_rank_batch=per_rank,
        grad_accum_steps=per_rank // micro_batch_size,
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
    )
