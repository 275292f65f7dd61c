"""KL estimators between the policy and a reference (or behaviour) policy, per sampled token.

With ``x = log pi(a) - log pi_ref(a)`` for a token ``a`` sampled from ``pi`` (Schulman, 2020,
"Approximating KL Divergence", http://joschu.net/blog/kl-approx.html):

- ``k1``: ``x``                      unbiased for KL(pi || pi_ref), high variance, can be < 0;
- ``k2``: ``x**2 / 2``               biased, low variance, >= 0;
- ``k3``: ``exp(-x) - 1 + x``        unbiased, low variance, >= 0.

The *estimate* is clamped to ``[-clamp, clamp]`` (default 10, for k1, k2 and k3 alike), as
OpenRLHF's ``compute_approx_kl`` does. So that ``k3`` cannot overflow (``exp(-x)`` for a very
negative ``x``) and turn a zero gradient into NaN, the log-ratio is first limited to
``[-(clamp + 2), clamp + 2]``; every estimator is already past ``clamp`` there, so this changes
no value (and no gradient: both are 0 beyond the clamp). The difference is computed in at least
fp32. Pass ``clamp=None`` to disable both. Positions outside ``mask`` are 0 whatever the inputs
hold there (inf and NaN included).

How KL enters training:

- as a per-token reward penalty ``r_t -= beta * KL_t`` (``advantages.assemble_token_rewards``;
  k1 is the usual choice);
- as a loss term ``beta * agg(kl_loss(...))`` added to the policy loss (GRPO style; k3 or k2);
  ``kl_loss_unbiased_gradient`` keeps that term's value but back-propagates the importance-weighted
  reverse-KL gradient (OpenRLHF's ``--algo.kl.unbiased_gradient``, PR 1309).

``binary_kl`` and ``total_variation`` compare two policies on the sampled token only; the
importance-sampling corrections and FlashREINFORCE's trust region use them.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

from ._utils import as_bool, check_same_shape, lookup

__all__ = [
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "KL_ESTIMATORS",
    "get_kl_estimator",
    "compute_kl",
    "kl_loss",
    "kl_loss_unbiased_gradient",
    "DEFAULT_KL_IS_WEIGHT_CLIP",
    "binary_kl",
    "total_variation",
    "DEFAULT_KL_CLAMP",
]

DEFAULT_KL_CLAMP = 10.0
"""OpenRLHF clamps every KL estimate to [-10, 10]."""


def kl_k1(log_ratio: Tensor) -> Tensor:
    """k1 = x. ``log_ratio`` x: [B, T] -> [B, T]."""
    return log_ratio


def kl_k2(log_ratio: Tensor) -> Tensor:
    """k2 = x^2 / 2. [B, T] -> [B, T]."""
    return 0.5 * log_ratio.square()


def kl_k3(log_ratio: Tensor) -> Tensor:
    """k3 = exp(-x) - 1 + x (>= 0), computed as ``expm1(-x) + x`` for accuracy near 0. [B, T] -> [B, T]."""
    return torch.expm1(-log_ratio) + log_ratio


KL_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def get_kl_estimator(name: str) -> Callable[[Tensor], Tensor]:
    """The estimator function (log-ratio -> per-token KL) called ``name``; ValueError lists the valid ones."""
    return lookup(KL_ESTIMATORS, name, "KL estimator")


def compute_kl(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    mask: Tensor | None = None,
    estimator: str = "k1",
    clamp: float | None = DEFAULT_KL_CLAMP,
) -> Tensor:
    """Per-token KL estimate of KL(pi || pi_ref) from log-probs of the sampled tokens.

    Args:
        log_probs: [B, T] log pi of the sampled tokens (differentiable if you want a loss).
        ref_log_probs: [B, T] log pi_ref of the same tokens.
        mask: [B, T] action mask (float or bool) or None for all positions.
        estimator: ``k1`` | ``k2`` | ``k3``.
        clamp: clamp the estimate to ``[-c, c]`` (OpenRLHF: 10); None disables.

    Returns:
        [B, T] in at least fp32, 0 at masked positions.
    """
    check_same_shape(log_probs=log_probs, ref_log_probs=ref_log_probs)
    fn = get_kl_estimator(estimator)
    dtype = torch.promote_types(log_probs.dtype, torch.float32)
    x = log_probs.to(dtype) - ref_log_probs.to(dtype)
    if mask is not None:
        check_same_shape(log_probs=log_probs, mask=mask)
        x = torch.where(as_bool(mask), x, torch.zeros_like(x))
    if clamp is not None:
        if not clamp >= 0:
            raise ValueError(f"the KL clamp must be >= 0 or None (got {clamp})")
        # every estimator is beyond `clamp` once |x| > clamp + 2 (k3(-(c+2)) = e^(c+2) - c - 3 > c):
        # limiting x there changes no value, and keeps exp(-x) finite for the backward pass
        x = x.clamp(-(clamp + 2.0), clamp + 2.0)
    kl = fn(x)
    if clamp is not None:
        kl = kl.clamp(-clamp, clamp)
    if mask is not None:
        kl = torch.where(as_bool(mask), kl, torch.zeros_like(kl))
    return kl


def kl_loss(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    mask: Tensor,
    estimator: str = "k3",
    clamp: float | None = DEFAULT_KL_CLAMP,
) -> Tensor:
    """Per-token KL penalty for the loss (before aggregation), differentiable w.r.t. ``log_probs``.

    Shapes: [B, T] inputs and mask -> [B, T], 0 at masked positions. Aggregate with
    ``aggregation.aggregate_loss`` and scale by the KL coefficient (beta) in the trainer.
    """
    return compute_kl(log_probs, ref_log_probs.detach(), mask, estimator, clamp)


DEFAULT_KL_IS_WEIGHT_CLIP = 10.0
"""Upper clamp of the detached importance weight ``pi_theta / pi_old`` in the unbiased KL gradient."""


def kl_loss_unbiased_gradient(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    mask: Tensor,
    estimator: str = "k3",
    old_log_probs: Tensor | None = None,
    clamp: float | None = DEFAULT_KL_CLAMP,
    is_weight_clip: float = DEFAULT_KL_IS_WEIGHT_CLIP,
) -> Tensor:
    """Per-token KL loss whose *value* is ``kl_loss(...)`` (the chosen estimator, clamped) and whose
    *gradient* w.r.t. ``log_probs`` is the importance-weighted reverse-KL score-function term

        d loss_t / d log pi(a_t) = w_t * (log pi(a_t) - log pi_ref(a_t)),
        w_t = min(exp(log pi(a_t) - log pi_old(a_t)), is_weight_clip)   (detached; 1 if no pi_old).

    Why: the tokens were sampled from pi_old, and ``E_{a~pi_old}[w * x * grad log pi]`` is
    ``grad KL(pi || pi_ref)`` (the reverse KL), whereas differentiating k1 gives a gradient that
    vanishes in expectation, k3's descends the forward KL, and k2's is unbiased only on-policy.
    The log-ratio in the gradient is not clamped (the value is); masked positions give 0 and 0.

    Shapes: [B, T] inputs and mask -> [B, T]. ``old_log_probs`` [B, T] or None (on-policy, w = 1).
    """
    value = compute_kl(log_probs.detach(), ref_log_probs.detach(), mask, estimator, clamp)
    keep = as_bool(mask)
    dtype = torch.promote_types(log_probs.dtype, torch.float32)
    lp = torch.where(keep, log_probs.to(dtype), torch.zeros((), dtype=dtype, device=log_probs.device))
    with torch.no_grad():
        x = torch.where(keep, log_probs.to(dtype) - ref_log_probs.to(dtype), torch.zeros_like(lp))
        if old_log_probs is None:
            w = torch.ones_like(x)
        else:
            check_same_shape(log_probs=log_probs, old_log_probs=old_log_probs)
            log_w = torch.where(keep, log_probs.to(dtype) - old_log_probs.to(dtype), torch.zeros_like(x))
            w = log_w.clamp(max=math.log(is_weight_clip)).exp()
        coef = w * x
    surrogate = coef * lp
    return value + (surrogate - surrogate.detach())


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, accurate on both sides of -log 2."""
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def _clamped_log_probs(log_p: Tensor, eps: float) -> Tensor:
    return log_p.clamp(math.log(eps), math.log1p(-eps))


