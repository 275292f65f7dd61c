"""Policy losses beyond PPO/GSPO: CISPO, SAPO, DPPO, DRO, GMPO, Clip-Cov and KL-Cov.

Same calling convention as :mod:`rlhforge.algorithms.policy_losses`:

    loss, metrics = fn(log_probs, old_log_probs, advantages, mask, *, is_weights=None, **hyper)

``log_probs`` [B, T] (differentiable), ``old_log_probs`` [B, T] (pi_old: the policy that sampled,
detached here), ``advantages`` [B, T] or [B], ``mask`` [B, T]. Returns the per-token loss [B, T] (0 at
masked positions) and detached 0-dim metrics. ``is_weights`` [B, T] (rollout-vs-trainer IS
correction) multiplies the per-token loss. ``r = exp(log_probs - old_log_probs)`` with the log-ratio
clamped to [-20, 20]; ``sg`` is stop-gradient. Formulas and defaults, with their sources:
``docs/algorithms.md``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._utils import masked_mean, masked_metric
from ._policy_common import _apply_weights, _approx_kl, _clip_bounds, _clipped_objective, _prepare

__all__ = [
    "cispo_loss",
    "sapo_loss",
    "dppo_loss",
    "dro_loss",
    "gmpo_loss",
    "clip_cov_loss",
    "kl_cov_loss",
    "covariance_scores",
    "clip_cov_selection",
    "kl_cov_selection",
]


def _safe_log_probs(log_probs: Tensor, m: Tensor, zero: Tensor) -> Tensor:
    return torch.where(m, log_probs, zero)  # inf/NaN at masked positions never reach the loss


def _common_metrics(log_ratio: Tensor, m: Tensor) -> dict[str, Tensor]:
    lr = log_ratio.detach()
    return {"approx_kl": _approx_kl(lr, m), "ppo_kl": masked_metric(-lr, m), "ratio_mean": masked_metric(lr.exp(), m)}


def cispo_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, *,
    eps_low: float | None = None, eps_high: float = 5.0, is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): ``l = -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi``.

    The clipped IS weight is detached: the gradient is ``-w A grad log pi`` on *every* token (a token
    with a large ratio still contributes, with weight ``1 + eps_high``). ``eps_low=None``: no lower
    clip (MiniMax-M1 tunes only the upper bound); ``eps_high`` 5.0 is TRL's recommendation (ScaleRL).
    Metrics: ``clip_frac`` (tokens whose weight was clamped), ``approx_kl``, ``ppo_kl``, ``ratio_mean``.
    """
    if eps_low is not None and not 0 <= eps_low <= 1:
        raise ValueError(f"CISPO eps_low must be in [0, 1] or None (got {eps_low})")
    if not eps_high >= 0:
        raise ValueError(f"CISPO eps_high must be >= 0 (got {eps_high})")
    m, log_ratio, adv, zero = _prepare(log_probs, old_log_probs, advantages, mask)
    ratio = log_ratio.detach().exp()
    lo = 0.0 if eps_low is None else 1.0 - eps_low
    weight = ratio.clamp(lo, 1.0 + eps_high)
    loss = -weight * adv * _safe_log_probs(log_probs, m, zero)
    loss = _apply_weights(loss, is_weights, m, zero)
    return loss, {"clip_frac": masked_metric(weight != ratio, m), **_common_metrics(log_ratio, m)}


