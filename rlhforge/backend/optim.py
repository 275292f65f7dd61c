"""AdamW and learning-rate schedules (warm-up then cosine / cosine-with-floor / linear / constant)."""

from __future__ import annotations

import math

import torch

from rlhforge.config.components import OptimConfig


def lr_lambda(step: int, *, total_steps: int, warmup_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based). Pure; tested by hand."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule in ("constant", "constant_with_warmup"):
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "linear":
        return 1.0 - progress
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "cosine":
        return cosine
    if schedule == "cosine_with_min_lr":
        return min_lr_ratio + (1.0 - min_lr_ratio) * cosine
    raise ValueError(f"unknown lr_scheduler {schedule!r}")


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    return torch.optim.AdamW(
        params, lr=cfg.adam.lr, betas=tuple(cfg.adam.betas), eps=cfg.adam.eps, weight_decay=cfg.adam.weight_decay
    )


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    warmup = math.ceil(cfg.lr_warmup_ratio * total_steps)
    fn = lambda step: lr_lambda(  # noqa: E731
        step, total_steps=total_steps, warmup_steps=warmup, schedule=cfg.lr_scheduler, min_lr_ratio=cfg.min_lr_ratio
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
