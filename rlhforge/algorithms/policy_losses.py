"""Policy-gradient losses: PPO (asymmetric clip, dual clip), GSPO, FlashREINFORCE, entropy bonus, and the
name table ``POLICY_LOSSES`` (which also holds CISPO, SAPO, DPPO, DRO, GMPO, Clip-Cov and KL-Cov from
:mod:`.policy_losses_2026`).

Every loss in ``POLICY_LOSSES`` is called as

    loss, metrics = fn(log_probs, old_log_probs, advantages, mask, *, is_weights=None, **hyper)

with ``log_probs`` [B, T] (current policy, differentiable), ``old_log_probs`` [B, T] (the policy
that sampled / was recomputed at experience time), ``advantages`` [B, T] or [B] (broadcast over
tokens), ``mask`` [B, T]. It returns the per-token loss [B, T] (0 at masked positions; aggregate
with ``aggregation.aggregate_loss``) and a dict of detached 0-dim metric tensors. ``is_weights``
[B, T] (from ``corrections``) multiplies the per-token loss; it is detached here.

Ratios are computed from the log-ratio clamped to [-20, 20] (``exp(20)`` is finite in every
float dtype), after masked positions are replaced by 0, so inf/NaN there never leak.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ._policy_common import LOG_RATIO_CLAMP, _apply_weights, _approx_kl, _clip_bounds, _clipped_objective, _prepare
from ._utils import as_bool, check_same_shape, lookup, masked_mean, masked_metric
from .kl import binary_kl
from .policy_losses_2026 import (
    cispo_loss, clip_cov_loss, dppo_loss, dro_loss, gmpo_loss, kl_cov_loss, sapo_loss,
)

__all__ = [
    "ppo_loss",
    "gspo_loss",
    "flash_reinforce_loss",
    "entropy_bonus",
    "POLICY_LOSSES",
    "get_policy_loss",
    "LOG_RATIO_CLAMP",
]

def ppo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float | None = None,
    dual_clip: float | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (Schulman et al., 2017, arXiv:1707.06347) per token.

    ``rho = exp(logp - old_logp)``, ``l = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A)``.
    ``eps_high`` defaults to ``eps_low``; a larger one is DAPO's clip-higher (Yu et al., 2025,
    arXiv:2503.14476; 0.2 / 0.28). Dual clip (Ye et al., 2020, arXiv:1912.09729), ``c > 1``, only
    for ``A < 0``: ``l = min(l, -c A)``, i.e. ``-max(min(s1, s2), c A)``.

    Metrics: ``clip_frac`` (tokens with ``s2 < s1``), ``dual_clip_frac`` (tokens where the dual
    bound was applied), ``approx_kl`` (k3 estimate of KL(pi_old || pi): mean of
    ``(rho - 1) - log rho``), ``ppo_kl`` (OpenRLHF's: the k1 mean of ``old_logp - logp``, signed),
    ``ratio_mean``.
    """
    m, log_ratio, adv, zero = _prepare(log_probs, old_log_probs, advantages, mask)
    lo, hi = _clip_bounds(eps_low, eps_high)
    ratio = log_ratio.exp()
    loss, clipped, dual = _clipped_objective(ratio, adv, lo, hi, dual_clip)
    loss = _apply_weights(loss, is_weights, m, zero)
    metrics = {
        "clip_frac": masked_metric(clipped, m),
        "dual_clip_frac": masked_metric(dual, m),
        "approx_kl": _approx_kl(log_ratio.detach(), m),
        "ppo_kl": masked_metric(-log_ratio.detach(), m),
        "ratio_mean": masked_metric(ratio, m),
    }
    return loss, metrics


