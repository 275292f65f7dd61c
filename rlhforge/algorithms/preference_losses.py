"""Pairwise preference losses: reward-model losses and the DPO family (DPO, cDPO, IPO).

Reward model (Bradley-Terry; Ouyang et al., 2022, arXiv:2203.02155), per pair (r_c, r_r):

- ``sigmoid``: ``-log sigmoid(r_c - r_r - margin)``;
- ``logexp``:  ``log(1 + exp(r_r - r_c + margin))`` (the same function written as a softplus; kept
  for OpenRLHF parity; here it honours the margin too).

DPO family, with summed (or length-averaged) response log-probs and
``h = (log pi_c - log pi_r) - (log pi_ref_c - log pi_ref_r)``:

- ``sigmoid`` (DPO, Rafailov et al., 2023, arXiv:2305.18290): ``-log sigmoid(beta h)``;
- ``cdpo`` (conservative DPO, Mitchell, 2023): ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``;
- ``ipo`` (Azar et al., 2023, arXiv:2310.12036): ``(h - 1 / (2 beta))^2``.

Each DPO loss returns ``(loss, chosen_rewards, rejected_rewards)``: the mean loss over pairs
(0-dim, differentiable) and the detached implicit rewards ``beta (log pi - log pi_ref)`` [B].
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from ._utils import as_bool, check_same_shape, lookup

__all__ = [
    "rm_sigmoid_loss",
    "rm_logexp_loss",
    "RM_LOSSES",
    "get_rm_loss",
    "dpo_sigmoid_loss",
    "cdpo_loss",
    "ipo_loss",
    "DPO_LOSSES",
    "PREFERENCE_LOSSES",
    "get_dpo_loss",
    "sequence_logps",
    "implicit_rewards",
    "preference_accuracy",
    "chosen_nll_loss",
]


# ---------------------------------------------------------------- reward model


def _margin(chosen: Tensor, margin: Tensor | float | None) -> Tensor | float:
    if margin is None:
        return 0.0
    if isinstance(margin, Tensor):
        return margin.to(chosen.dtype)
    return float(margin)


def rm_sigmoid_loss(chosen_rewards: Tensor, rejected_rewards: Tensor, margin: Tensor | float | None = None) -> Tensor:
    """``mean(-log sigmoid(r_c - r_r - margin))``. Rewards [B], margin [B] or scalar -> 0-dim loss."""
    check_same_shape(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards)
    return -F.logsigmoid(chosen_rewards - rejected_rewards - _margin(chosen_rewards, margin)).mean()


def rm_logexp_loss(chosen_rewards: Tensor, rejected_rewards: Tensor, margin: Tensor | float | None = None) -> Tensor:
    """``mean(log(1 + exp(r_r - r_c + margin)))`` via softplus (no overflow). [B] -> 0-dim."""
    check_same_shape(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards)
    return F.softplus(rejected_rewards - chosen_rewards + _margin(chosen_rewards, margin)).mean()


RM_LOSSES: dict[str, Callable[..., Tensor]] = {"sigmoid": rm_sigmoid_loss, "logexp": rm_logexp_loss}


def get_rm_loss(name: str) -> Callable[..., Tensor]:
    """Reward-model loss called ``name`` (``sigmoid``, ``logexp``); ValueError lists them."""
    return lookup(RM_LOSSES, name, "reward-model loss")


def preference_accuracy(chosen_rewards: Tensor, rejected_rewards: Tensor) -> Tensor:
    """Fraction of pairs with ``r_c > r_r`` (ties count as wrong). [B] -> 0-dim float, detached."""
    check_same_shape(chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards)
    return (chosen_rewards.detach() > rejected_rewards.detach()).float().mean()


# ---------------------------------------------------------------- DPO family


def sequence_logps(token_logps: Tensor, mask: Tensor, average: bool = False) -> Tensor:
    """Sum (or mean, ``average=True``) of response-token log-probs per sequence. [B, T] -> [B].

    Masked positions are ignored; an empty row gives 0.
    """
    check_same_shape(token_logps=token_logps, mask=mask)
    m = as_bool(mask)
    total = torch.where(m, token_logps, torch.zeros((), dtype=token_logps.dtype, device=token_logps.device)).sum(-1)
    if average:
        total = total / m.sum(-1).clamp_min(1).to(total.dtype)
    return total


def implicit_rewards(policy_logps: Tensor, ref_logps: Tensor, beta: float) -> Tensor:
    """DPO implicit reward ``beta * (log pi - log pi_ref)``, detached. [B] -> [B]."""
    return (beta * (policy_logps - ref_logps)).detach()


def _log_ratio_diff(pc, pr, rc, rr):
    check_same_shape(policy_chosen_logps=pc, policy_rejected_logps=pr, ref_chosen_logps=rc, ref_rejected_logps=rr)
    return (pc - pr) - (rc.detach() - rr.detach())


def _check_beta(beta: float) -> None:
    if not beta > 0:
        raise ValueError(f"beta must be > 0 (got {beta})")


def dpo_sigmoid_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """DPO; with ``label_smoothing`` eps > 0 it is cDPO. All inputs [B] sequence log-probs.

    ``l = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``, mean over pairs.
    Returns (loss 0-dim, chosen_rewards [B], rejected_rewards [B]).
    """
    _check_beta(beta)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5) (got {label_smoothing})")
    h = _log_ratio_diff(policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps)
    loss = -(1.0 - label_smoothing) * F.logsigmoid(beta * h)
    if label_smoothing > 0:
        loss = loss - label_smoothing * F.logsigmoid(-beta * h)
    return (
        loss.mean(),
        implicit_rewards(policy_chosen_logps, ref_chosen_logps, beta),
        implicit_rewards(policy_rejected_logps, ref_rejected_logps, beta),
    )


def cdpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.1,
) -> tuple[Tensor, Tensor, Tensor]:
    """Conservative DPO: ``dpo_sigmoid_loss`` with label smoothing eps (default 0.1, must be > 0)."""
    if not label_smoothing > 0:
        raise ValueError(f"cdpo needs label_smoothing > 0 (got {label_smoothing}); use 'sigmoid' for plain DPO")
    return dpo_sigmoid_loss(
        policy_chosen_logps,
        policy_rejected_logps,
        ref_chosen_logps,
        ref_rejected_logps,
        beta=beta,
        label_smoothing=label_smoothing,
    )


def ipo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    *,
    beta: float = 0.1,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """IPO: ``(h - 1 / (2 beta))^2``, mean over pairs. Inputs [B] sequence log-probs.

    IPO's target ``1/(2 beta)`` is a fixed log-ratio gap, so with *summed* log-probs the effective
    target per token shrinks with length. Pass ``chosen_lengths`` / ``rejected_lengths`` [B]
    (response token counts) to divide the chosen / rejected log-probs (policy and reference) by
    them, i.e. use length-averaged log-probs as the IPO paper does; or pass averaged log-probs
    directly (``sequence_logps(..., average=True)``). Both lengths or neither.
    Returns (loss, chosen_rewards, rejected_rewards), rewards from the log-probs actually used.
    """
    _check_beta(beta)
    if (chosen_lengths is None) != (rejected_lengths is None):
        raise ValueError("pass both chosen_lengths and rejected_lengths, or neither")
    pc, pr, rc, rr = policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps
    if chosen_lengths is not None:
        lc = chosen_lengths.to(pc.dtype).clamp_min(1)
        lr = rejected_lengths.to(pc.dtype).clamp_min(1)
        pc, rc, pr, rr = pc / lc, rc / lc, pr / lr, rr / lr
    h = _log_ratio_diff(pc, pr, rc, rr)
    loss = (h - 1.0 / (2.0 * beta)).square().mean()
    return loss, implicit_rewards(pc, rc, beta), implicit_rewards(pr, rr, beta)


DPO_LOSSES: dict[str, Callable[..., tuple[Tensor, Tensor, Tensor]]] = {
    "sigmoid": dpo_sigmoid_loss,
    "cdpo": cdpo_loss,
    "ipo": ipo_loss,
}
#: Same table as ``DPO_LOSSES`` (preference-optimisation losses on policy/reference log-probs).
PREFERENCE_LOSSES = DPO_LOSSES


def get_dpo_loss(name: str) -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
    """DPO-family loss called ``name`` (``sigmoid``, ``cdpo``, ``ipo``); ValueError lists them."""
    return lookup(DPO_LOSSES, name, "DPO loss")


def chosen_nll_loss(chosen_token_logps: Tensor, chosen_mask: Tensor) -> Tensor:
    """NLL on the chosen responses: ``-mean_i (sum_t logp_it / n_i)`` over pairs with n_i > 0.

    Shapes: [B, T], [B, T] -> 0-dim (0 if no pair has response tokens). Add ``coef * nll`` to the
    DPO loss (OpenRLHF's ``nll_loss_coef``; RPO, Pang et al., 2024, arXiv:2404.19733).
    """
    m = as_bool(chosen_mask)
    per_seq = sequence_logps(chosen_token_logps, m, average=True)
    has = m.any(-1)
    total = torch.where(has, per_seq, torch.zeros((), dtype=per_seq.dtype, device=per_seq.device)).sum()
    return -total / has.sum().clamp_min(1).to(total.dtype)
