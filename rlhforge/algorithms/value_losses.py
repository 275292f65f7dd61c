"""Critic (value) loss, with optional PPO-style value clipping.

    unclipped:  l_t = 0.5 * (V_t - R_t)^2
    clipped:    V^clip_t = V_old_t + clip(V_t - V_old_t, -eps_v, eps_v)
                l_t = 0.5 * max((V^clip_t - R_t)^2, (V_t - R_t)^2)

(The max keeps the update pessimistic: once V has moved more than ``eps_v`` from ``V_old`` in the
direction that helps, the gradient stops.) OpenRLHF's ``critic.value_clip`` default is 0.5.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._utils import as_bool, check_same_shape, masked_metric

__all__ = ["value_loss"]


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    value_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token value loss.

    Args:
        values: [B, T] current critic outputs (differentiable).
        old_values: [B, T] critic outputs at experience time (used only with ``value_clip``).
        returns: [B, T] targets (e.g. ``advantages.gae`` returns).
        mask: [B, T].
        value_clip: ``eps_v`` > 0, or None for the unclipped loss.

    Returns:
        (loss [B, T] with 0 at masked positions, metrics) where metrics holds ``clip_frac``
        (tokens where the clipped branch is strictly larger, i.e. was used) and
        ``values_mean``. Aggregate the loss with ``aggregation.aggregate_loss``.
    """
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    m = as_bool(mask)
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    # replace masked positions first so inf/NaN there cannot reach the backward pass
    values = torch.where(m, values, zero)
    old_values = torch.where(m, old_values.detach().to(values.dtype), zero)
    returns = torch.where(m, returns.detach().to(values.dtype), zero)
    unclipped = (values - returns).square()
    if value_clip is None:
        loss, used_clip = unclipped, torch.zeros_like(m)
    else:
        if value_clip <= 0:
            raise ValueError(f"value_clip must be > 0 or None (got {value_clip})")
        old = old_values
        v_clip = old + (values - old).clamp(-value_clip, value_clip)
        clipped = (v_clip - returns).square()
        loss = torch.maximum(clipped, unclipped)
        used_clip = clipped > unclipped
    loss = torch.where(m, 0.5 * loss, zero)
    metrics = {"clip_frac": masked_metric(used_clip, m), "values_mean": masked_metric(values, m)}
    return loss, metrics
