"""DAPO dynamic sampling: drop prompt groups whose samples all succeed or all fail.

Yu et al., 2025 (arXiv:2503.14476, sec 3.2): a group of ``n`` samples of one prompt is kept only
if its mean score lies *strictly* inside ``(low, high)``; with 0/1 scores and the default (0, 1)
that removes all-correct and all-wrong groups, whose group-relative advantages are all 0.
A group whose mean is NaN is dropped. Scores (for filtering) are kept apart from rewards.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["dynamic_filter", "expand_group_mask"]


@torch.no_grad()
def dynamic_filter(scores: Tensor, n_samples_per_prompt: int, low: float = 0.0, high: float = 1.0) -> Tensor:
    """Which prompt groups to keep.

    Args:
        scores: [P * n] scores, groups of ``n`` consecutive samples (or already [P, n]).
        n_samples_per_prompt: n >= 1.
        low, high: the open interval for the group mean.

    Returns:
        [P] bool, True = keep. ``expand_group_mask`` turns it into a per-sample mask.
    """
    n = n_samples_per_prompt
    if n < 1:
        raise ValueError(f"n_samples_per_prompt must be >= 1 (got {n})")
    if not low < high:
        raise ValueError(f"need low < high (got ({low}, {high}))")
    if scores.numel() % n != 0:
        raise ValueError(f"{scores.numel()} scores do not split into groups of {n}")
    means = scores.detach().float().reshape(-1, n).mean(dim=1)
    return (means > low) & (means < high)


def expand_group_mask(keep: Tensor, n_samples_per_prompt: int) -> Tensor:
    """Per-group keep [P] -> per-sample keep [P * n] (each flag repeated n times)."""
    return keep.repeat_interleave(n_samples_per_prompt)
