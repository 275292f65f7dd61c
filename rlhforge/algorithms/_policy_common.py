"""Helpers shared by the policy losses (``policy_losses``, ``policy_losses_2026``): input checks, the
masked clamped log-ratio, PPO's clipped objective, IS weights. Private: import the losses instead."""

from __future__ import annotations

import torch

from ._utils import as_bool, check_same_shape, masked_metric

LOG_RATIO_CLAMP = 20.0


def _prepare(log_probs, old_log_probs, advantages, mask):
    check_same_shape(log_probs=log_probs, old_log_probs=old_log_probs, mask=mask)
    if advantages.dim() == 1:
        if advantages.shape[0] != log_probs.shape[0]:
            raise ValueError(f"advantages [B] must have B = {log_probs.shape[0]} (got {advantages.shape[0]})")
        advantages = advantages[:, None].expand_as(log_probs)
    check_same_shape(log_probs=log_probs, advantages=advantages)
    m = as_bool(mask)
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    log_ratio = torch.where(m, log_probs - old_log_probs.detach(), zero)
    adv = torch.where(m, advantages.detach().to(log_probs.dtype), zero)
    return m, log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), adv, zero


def _clip_bounds(eps_low: float, eps_high: float | None) -> tuple[float, float]:
    eps_high = eps_low if eps_high is None else eps_high
    if not (0 <= eps_low < 1) or eps_high < 0:
        raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0 (got {eps_low}, {eps_high})")
    return 1.0 - eps_low, 1.0 + eps_high


def _clipped_objective(ratio, adv, lo, hi, dual_clip):
    """Per-token PPO loss and the masks of where the clip / dual clip were active."""
    s1 = ratio * adv
    s2 = ratio.clamp(lo, hi) * adv
    surrogate = torch.minimum(s1, s2)
    clipped = s2 < s1
    loss = -surrogate
    dual = torch.zeros_like(clipped)
    if dual_clip is not None:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 (got {dual_clip})")
        bound = dual_clip * adv
        dual = (adv < 0) & (bound > surrogate)
        loss = torch.where(dual, -bound, loss)
    return loss, clipped, dual


def _apply_weights(loss, is_weights, m, zero):
    if is_weights is not None:
        check_same_shape(loss=loss, is_weights=is_weights)
        loss = loss * torch.where(m, is_weights.detach().to(loss.dtype), zero)
    return torch.where(m, loss, zero)


def _approx_kl(log_ratio, m):
    # KL(pi_old || pi) estimated on tokens sampled from pi_old with k3: (r - 1) - log r, r = pi/pi_old
    return masked_metric(torch.expm1(log_ratio) - log_ratio, m)