def gspo_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float | None = 4e-4,
    dual_clip: float | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al., 2025, arXiv:2507.18071), the token form ("GSPO-token").

    Sequence ratio ``s_i = exp(mean_t (logp_t - old_logp_t))`` (geometric mean over action
    tokens). Each token uses ``s_it = sg(s_i) * exp(logp_t - sg(logp_t))``: its value is ``s_i``
    and its gradient is ``s_i * grad logp_t``, so with a sequence-constant advantage and
    ``seq_mean_token_mean`` aggregation the gradient is exactly GSPO's ``A_i grad s_i``. The
    PPO clip (defaults 3e-4 / 4e-4, the paper's) and optional dual clip apply to ``s_it``.

    Metrics: ``clip_frac`` (token-weighted), ``approx_kl`` (token k3 as in ``ppo_loss``), ``ppo_kl``,
    ``seq_ratio_mean`` (mean of ``s_i`` over sequences with action tokens).
    """
    m, log_ratio, adv, zero = _prepare(log_probs, old_log_probs, advantages, mask)
    lo, hi = _clip_bounds(eps_low, eps_high)
    seq_log_ratio = masked_mean(log_ratio, m, dim=1).detach()  # [B]
    safe_lp = torch.where(m, log_probs, zero)  # inf/NaN at masked positions never reach exp
    token_log_ratio = torch.where(m, seq_log_ratio[:, None] + (safe_lp - safe_lp.detach()), zero)
    ratio = token_log_ratio.exp()
    loss, clipped, dual = _clipped_objective(ratio, adv, lo, hi, dual_clip)
    loss = _apply_weights(loss, is_weights, m, zero)
    has_tokens = m.any(dim=1)
    metrics = {
        "clip_frac": masked_metric(clipped, m),
        "dual_clip_frac": masked_metric(dual, m),
        "approx_kl": _approx_kl(log_ratio.detach(), m),
        "ppo_kl": masked_metric(-log_ratio.detach(), m),
        "seq_ratio_mean": masked_metric(seq_log_ratio.exp(), has_tokens),
    }
    return loss, metrics


def flash_reinforce_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    delta: float = 3e-3,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """FlashREINFORCE (Hu, Zhang et al., 2026): importance-weighted REINFORCE with a sequence trust region.

    ``old_log_probs`` are the behaviour (rollout) policy's log-probs mu. Per token, with the
    detached ratio ``w_t = exp(logp_t - log mu_t)``:

        l_t = -A * sg(w_t) * exp(logp_t - sg(logp_t))     (value -A w_t, gradient -A w_t grad logp_t)

    A sequence is dropped (all its ``l_t = 0``) when the mean over its action tokens of the
    binary KL ``KL_bin(p_t || q_t)`` with ``p_t = mu_t`` (the rollout probability of the sampled
    token) and ``q_t = exp(logp_t)`` (probabilities clamped to [1e-6, 1 - 1e-6]) exceeds
    ``delta``: the same direction as OpenRLHF's ``binary_kl`` gating
    (``corrections.is_correction``: p = pi_roll, q = pi_train) (default 3e-3, the paper's Qwen2.5-Math setting;
    ``float('inf')`` disables the gate). Advantages are the scalar reward minus the batch mean
    (``advantages.batch_mean_baseline`` / estimator ``flash_reinforce``).

    Aggregate with ``seq_mean_token_mean`` over the *original* mask and sequence count: dropped
    sequences stay in the batch with loss 0 (per-sequence token mean, then batch mean).

    Metrics: ``trust_region_drop_frac`` (dropped / sequences with tokens), ``seq_binary_kl_mean``,
    ``is_weight_mean``, ``approx_kl``.
    """
    if not delta >= 0:
        raise ValueError(f"delta must be >= 0 (got {delta})")
    m, log_ratio, adv, zero = _prepare(log_probs, old_log_probs, advantages, mask)
    w = log_ratio.detach().exp()
    safe_lp = torch.where(m, log_probs, zero)  # inf/NaN at masked positions never reach exp
    safe_mu = torch.where(m, old_log_probs.detach().to(log_probs.dtype), zero)
    seq_kl = masked_mean(binary_kl(safe_mu, safe_lp), m, dim=1)  # [B]: KL_bin(mu || pi_theta)
    keep_seq = seq_kl <= delta
    has_tokens = m.any(dim=1)
    unit = torch.exp(safe_lp - safe_lp.detach())
    loss = -adv * w * unit
    loss = torch.where(keep_seq[:, None], loss, zero)
    loss = _apply_weights(loss, is_weights, m, zero)
    metrics = {
        "trust_region_drop_frac": masked_metric(~keep_seq, has_tokens),
        "seq_binary_kl_mean": masked_metric(seq_kl, has_tokens),
        "is_weight_mean": masked_metric(w, m),
        "approx_kl": _approx_kl(log_ratio.detach(), m),
    }
    return loss, metrics


def entropy_bonus(entropy: Tensor, mask: Tensor, coef: float) -> Tensor:
    """Per-token entropy term to *add* to the policy loss: ``-coef * H_t``. [B, T] -> [B, T].

    0 at masked positions; aggregate like the policy loss. ``coef = 0`` gives zeros (log entropy
    separately).
    """
    check_same_shape(entropy=entropy, mask=mask)
    m = as_bool(mask)
    return torch.where(m, -coef * entropy, torch.zeros((), dtype=entropy.dtype, device=entropy.device))


POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    "ppo": ppo_loss,
    "gspo": gspo_loss,
    "flash_reinforce": flash_reinforce_loss,
    "cispo": cispo_loss,
    "sapo": sapo_loss,
    "dppo": dppo_loss,
    "dro": dro_loss,
    "gmpo": gmpo_loss,
    "clip_cov": clip_cov_loss,
    "kl_cov": kl_cov_loss,
}


def get_policy_loss(name: str) -> Callable[..., tuple[Tensor, dict[str, Tensor]]]:
    """The policy loss called ``name`` (a key of ``POLICY_LOSSES``); ValueError lists them."""
    return lookup(POLICY_LOSSES, name, "policy loss")
