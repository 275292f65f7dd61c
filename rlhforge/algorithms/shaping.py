"""Reward shaping before advantages: DAPO overlong penalty, stop-properly penalty, running normalisation.

Order used by the experience maker (as in OpenRLHF): length penalties first, then group
shaping (``advantages``), then per-token rewards.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["overlong_penalty", "stop_properly_penalty", "RunningMeanStd"]


@torch.no_grad()
def overlong_penalty(
    response_lengths: Tensor, max_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> Tensor:
    """DAPO soft overlong punishment (Yu et al., 2025, arXiv:2503.14476, eq. 13).

    ``penalty = -min(max(len - (max_len - buffer_len), 0) / buffer_len, 1) * penalty_factor``:
    0 up to ``max_len - buffer_len`` tokens, then linear down to ``-penalty_factor`` at
    ``max_len`` (and beyond). Add it to the scalar reward.

    Shapes: response_lengths [B] (int or float) -> [B] float32 (<= 0).
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"need 0 < buffer_len <= max_len (got buffer_len={buffer_len}, max_len={max_len})")
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0 (got {penalty_factor})")
    excess = (response_lengths.float() - (max_len - buffer_len)).clamp_min(0.0)
    return -(excess / buffer_len).clamp_max(1.0) * penalty_factor


@torch.no_grad()
def stop_properly_penalty(rewards: Tensor, truncated: Tensor, coef: float) -> Tensor:
    """Penalise samples that hit the length limit (ProRL-style; OpenRLHF ``stop_properly_penalty_coef``).

    For truncated samples: ``R <- coef * R`` when ``0 <= coef <= 1``; ``R <- coef`` (a fixed
    value) when ``coef < 0``. Other samples are unchanged. ``coef > 1`` raises ValueError.

    Shapes: rewards [B], truncated [B] bool -> [B].
    """
    if coef > 1:
        raise ValueError(f"stop_properly_penalty coef must be <= 1 (got {coef})")
    if rewards.shape != truncated.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and truncated {tuple(truncated.shape)} differ")
    t = truncated.bool()
    shaped = rewards * coef if coef >= 0 else torch.full_like(rewards, coef)
    return torch.where(t, shaped, rewards)


class RunningMeanStd:
    """Running mean and (population) variance of a stream of batches, for reward normalisation.

    ``update(x)`` merges the batch statistics with the running ones (Chan et al.'s parallel form
    of Welford's algorithm, in float64), so the result equals the statistics of everything seen,
    whatever the batching. ``normalize(x)`` returns ``(x - mean) / sqrt(var + eps)`` (``center=
    False`` skips the mean), optionally clipped to ``[-clip, clip]``. Before the first update
    mean = 0 and var = 1. ``state_dict()`` / ``load_state_dict()`` make it resumable.

    Args:
        shape: shape of one element (``()`` for scalar rewards).
        eps: added to the variance inside the square root.
    """

    def __init__(self, shape: tuple[int, ...] = (), eps: float = 1e-8):
        self.shape = tuple(shape)
        self.eps = float(eps)
        self.mean = torch.zeros(self.shape, dtype=torch.float64)
        self.var = torch.ones(self.shape, dtype=torch.float64)
        self.count = 0

    @torch.no_grad()
    def update(self, x: Tensor) -> None:
        """Merge a batch ``x`` of shape ``[N, *shape]`` (N >= 1; N = 0 is a no-op)."""
        x = x.detach().to(torch.float64).cpu().reshape(-1, *self.shape)
        n = x.shape[0]
        if n == 0:
            return
        b_mean = x.mean(0)
        b_var = x.var(0, correction=0)
        if self.count == 0:
            self.mean, self.var, self.count = b_mean, b_var, n
            return
        total = self.count + n
        delta = b_mean - self.mean
        m2 = self.var * self.count + b_var * n + delta.square() * self.count * n / total
        self.mean = self.mean + delta * n / total
        self.var = m2 / total
        self.count = total

    @property
    def std(self) -> Tensor:
        return torch.sqrt(self.var + self.eps)

    @torch.no_grad()
    def normalize(self, x: Tensor, center: bool = True, clip: float | None = None) -> Tensor:
        """``(x - mean) / std`` in ``x``'s dtype and device; ``[N, *shape]`` or ``shape`` -> same."""
        mean = self.mean.to(device=x.device, dtype=x.dtype) if center else 0.0
        out = (x - mean) / self.std.to(device=x.device, dtype=x.dtype)
        if clip is not None:
            out = out.clamp(-clip, clip)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean.clone(), "var": self.var.clone(), "count": self.count, "eps": self.eps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mean = torch.as_tensor(state["mean"], dtype=torch.float64)
        if tuple(mean.shape) != self.shape:
            raise ValueError(f"state has shape {tuple(mean.shape)}, this RunningMeanStd has {self.shape}")
        self.mean = mean.clone()
        self.var = torch.as_tensor(state["var"], dtype=torch.float64).clone()
        self.count = int(state["count"])
        self.eps = float(state.get("eps", self.eps))