def sapo_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, *,
    tau_pos: float = 1.0, tau_neg: float = 1.05, is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO (Soft Adaptive Policy Optimization, Qwen team, 2025): ``l = -f(r) A`` with the soft gate ``f(r) = (4 / tau) sigmoid(tau (r - 1))``,
    ``tau = tau_pos`` where ``A > 0`` else ``tau_neg`` (defaults 1.0 / 1.05, TRL's).

    ``f(1) = 2 / tau`` and ``f'(r) = 4 s (1 - s)`` with ``s = sigmoid(tau (r - 1))``, so at ``r = 1`` the
    gradient is the plain policy gradient; away from 1 it decays smoothly instead of being cut.
    Metrics: ``gate_mean`` (mean of ``f'(r) = 4 s (1 - s)``, 1 on-policy), ``approx_kl``, ``ppo_kl``, ``ratio_mean``.
    """
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"SAPO tau_pos and tau_neg must be > 0 (got {tau_pos}, {tau_neg})")
    m, log_ratio, adv, zero = _prepare(log_probs, old_log_probs, advantages, mask)
    ratio = log_ratio.exp()
    tau = torch.where(adv > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    s = torch.sigmoid(tau * (ratio - 1.0))
    loss = -(4.0 / tau) * s * adv
    loss = _apply_weights(loss, is_weights, m, zero)
    return loss, {"gate_mean": masked_metric(4.0 * s * (1.0 - s), m), **_common_metrics(log_ratio, m)}


def dppo_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, *,
    delta_low: float = 0.2, delta_high: float = 0.2, ratio_cap: float | None = None,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPPO (arXiv:2602.04879): a trust region on the *probability difference* ``d = p - p_old`` of the
    sampled token (``p = exp(log_probs)``), not on the ratio.

    A token is masked when ``A > 0`` and ``d > delta_high``, or ``A < 0`` and ``d < -delta_low``
    (defaults 0.2 / 0.2, prime-rl's). Kept tokens: ``l = -A * sg(min(r, C)) * log pi`` (``C = ratio_cap``;
    None: no cap, prime-rl's gradient ``-A r grad log pi``). Metrics: ``masked_frac``,
    ``masked_high_frac``, ``masked_low_frac``, ``approx_kl``, ``ppo_kl``, ``ratio_mean``.
    """
    if not (delta_low >= 0 and delta_high >= 0):
        raise ValueError(f"DPPO delta_low and delta_high must be >= 0 (got {delta_low}, {delta_high})")
    if ratio_cap is not None and not ratio_cap > 0:
        raise ValueError(f"DPPO ratio_cap must be > 0 or None (got {ratio_cap})")
    m, log_ratio, adv, zero = _prepare(log_probs, old_log_probs, advantages, mask)
    lp = _safe_log_probs(log_probs, m, zero)
    old = torch.where(m, old_log_probs.detach().to(lp.dtype), zero)
    diff = lp.detach().exp() - old.exp()
    high = (adv > 0) & (diff > delta_high) & m
    low = (adv < 0) & (diff < -delta_low) & m
    keep = m & ~high & ~low
    weight = log_ratio.detach().exp()
    if ratio_cap is not None:
        weight = weight.clamp(max=ratio_cap)
    loss = torch.where(keep, -adv * weight * lp, zero)
    loss = _apply_weights(loss, is_weights, m, zero)
    metrics = {"masked_frac": masked_metric(high | low, m), "masked_high_frac": masked_metric(high, m),
               "masked_low_frac": masked_metric(low, m), **_common_metrics(log_ratio, m)}
    return loss, metrics


def dro_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, *,
    beta: float = 0.05, is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """DRO (Richemond et al., 2024, arXiv:2405.19107; Tinker's ``dro``): per token
    ``l = -(A log pi - (beta / 2) (log pi - log pi_old)^2)``, beta 0.05 (Tinker's default).

    The quadratic term keeps pi near pi_old (the sampler's log-probs with ``rollout`` pi_old).
    Metrics: ``sq_log_ratio`` (mean of ``(log pi - log pi_old)^2``), ``approx_kl``, ``ppo_kl``, ``ratio_mean``.
    """
    if not beta >= 0:
        raise ValueError(f"DRO beta must be >= 0 (got {beta})")
    m, log_ratio, adv, zero = _prepare(log_probs, old_log_probs, advantages, mask)
    lp = _safe_log_probs(log_probs, m, zero)
    loss = -(adv * lp - 0.5 * beta * log_ratio.square())
    loss = _apply_weights(loss, is_weights, m, zero)
    return loss, {"sq_log_ratio": masked_metric(log_ratio.square(), m), **_common_metrics(log_ratio, m)}


def gmpo_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, *,
    eps_low: float = 0.4, eps_high: float = 0.4, is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO (arXiv:2507.20673): the geometric mean of the token ratios, clipped in log space.

    Per sequence i with ``A_i`` = the mean of its tokens' advantages and ``g = sign(A_i)``:
    ``c_t = clamp(log r_t, -eps_low, eps_high)`` (defaults 0.4 / 0.4: TRL's ``(e^-0.4, e^0.4)``),
    ``u_t = g * min(g log r_t, g c_t)`` (the pessimistic side, as PPO's min), and
    ``L_i = -A_i exp(mean_t u_t)``. Every action token of row i carries ``L_i``, so the
    ``seq_mean_token_mean`` aggregation (which the trainer uses for GMPO) gives ``mean_i L_i``.
    ``is_weights`` multiply each token's copy. Metrics: ``clip_frac`` (tokens whose log-ratio the
    min replaced), ``seq_ratio_mean``, ``approx_kl``, ``ppo_kl``.
    """
    if not (eps_low >= 0 and eps_high >= 0):
        raise ValueError(f"GMPO eps_low and eps_high must be >= 0 (got {eps_low}, {eps_high})")
    m, log_ratio, adv, zero = _prepare(log_probs, old_log_probs, advantages, mask)
    seq_adv = masked_mean(adv, m, dim=1)  # [B]
    g = torch.sign(seq_adv)[:, None]
    clipped = log_ratio.clamp(-eps_low, eps_high)
    u = g * torch.minimum(g * log_ratio, g * clipped)
    seq_log_ratio = masked_mean(u, m, dim=1)
    seq_loss = -seq_adv * seq_log_ratio.exp()
    loss = torch.where(m, seq_loss[:, None].expand_as(log_ratio), zero)
    loss = _apply_weights(loss, is_weights, m, zero)
    has_tokens = m.any(dim=1)
    metrics = {"clip_frac": masked_metric((u != log_ratio) & (g != 0), m),
               "seq_ratio_mean": masked_metric(masked_mean(log_ratio.detach(), m, dim=1).exp(), has_tokens),
               "approx_kl": _approx_kl(log_ratio.detach(), m), "ppo_kl": masked_metric(-log_ratio.detach(), m)}
    return loss, metrics


# ------------------------------------------------------------------------ covariance-based (Cui et al.)


def covariance_scores(log_probs: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """``cov_t = (A_t - mean A)(log pi_t - mean log pi)`` per action token (means over the action tokens
    of the batch), detached; ``-inf`` at masked positions. [B, T] -> [B, T]."""
    m, _, adv, zero = _prepare(log_probs, log_probs.detach(), advantages, mask)
    lp = _safe_log_probs(log_probs.detach(), m, zero)
    cov = (adv - masked_mean(adv, m)) * (lp - masked_mean(lp, m))
    return torch.where(m, cov, torch.full_like(cov, -math.inf))


def _budget(ratio: float, m: Tensor) -> int:
    return max(1, int(ratio * int(m.sum()))) if ratio > 0 and m.any() else 0


def clip_cov_selection(cov: Tensor, candidates: Tensor, budget: int, lb: float, ub: float,
                       generator: torch.Generator | None = None) -> Tensor:
    """The tokens Clip-Cov zeroes: ``budget`` tokens drawn uniformly at random (``generator``; None: torch's
    global RNG) from the ``candidates`` whose ``cov`` lies in ``[lb, ub]`` (all of them if fewer
    qualify). Bool [B, T]."""
    pool = candidates & (cov >= lb) & (cov <= ub)
    idx = pool.flatten().nonzero().squeeze(-1)
    k = min(budget, idx.numel())
    chosen = idx[torch.randperm(idx.numel(), generator=generator, device=idx.device)[:k]] if k else idx[:0]
    out = torch.zeros(pool.numel(), dtype=torch.bool, device=pool.device)
    out[chosen] = True
    return out.view_as(pool)


def kl_cov_selection(cov: Tensor, mask: Tensor, ratio: float) -> Tensor:
    """The ``max(1, floor(ratio * N))`` (0 when ``ratio = 0``) action tokens with the largest ``cov`` (KL-Cov). Bool [B, T]."""
    k = _budget(ratio, mask)
    out = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
    if k:
        out[torch.topk(cov.flatten(), k).indices] = True
    return out.view_as(cov) & mask


def clip_cov_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, *,
    eps_low: float = 0.2, eps_high: float | None = None, dual_clip: float | None = None,
    clip_cov_ratio: float = 2e-4, clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None, is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov (Cui et al., 2025, arXiv:2505.22617): the PPO loss (``ppo_loss``: clip, dual clip) with a
    random ``max(1, floor(clip_cov_ratio * N))`` (N = action tokens) of the tokens whose ``cov(A, log pi)`` lies in
    ``[clip_cov_lb, clip_cov_ub]`` set to 0 (value and gradient): ``clip_cov_selection`` over the tokens
    the PPO clip left active (defaults 2e-4, 1, 5: veRL's). The covariance is over this micro-batch's
    action tokens. Metrics: ``cov_selected_frac``, ``clip_frac``, ``dual_clip_frac``, ``approx_kl``,
    ``ppo_kl``, ``ratio_mean``.
    """
    if not 0 <= clip_cov_ratio <= 1 or not clip_cov_lb <= clip_cov_ub:
        raise ValueError(f"Clip-Cov needs 0 <= ratio <= 1 and lb <= ub (got {clip_cov_ratio}, "
                         f"[{clip_cov_lb}, {clip_cov_ub}])")
    m, log_ratio, adv, zero = _prepare(log_probs, old_log_probs, advantages, mask)
    lo, hi = _clip_bounds(eps_low, eps_high)
    ratio = log_ratio.exp()
    loss, clipped, dual = _clipped_objective(ratio, adv, lo, hi, dual_clip)
    cov = covariance_scores(log_probs, advantages, mask)
    selected = clip_cov_selection(cov, m & ~clipped & ~dual, _budget(clip_cov_ratio, m), clip_cov_lb, clip_cov_ub,
                                  generator)
    loss = torch.where(selected, zero, loss)
    loss = _apply_weights(loss, is_weights, m, zero)
    metrics = {"cov_selected_frac": masked_metric(selected, m), "clip_frac": masked_metric(clipped, m),
               "dual_clip_frac": masked_metric(dual, m), **_common_metrics(log_ratio, m)}
    return loss, metrics


def kl_cov_loss(
    log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, *,
    kl_cov_ratio: float = 2e-4, ppo_kl_coef: float = 1.0, is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov (Cui et al., 2025, arXiv:2505.22617): ``l = -A r`` on every token (no clip), plus
    ``ppo_kl_coef * |log r|`` on the ``max(1, floor(kl_cov_ratio * N))`` tokens with the largest
    ``cov(A, log pi)`` (``kl_cov_selection``; defaults 2e-4 and 1.0: veRL's). Metrics:
    ``cov_selected_frac``, ``approx_kl``, ``ppo_kl``, ``ratio_mean``.
    """
    if not 0 <= kl_cov_ratio <= 1 or not ppo_kl_coef >= 0:
        raise ValueError(f"KL-Cov needs 0 <= kl_cov_ratio <= 1 and ppo_kl_coef >= 0 (got {kl_cov_ratio}, "
                         f"{ppo_kl_coef})")
    m, log_ratio, adv, zero = _prepare(log_probs, old_log_probs, advantages, mask)
    selected = kl_cov_selection(covariance_scores(log_probs, advantages, mask), m, kl_cov_ratio)
    loss = -adv * log_ratio.exp()
    loss = torch.where(selected, loss + ppo_kl_coef * log_ratio.abs(), loss)
    loss = _apply_weights(loss, is_weights, m, zero)
    return loss, {"cov_selected_frac": masked_metric(selected, m), **_common_metrics(log_ratio, m)}
