"""AdamW and learning-rate schedules (warm-up then cosine / cosine-with-floor / linear / constant).

Both follow OpenRLHF 0.11, which builds them with HF ``transformers``:

- weight decay skips biases and norm weights (``get_optimizer_grouped_parameters``: a parameter
  whose name contains one of ``NO_DECAY_NAME_LIST`` goes into a group with ``weight_decay=0``);
- the schedules are HF ``get_scheduler``'s: warm-up rises linearly **from 0** (step ``s`` of
  ``W`` warm-up steps has ``s / W`` of the peak lr, so the first optimizer step has lr 0), and
  ``constant`` has no warm-up at all (``constant_with_warmup`` has).
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from rlhforge.config.components import OptimConfig

__all__ = ["NO_DECAY_NAME_LIST", "optimizer_param_groups", "build_optimizer", "build_scheduler", "lr_lambda"]

NO_DECAY_NAME_LIST = ("bias", "layer_norm.weight", "layernorm.weight", "norm.weight", "ln_f.weight")
"""OpenRLHF's names (substrings of a parameter's name) exempt from weight decay."""


def lr_lambda(step: int, *, total_steps: int, warmup_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based), as HF ``get_scheduler``'s
    lambdas. Past ``total_steps`` the decay stays at its end value. Pure; tested by hand."""
    if schedule == "constant":  # HF ignores the warm-up for "constant"
        return 1.0
    if warmup_steps > 0 and step < warmup_steps:
        return step / warmup_steps
    if schedule == "constant_with_warmup":
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


def optimizer_param_groups(model: torch.nn.Module | Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float,
                           no_decay: Iterable[str] = NO_DECAY_NAME_LIST) -> list[dict]:
    """Trainable parameters in two groups: ``weight_decay`` for most, 0 for those whose name holds
    one of ``no_decay`` (biases, norm weights). Empty groups are left out. ``model``: a module or
    its ``named_parameters()``."""
    named = model.named_parameters() if isinstance(model, torch.nn.Module) else model
    no_decay = tuple(no_decay)
    decay, exempt = [], []
    for name, p in named:
        if p.requires_grad:
            (exempt if any(nd in name for nd in no_decay) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": exempt, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: torch.nn.Module | Iterable[tuple[str, torch.nn.Parameter]],
                    cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over ``optimizer_param_groups(model, cfg.adam.weight_decay)``."""
    groups = optimizer_param_groups(model, cfg.adam.weight_decay)
    if not groups:
        raise ValueError("the model has no trainable parameters")
    return torch.optim.AdamW(groups, lr=cfg.adam.lr, betas=tuple(cfg.adam.betas), eps=cfg.adam.eps)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    warmup = math.ceil(cfg.lr_warmup_ratio * total_steps)
    fn = lambda step: lr_lambda(  # noqa: E731
        step, total_steps=total_steps, warmup_steps=warmup, schedule=cfg.lr_scheduler, min_lr_ratio=cfg.min_lr_ratio
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
