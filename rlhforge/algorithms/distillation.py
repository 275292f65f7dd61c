"""On-policy distillation (OPD): a frozen teacher scores the student's own samples (docs/algorithms.md).

Two families, one per ``--algo.distill.mode``:

- ``reverse_kl`` (alias ``k1``): a per-token reward ``r_t = -(log pi_student(y_t) - log pi_teacher(y_t))`` on
  the sampled token (the one-sample k1 estimate of the reverse KL ``KL(student || teacher)``), optionally
  summed into the future with a discount, then fed to the usual policy loss as an advantage
  (:func:`on_policy_distill_advantages`; the estimator ``on_policy_distill`` of
  :data:`rlhforge.algorithms.advantages.ADVANTAGE_ESTIMATORS`).
- ``forward_kl_topk``: a loss term ``sum_{v in topk_T(t)} p_T(v) (log p_T(v) - log p_S(v))`` over the teacher's
  ``k`` most likely tokens at each generated position (:func:`forward_kl_topk`), differentiable in the
  student's log-probs; the teacher's probabilities are not renormalised over the top-k (the mass outside it
  is left out of the sum).

Either combines with an environment reward: ``env_coef x`` the group-centred scalar reward (the raw reward
when a prompt has one sample), on every action token.

Conventions as everywhere in rlhforge: ``[B, T]`` per-token tensors where position ``t`` belongs to token
``t`` (``logprob[t] = log p(token_t | tokens < t)``), ``[B, T, k]`` for the top-k tensors, ``mask`` 1 on
action tokens. Pure tensor maths: no I/O, no config.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._utils import as_bool, check_same_shape

__all__ = ["DISTILL_MODES", "reverse_kl_rewards", "discounted_future_sum", "env_advantages", "on_policy_distill_advantages",
           "shifted_topk_logprobs", "shifted_gather_logprobs", "forward_kl_topk", "distill_metrics"]

#: ``--algo.distill.mode`` values (after aliases)
DISTILL_MODES = ("reverse_kl", "forward_kl_topk")


def _wide(x: Tensor) -> Tensor:
    """``x`` in fp32 at least (bf16/fp16 logits are widened; fp64 stays fp64)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def reverse_kl_rewards(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``-(log pi_S(y_t) - log pi_T(y_t))`` on action tokens, 0 elsewhere. [B, T] -> [B, T]."""
    check_same_shape(student_logprobs=student_logprobs, teacher_logprobs=teacher_logprobs, mask=mask)
    r = -(student_logprobs.float() - teacher_logprobs.float())
    return torch.where(as_bool(mask), r, torch.zeros_like(r))


def discounted_future_sum(x: Tensor, mask: Tensor, discount: float) -> Tensor:
    """``y_t = x_t + discount * y_(next action token)`` on action tokens, 0 elsewhere (``discount=0``: ``x``
    itself; the discount steps over action tokens only, so environment feedback between turns costs none)."""
    m = as_bool(mask)
    x = torch.where(m, x, torch.zeros_like(x))
    if discount == 0.0:
        return x
    out, carry = torch.zeros_like(x), torch.zeros_like(x[:, 0])
    for t in range(x.shape[1] - 1, -1, -1):
        carry = torch.where(m[:, t], x[:, t] + discount * carry, carry)
        out[:, t] = torch.where(m[:, t], carry, out[:, t])
    return out


def env_advantages(scores: Tensor, mask: Tensor, n_samples_per_prompt: int) -> Tensor:
    """The environment's scalar rewards ``[B]`` as per-token advantages ``[B, T]``: minus the mean of the
    prompt's group when it has several samples (no division by the std), the reward itself with one."""
    s = scores.float()
    n = int(n_samples_per_prompt)
    if n > 1:
        if s.numel() % n:
            raise ValueError(f"{s.numel()} rewards do not split into groups of n_samples_per_prompt={n}")
        g = s.view(-1, n)
        s = (g - g.mean(dim=1, keepdim=True)).reshape(-1)
    m = as_bool(mask)
    return torch.where(m, s[:, None].expand_as(m).to(torch.float32), torch.zeros(m.shape))


@torch.no_grad()
def on_policy_distill_advantages(
    scores: Tensor,
    mask: Tensor,
    *,
    student_logprobs: Tensor | None = None,
    teacher_logprobs: Tensor | None = None,
    distill_coef: float = 1.0,
    env_coef: float = 0.0,
    discount: float = 0.0,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    reward_clip: tuple[float, float] | None = None,
    n_samples_per_prompt: int = 1,
    **_unused,
) -> tuple[Tensor, Tensor]:
    """``A_t = sum_{t' >= t} discount^(t'-t) (distill_coef * r_t' - kl_coef * kl_t') + env_coef * A_env``.

    ``r`` is :func:`reverse_kl_rewards` (left out when either log-prob tensor is None: the ``forward_kl_topk``
    mode, whose distillation is a loss term instead), ``kl`` the optional per-token KL to a reference model,
    ``A_env`` :func:`env_advantages` of the (clipped) scalar ``scores``. The discount steps from one action
    token to the next (``discount=0``: each token keeps its own reward, as Tinker's cookbook by default).
    No whitening. Returns ``(advantages, returns)``, the two equal (there is no critic). The signature is
    that of the other estimators (``values``, ``gamma``, ``lam``, ``whiten`` ... are accepted and unused).
    """
    m = as_bool(mask)
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount must be in [0, 1] (got {discount})")
    token = torch.zeros(m.shape, dtype=torch.float32)
    if (student_logprobs is None) != (teacher_logprobs is None):
        raise ValueError("student_logprobs and teacher_logprobs come together (or neither: forward_kl_topk)")
    if student_logprobs is not None and distill_coef:
        token = token + distill_coef * reverse_kl_rewards(student_logprobs, teacher_logprobs, mask)
    if kl is not None and kl_coef:
        check_same_shape(kl=kl, mask=mask)
        token = token - kl_coef * torch.where(m, kl.float(), torch.zeros_like(token))
    adv = discounted_future_sum(token, m, float(discount))
    if env_coef:
        s = scores.float()
        if reward_clip is not None:
            s = s.clamp(reward_clip[0], reward_clip[1])
        adv = adv + env_coef * env_advantages(s, mask, n_samples_per_prompt)
    return adv, adv.clone()


def shifted_topk_logprobs(logits: Tensor, k: int, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """The ``k`` most likely next tokens of every position, in the per-token convention: ``[B, T, V]`` logits
    -> ``(ids [B, T, k] int64, logprobs [B, T, k] fp32)`` where row ``t`` is the distribution that predicted
    token ``t`` (``log_softmax(logits[t - 1] / temperature)``), row 0 zeros. Sorted, most likely first."""
    k = min(int(k), logits.shape[-1])
    lp = torch.log_softmax(_wide(logits[:, :-1]) / temperature, dim=-1)
    top, ids = lp.topk(k, dim=-1)
    zero_ids = torch.zeros_like(ids[:, :1])
    return torch.cat([zero_ids, ids], dim=1), torch.cat([torch.zeros_like(top[:, :1]), top], dim=1)


def shifted_gather_logprobs(logits: Tensor, ids: Tensor, temperature: float = 1.0) -> Tensor:
    """The log-probs of given candidate tokens, per-token convention: ``[B, T, V]`` logits and ``[B, T, k]``
    ids (row ``t``: candidates for token ``t``) -> ``[B, T, k]`` fp32, ``log_softmax(logits[t-1] / T)[ids[t]]``,
    row 0 zeros. Differentiable in ``logits``."""
    lp = torch.log_softmax(_wide(logits[:, :-1]) / temperature, dim=-1)
    got = lp.gather(-1, ids[:, 1:].long())
    return torch.cat([torch.zeros_like(got[:, :1]), got], dim=1)


def forward_kl_topk(student_topk_logprobs: Tensor, teacher_topk_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token forward KL over the teacher's top-k: ``sum_k p_T,k (log p_T,k - log p_S,k)`` on action
    tokens, 0 elsewhere. ``[B, T, k]`` x2 and ``[B, T]`` -> ``[B, T]``; the gradient flows through the
    student's log-probs only (the teacher's are detached)."""
    if student_topk_logprobs.shape != teacher_topk_logprobs.shape:
        raise ValueError(f"student top-k {tuple(student_topk_logprobs.shape)} != teacher top-k "
                         f"{tuple(teacher_topk_logprobs.shape)}")
    t = _wide(teacher_topk_logprobs.detach())
    per = (t.exp() * (t - _wide(student_topk_logprobs))).sum(-1)
    return torch.where(as_bool(mask), per, torch.zeros_like(per))


def distill_metrics(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> dict[str, float]:
    """``reverse_kl``: the mean per-token ``log pi_S - log pi_T`` over action tokens (the k1 reverse KL) and
    the mean teacher log-prob of the sampled tokens."""
    m = as_bool(mask)
    if not m.any():
        return {"reverse_kl": 0.0, "teacher_logprob": 0.0}
    return {"reverse_kl": float((student_logprobs - teacher_logprobs)[m].mean()),
            "teacher_logprob": float(teacher_logprobs[m].mean())}