def binary_kl(log_p: Tensor, log_q: Tensor, eps: float = 1e-6) -> Tensor:
    """Bernoulli KL between sampled-token probabilities, ``p = exp(log_p)``, ``q = exp(log_q)``.

    ``KL_bin(p || q) = p log(p/q) + (1-p) log((1-p)/(1-q))``, with both probabilities clamped to
    ``[eps, 1 - eps]`` (so it is always finite) and ``log(1-p)`` computed with ``log1mexp``.

    Shapes: [B, T], [B, T] -> [B, T], >= 0. Not differentiable by intent: use for gates.
    """
    check_same_shape(log_p=log_p, log_q=log_q)
    lp = _clamped_log_probs(log_p.detach().float(), eps)
    lq = _clamped_log_probs(log_q.detach().float(), eps)
    p = lp.exp()
    kl = p * (lp - lq) + (1.0 - p) * (_log1mexp(lp) - _log1mexp(lq))
    return kl.clamp_min(0.0)


def total_variation(log_p: Tensor, log_q: Tensor, eps: float = 1e-6) -> Tensor:
    """``|p - q|`` on the sampled token (probabilities clamped to [eps, 1-eps]). [B, T] -> [B, T]."""
    check_same_shape(log_p=log_p, log_q=log_q)
    lp = _clamped_log_probs(log_p.detach().float(), eps)
    lq = _clamped_log_probs(log_q.detach().float(), eps)
    return (lp.exp() - lq.exp()).abs()
