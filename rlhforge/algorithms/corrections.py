"""Rollout-vs-trainer importance-sampling (IS) corrections, generalised as in OpenRLHF 0.11.2.

The rollout engine (vLLM) samples with pi_roll; the trainer recomputes pi_train (the "old" policy)
for the same tokens. The two differ (kernels, precision, stale weights), so the policy loss is
reweighted per token with the detached importance weight

    w_t = exp(log pi_train_t - log pi_roll_t)      (log-ratio clamped to [-20, 20])

A *gate* reads one statistic per unit and either clamps or drops:

- ``level``: ``token`` (one unit per action token) or ``seq`` (one unit per sequence);
- ``gating`` (the statistic):
    - ``ratio``: token: ``w_t``; seq: ``exp(masked mean_t log w_t)`` (geometric mean);
    - ``binary_kl``: ``p log(p/q) + (1-p) log((1-p)/(1-q))`` on the sampled token with
      ``p = pi_roll``, ``q = pi_train`` (probabilities clamped to [1e-6, 1-1e-6]); seq: masked mean;
    - ``tv``: ``|p - q|`` on the sampled token; seq: masked mean;
- ``mode``:
    - ``clip`` (token level with ratio gating only): nothing is dropped; the IS weight is the
      clamped ratio ``clamp(w_t, lo, hi)`` (TIS);
    - ``mask``: units whose statistic is outside ``[lo, hi]`` are dropped: weight 0 and removed
      from the returned mask; surviving tokens keep the *unclamped* weight ``w_t``.

Divergence gatings take an upper bound only (``lo`` must be 0 or None).

Every function returns ``(is_weights [B, T] detached, new_mask [B, T], metrics)``: weights are 0
wherever ``new_mask`` is 0; ``new_mask`` has the dtype of the input mask. Multiply the per-token
policy loss by ``is_weights`` (``policy_losses.*(..., is_weights=w)``). Whether to aggregate with
``new_mask`` or the original mask is the trainer's choice: the original mask keeps dropped
tokens in the denominator (OpenRLHF's behaviour), ``new_mask`` renormalises over survivors.

Named presets (``IS_CORRECTIONS``):

| name            | level | mode | gating    | default band  |
| --------------- | ----- | ---- | --------- | ------------- |
| tis             | token | clip | ratio     | [0.5, 5.0]    |
| icepop          | token | mask | ratio     | [0.5, 5.0]    |
| seq_mask_tis    | seq   | mask | ratio     | [0.5, 5.0]    |
| flash_reinforce | seq   | mask | binary_kl | [0, 3e-3]     |
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ._utils import as_bool, check_same_shape, like_mask, lookup, masked_mean, masked_metric
from .kl import binary_kl, total_variation

__all__ = [
    "is_correction",
    "tis",
    "icepop",
    "seq_mask_tis",
    "flash_reinforce_trust_region",
    "IS_CORRECTIONS",
    "get_is_correction",
    "LEVELS",
    "MODES",
    "GATINGS",
]

LEVELS = ("token", "seq")
MODES = ("clip", "mask")
GATINGS = ("ratio", "binary_kl", "tv")
_LOG_RATIO_CLAMP = 20.0


def _validate(level: str, mode: str, gating: str, low: float | None, high: float) -> float:
    for value, valid, what in ((level, LEVELS, "level"), (mode, MODES, "mode"), (gating, GATINGS, "gating")):
        if value not in valid:
            raise ValueError(f"unknown IS-correction {what} {value!r}; valid: {', '.join(valid)}")
    if mode == "clip" and level != "token":
        raise ValueError(
            "IS-correction mode 'clip' works per token only (level='token'): clamping a sequence "
            "statistic would not say which token weights to clamp; use mode='mask' for level='seq'"
        )
    if mode == "clip" and gating != "ratio":
        raise ValueError(
            f"IS-correction mode 'clip' clamps the importance ratio, so it needs gating='ratio' "
            f"(got {gating!r}); a divergence can only gate with mode='mask'"
        )
    if gating != "ratio":
        if low not in (None, 0, 0.0):
            raise ValueError(
                f"gating {gating!r} takes an upper bound only (a divergence is >= 0): low must be 0 or "
                f"None (got {low})"
            )
        low = 0.0
    if low is None:
        raise ValueError("ratio gating needs a lower bound low > 0")
    if not low <= high:
        raise ValueError(f"need low <= high (got [{low}, {high}])")
    return float(low)


@torch.no_grad()
def is_correction(
    log_probs: Tensor,
    rollout_log_probs: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    mode: str = "clip",
    gating: str = "ratio",
    low: float | None = 0.5,
    high: float = 5.0,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """General gate; see the module docstring for exactly what is clamped and what is dropped.

    Args:
        log_probs: [B, T] trainer log-probs (pi_train / pi_old) of the sampled tokens.
        rollout_log_probs: [B, T] rollout-engine log-probs of the same tokens.
        mask: [B, T] action mask.
        level, mode, gating: as above. low, high: the band ``[low, high]`` (inclusive).

    Returns:
        (is_weights [B, T], new_mask [B, T], metrics) with metrics ``rollout_kl`` (masked mean
        of ``log pi_roll - log pi_train``: the k1 estimate of KL(pi_roll || pi_train)),
        ``is_weight_mean`` (over the surviving tokens), ``clipped_frac`` (clip mode: tokens whose
        weight was clamped) and ``filtered_frac`` (mask mode: dropped units / units, at the unit's
        granularity: tokens, or sequences with at least one action token).
    """
    low = _validate(level, mode, gating, low, high)
    check_same_shape(log_probs=log_probs, rollout_log_probs=rollout_log_probs, mask=mask)
    m = as_bool(mask)
    zero = torch.zeros((), dtype=torch.float32, device=log_probs.device)
    lp = torch.where(m, log_probs.detach().float(), zero)
    roll = torch.where(m, rollout_log_probs.detach().float(), zero)
    log_w = (lp - roll).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    w = torch.where(m, log_w.exp(), zero)

    if gating == "ratio":
        stat = log_w.exp() if level == "token" else masked_mean(log_w, m, dim=1).exp()
    else:
        div = binary_kl(roll, lp) if gating == "binary_kl" else total_variation(roll, lp)
        stat = div if level == "token" else masked_mean(div, m, dim=1)
    metrics = {"rollout_kl": masked_metric(roll - lp, m)}

    if mode == "clip":
        weights = torch.where(m, w.clamp(low, high), zero)
        new_m = m
        metrics["clipped_frac"] = masked_metric((w < low) | (w > high), m)
    else:
        keep = (stat >= low) & (stat <= high)
        if level == "seq":
            has_tokens = m.any(dim=1)
            metrics["filtered_frac"] = masked_metric(~keep, has_tokens)
            keep = keep[:, None]
        else:
            metrics["filtered_frac"] = masked_metric(~keep, m)
        new_m = m & keep
        weights = torch.where(new_m, w, zero)
    metrics["is_weight_mean"] = masked_metric(weights, new_m)
    return weights, like_mask(new_m, mask), metrics


def tis(log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor, *, low: float = 0.5, high: float = 5.0):
    """Truncated IS (Yao et al., 2025, "Your efficient RL framework secretly brings you off-policy RL
    training"): weight ``clamp(w_t, low, high)``; nothing dropped."""
    return is_correction(
        log_probs, rollout_log_probs, mask, level="token", mode="clip", gating="ratio", low=low, high=high
    )


def icepop(log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor, *, low: float = 0.5, high: float = 5.0):
    """IcePop (Ling team, 2025): tokens with ``w_t`` outside ``[low, high]`` are dropped; others keep ``w_t``."""
    return is_correction(
        log_probs, rollout_log_probs, mask, level="token", mode="mask", gating="ratio", low=low, high=high
    )


def seq_mask_tis(log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor, *, low: float = 0.5, high: float = 5.0):
    """Sequences whose geometric-mean ratio ``exp(mean_t log w_t)`` is outside ``[low, high]`` are
    dropped; tokens of kept sequences keep their own unclamped ``w_t``."""
    return is_correction(
        log_probs, rollout_log_probs, mask, level="seq", mode="mask", gating="ratio", low=low, high=high
    )


def flash_reinforce_trust_region(log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor, *, high: float = 3e-3):
    """FlashREINFORCE's sequence trust region: drop sequences whose mean binary KL exceeds ``high``
    (delta); kept tokens carry ``w_t``."""
    return is_correction(
        log_probs, rollout_log_probs, mask, level="seq", mode="mask", gating="binary_kl", low=0.0, high=high
    )


IS_CORRECTIONS: dict[str, Callable[..., tuple[Tensor, Tensor, dict[str, Tensor]]]] = {
    "tis": tis,
    "icepop": icepop,
    "seq_mask_tis": seq_mask_tis,
    "flash_reinforce": flash_reinforce_trust_region,
}


def get_is_correction(name: str) -> Callable[..., tuple[Tensor, Tensor, dict[str, Tensor]]]:
    """Preset called ``name`` (``tis``, ``icepop``, ``seq_mask_tis`` or ``seq-mask-tis``,
    ``flash_reinforce``); ValueError lists them. Presets take ``(log_probs, rollout_log_probs,
    mask, *, low=..., high=...)`` (``flash_reinforce``: ``high`` only)."""
    return lookup(IS_CORRECTIONS, name, "IS correction")
