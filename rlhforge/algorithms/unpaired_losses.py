"""Unpaired preference losses: KTO (Ethayarajh et al., 2024, arXiv:2402.01306) as TRL's ``KTOTrainer`` computes
it, and TRL's ``apo_zero_unpaired`` (APO-zero for unpaired data, D'Oosterlinck et al., 2024, arXiv:2408.06266).

Each example is one completion ``y`` of a prompt ``x`` labelled desirable or undesirable, with the summed
response log-ratio ``h = log pi(y|x) - log pi_ref(y|x)``:

- ``kto``: desirable ``1 - sigmoid(beta (h - z))``, undesirable ``1 - sigmoid(beta (z - h))``, where the reference
  point ``z`` is a detached estimate of KL(pi || pi_ref): the mean log-ratio of *mismatched* completions (the
  prompt of one example with the completion of another), averaged over the data-parallel ranks, clamped at 0
  (:func:`kto_kl_estimate`, then the caller's all-reduce, then :func:`kto_reference_point`);
- ``apo_zero_unpaired``: desirable ``1 - sigmoid(beta h)``, undesirable ``sigmoid(beta h)`` (no reference point).

Desirable losses are multiplied by ``desirable_weight``, undesirable ones by ``undesirable_weight``; the batch
loss is the mean over every example (TRL: ``losses.mean()`` over the concatenated weighted losses).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ._utils import as_bool, check_same_shape, lookup

__all__ = ["KTO_LOSS_TYPES", "kto_kl_estimate", "kto_reference_point", "kto_losses", "get_kto_loss"]


def kto_kl_estimate(policy_kl_logps: Tensor, ref_kl_logps: Tensor) -> Tensor:
    """This rank's detached KL estimate: the mean of ``log pi - log pi_ref`` over the mismatched completions
    [B] -> 0-dim (average it over the ranks, then :func:`kto_reference_point`)."""
    check_same_shape(policy_kl_logps=policy_kl_logps, ref_kl_logps=ref_kl_logps)
    return (policy_kl_logps.detach() - ref_kl_logps.detach()).mean()


def kto_reference_point(kl_mean_over_ranks: Tensor) -> Tensor:
    """KTO's reference point ``z``: the rank-averaged KL estimate, clamped at 0 (a KL is never negative)."""
    return kl_mean_over_ranks.detach().clamp(min=0)


def _weighted(desirable: Tensor, d_loss: Tensor, u_loss: Tensor, desirable_weight: float,
              undesirable_weight: float) -> Tensor:
    return torch.where(desirable, desirable_weight * d_loss, undesirable_weight * u_loss)


def kto_loss(policy_logps: Tensor, ref_logps: Tensor, desirable: Tensor, *, beta: float, reference_point: Tensor,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> tuple[Tensor, Tensor]:
    """Per-example KTO losses [B] (differentiable through ``policy_logps``) and implicit rewards
    ``beta h`` [B] (detached). ``desirable``: bool [B]; ``reference_point``: 0-dim ``z``."""
    check_same_shape(policy_logps=policy_logps, ref_logps=ref_logps)
    h = policy_logps - ref_logps
    z = reference_point.detach().to(h.dtype)
    losses = _weighted(as_bool(desirable), 1 - torch.sigmoid(beta * (h - z)), 1 - torch.sigmoid(beta * (z - h)),
                       desirable_weight, undesirable_weight)
    return losses, (beta * h).detach()


def apo_zero_unpaired_loss(policy_logps: Tensor, ref_logps: Tensor, desirable: Tensor, *, beta: float,
                           reference_point: Tensor | None = None, desirable_weight: float = 1.0,
                           undesirable_weight: float = 1.0) -> tuple[Tensor, Tensor]:
    """Per-example APO-zero (unpaired) losses [B] and implicit rewards ``beta h`` [B]; no reference point
    (``reference_point`` is accepted and ignored, so both losses share one call)."""
    check_same_shape(policy_logps=policy_logps, ref_logps=ref_logps)
    h = policy_logps - ref_logps
    losses = _weighted(as_bool(desirable), 1 - torch.sigmoid(beta * h), torch.sigmoid(beta * h),
                       desirable_weight, undesirable_weight)
    return losses, (beta * h).detach()


KTO_LOSS_TYPES: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {
    "kto": kto_loss,
    "apo_zero_unpaired": apo_zero_unpaired_loss,
}


def kto_losses(name: str, policy_logps: Tensor, ref_logps: Tensor, desirable: Tensor, **kwargs) -> tuple[Tensor, Tensor]:
    """The per-example losses and implicit rewards of the unpaired loss ``name`` (``kto``, ``apo_zero_unpaired``)."""
    return get_kto_loss(name)(policy_logps, ref_logps, desirable, **kwargs)


def get_kto_loss(name: str) -> Callable[..., tuple[Tensor, Tensor]]:
    """The unpaired loss called ``name``; ValueError lists the names."""
    return lookup(KTO_LOSS_TYPES, name, "KTO loss type")
