"""Advantages and returns: GAE, discounted returns, group baselines, whitening, token rewards.

Conventions: ``mask`` [B, T] marks action (response) tokens. Positions outside the mask carry
nothing: their rewards and values are ignored, their outputs are 0, and the recursions *skip*
them (the next step after an action token is the next action token; env-feedback tokens in the
middle of a multi-turn response do not break the bootstrap chain). For right-padded masks this
equals the usual recursion. All outputs are detached.

Pipeline used by every estimator in ``ADVANTAGE_ESTIMATORS`` (see ``docs/algorithms.md``):

1. group shaping of the scalar reward per sample [B] (critic-free estimators only);
2. per-token rewards: the (clipped) scalar on the last action token, minus ``kl_coef * kl_t``
   (``assemble_token_rewards``);
3. per-token advantages: GAE for ``gae``, return-to-go for every other estimator;
4. optional global whitening over all action tokens (``whiten``).

| name                | 1. shaping of R_ij (prompt i, sample j)     | 3. advantage       | 4. whiten |
| ------------------- | ------------------------------------------- | ------------------ | --------- |
| gae                 | none                                        | GAE(gamma, lam)    | yes       |
| reinforce           | none                                        | G_t (gamma)        | yes       |
| reinforce_baseline  | R_ij - mean_j R_ij                          | G_t                | yes       |
| rloo                | R_ij - mean_{k != j} R_ik                   | G_t                | no        |
| group_norm          | (R_ij - mean_j R_ij) / (std_j R_ij + eps)   | G_t                | no        |
| dr_grpo             | R_ij - mean_j R_ij                          | G_t                | no        |
| flash_reinforce     | R_b - mean over the whole batch             | G_t                | no        |

Groups are ``n_samples_per_prompt`` *consecutive* samples. Group estimators raise ValueError
for ``n_samples_per_prompt == 1``: the group std is undefined (group_norm), there is no
"other" sample (rloo), and the mean baseline would make every advantage exactly 0.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ._utils import as_bool, check_same_shape, lookup, masked_mean, masked_var
from .distillation import on_policy_distill_advantages  # the teacher-scored estimator (algorithms/distillation.py)

__all__ = [
    "gae",
    "discounted_returns",
    "reinforce_baseline",
    "rloo",
    "group_norm",
    "dr_grpo",
    "batch_mean_baseline",
    "whiten",
    "assemble_token_rewards",
    "last_action_index",
    "ADVANTAGE_ESTIMATORS",
    "WHITEN_BY_DEFAULT",
    "get_advantage_estimator",
    "compute_advantages",
]


# ---------------------------------------------------------------- per-token recursions


def _zero(x: Tensor) -> Tensor:
    return torch.zeros((), dtype=x.dtype, device=x.device)


@torch.no_grad()
def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al., 2016, arXiv:1506.02438).

    ``delta_t = r_t + gamma * V_{t'} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t'}``, where
    ``t'`` is the next action token after ``t`` (``V = A = 0`` after the last one).

    Args:
        rewards: [B, T] per-token rewards. values: [B, T] critic values. mask: [B, T].

    Returns:
        (advantages [B, T], returns [B, T] = advantages + values), 0 at masked positions.
        Vectorised over the batch, a reverse scan over time.
    """
    check_same_shape(rewards=rewards, values=values, mask=mask)
    m = as_bool(mask)
    r = torch.where(m, rewards, _zero(rewards))
    v = torch.where(m, values.to(r.dtype), _zero(r))
    next_value = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    running = torch.zeros_like(next_value)
    out = []
    for t in reversed(range(r.shape[1])):
        a_t = r[:, t] + gamma * next_value - v[:, t] + gamma * lam * running
        keep = m[:, t]
        running = torch.where(keep, a_t, running)
        next_value = torch.where(keep, v[:, t], next_value)
        out.append(torch.where(keep, a_t, _zero(a_t)))
    adv = torch.stack(out[::-1], dim=1) if out else torch.zeros_like(r)
    returns = torch.where(m, adv + v, _zero(r))
    return adv, returns


@torch.no_grad()
def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Return-to-go ``G_t = r_t + gamma * G_{t'}`` over action tokens (t' = next action token).

    Shapes: rewards [B, T], mask [B, T] -> [B, T], 0 at masked positions. ``gamma == 1`` uses a
    reversed cumulative sum; otherwise a reverse scan.
    """
    check_same_shape(rewards=rewards, mask=mask)
    m = as_bool(mask)
    r = torch.where(m, rewards, _zero(rewards))
    if gamma == 1.0:
        g = r.flip(1).cumsum(1).flip(1)
        return torch.where(m, g, _zero(g))
    running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    out = []
    for t in reversed(range(r.shape[1])):
        g_t = r[:, t] + gamma * running
        running = torch.where(m[:, t], g_t, running)
        out.append(torch.where(m[:, t], g_t, _zero(g_t)))
    return torch.stack(out[::-1], dim=1) if out else torch.zeros_like(r)


# ---------------------------------------------------------------- group shaping of scalars


def _groups(rewards: Tensor, n: int, name: str) -> Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"{name}: rewards must be 1-D [num_prompts * n] (got {tuple(rewards.shape)})")
    if n < 2:
        raise ValueError(
            f"{name} needs n_samples_per_prompt > 1 (got {n}): with one sample per group the "
            "baseline equals the reward (and the std / leave-one-out mean is undefined)"
        )
    if rewards.numel() % n != 0:
        raise ValueError(f"{name}: {rewards.numel()} rewards do not split into groups of {n}")
    return rewards.reshape(-1, n)


@torch.no_grad()
def reinforce_baseline(rewards: Tensor, n: int) -> Tensor:
    """REINFORCE++-baseline (Hu et al., 2025, arXiv:2501.03262): ``R_ij - mean_j R_ij``. [P*n] -> [P*n]."""
    g = _groups(rewards, n, "reinforce_baseline")
    return (g - g.mean(1, keepdim=True)).reshape(-1)


@torch.no_grad()
def rloo(rewards: Tensor, n: int) -> Tensor:
    """RLOO (Ahmadian et al., 2024, arXiv:2402.14740): ``R_ij - (sum_k R_ik - R_ij) / (n - 1)``. [P*n] -> [P*n]."""
    g = _groups(rewards, n, "rloo")
    return (g - (g.sum(1, keepdim=True) - g) / (n - 1)).reshape(-1)


@torch.no_grad()
def group_norm(rewards: Tensor, n: int, eps: float = 1e-6) -> Tensor:
    """GRPO (Shao et al., 2024, arXiv:2402.03300): ``(R_ij - mean_j) / (std_j + eps)``. [P*n] -> [P*n].

    ``std_j`` is the unbiased (n - 1) sample std, torch's default and OpenRLHF's choice. A group
    with identical rewards gets advantages 0. ``eps`` is 1e-6 (OpenRLHF uses 1e-9).
    """
    g = _groups(rewards, n, "group_norm")
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + eps)).reshape(-1)


@torch.no_grad()
def dr_grpo(rewards: Tensor, n: int) -> Tensor:
    """Dr. GRPO (Liu et al., 2025, arXiv:2503.20783): ``R_ij - mean_j R_ij`` (no std). [P*n] -> [P*n]."""
    g = _groups(rewards, n, "dr_grpo")
    return (g - g.mean(1, keepdim=True)).reshape(-1)


@torch.no_grad()
def batch_mean_baseline(rewards: Tensor) -> Tensor:
    """FlashREINFORCE's baseline: ``R_b - mean_b R_b`` over the whole batch (no groups). [B] -> [B]."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B] (got {tuple(rewards.shape)})")
    if rewards.numel() == 0:
        return rewards.clone()
    return rewards - rewards.mean()


# ---------------------------------------------------------------- whitening and token rewards


@torch.no_grad()
def whiten(x: Tensor, mask: Tensor, use_std: bool = True, eps: float = 1e-8) -> Tensor:
    """Global whitening over all action tokens: ``(x - mean) * rsqrt(max(var, eps))``.

    ``mean`` and ``var`` (population variance) are masked statistics over every action token of
    the batch passed in. ``use_std=False`` only centres. [B, T] -> [B, T], 0 at masked positions.
    """
    check_same_shape(x=x, mask=mask)
    m = as_bool(mask)
    out = x - masked_mean(x, m)
    if use_std:
        out = out * torch.rsqrt(masked_var(x, m).clamp_min(eps))
    return torch.where(m, out, _zero(out))


def last_action_index(mask: Tensor) -> Tensor:
    """Index of the last action token per row, -1 for rows with none. [B, T] -> [B] int64."""
    m = as_bool(mask)
    pos = torch.arange(m.shape[1], device=m.device).expand_as(m)
    if m.shape[1] == 0:
        return torch.full((m.shape[0],), -1, dtype=torch.long, device=m.device)
    return torch.where(m, pos, torch.full_like(pos, -1)).max(dim=1).values


@torch.no_grad()
def assemble_token_rewards(
    scores: Tensor,
    mask: Tensor,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    reward_clip: tuple[float, float] | None = None,
) -> Tensor:
    """Per-token rewards ``r_t = 1[t = last action token] * clip(R) - kl_coef * kl_t``.

    Args:
        scores: [B] scalar reward per sample. mask: [B, T].
        kl: [B, T] per-token KL estimate (``kl.compute_kl``) or None.
        kl_coef: beta; values <= 0 disable the penalty.
        reward_clip: ``(lo, hi)`` clamp of the scalar reward, or None.

    Returns:
        [B, T], 0 at masked positions. A row without action tokens gets all zeros (its scalar
        reward has nowhere to go).
    """
    if scores.dim() != 1 or scores.shape[0] != mask.shape[0]:
        raise ValueError(f"scores must be [B] = [{mask.shape[0]}] (got {tuple(scores.shape)})")
    m = as_bool(mask)
    if reward_clip is not None:
        scores = scores.clamp(reward_clip[0], reward_clip[1])
    dtype = scores.dtype if scores.is_floating_point() else torch.float32
    last = last_action_index(m)
    pos = torch.arange(m.shape[1], device=m.device)
    at_last = pos[None, :] == last[:, None]
    out = torch.where(at_last & m, scores.to(dtype)[:, None], torch.zeros((), dtype=dtype, device=m.device))
    if kl is not None and kl_coef > 0:
        check_same_shape(kl=kl, mask=mask)
        out = out - kl_coef * torch.where(m, kl.to(dtype), torch.zeros((), dtype=dtype, device=m.device))
    return torch.where(m, out, torch.zeros((), dtype=dtype, device=m.device))


# ---------------------------------------------------------------- estimator table

#: Whether each estimator whitens its advantages when ``whiten=None`` (OpenRLHF's defaults).
WHITEN_BY_DEFAULT: dict[str, bool] = {
    "gae": True,
    "reinforce": True,
    "reinforce_baseline": True,
    "rloo": False,
    "group_norm": False,
    "dr_grpo": False,
    "flash_reinforce": False,
    "on_policy_distill": False,
}


def _finish(name, adv, ret, mask, whiten_flag, whiten_std):
    do = WHITEN_BY_DEFAULT[name] if whiten_flag is None else whiten_flag
    if do:
        adv = whiten(adv, mask, use_std=whiten_std)
    return adv, ret


def _make_critic_free(name: str, shaping: Callable[[Tensor, int], Tensor] | None):
    @torch.no_grad()
    def estimator(
        scores: Tensor,
        mask: Tensor,
        *,
        values: Tensor | None = None,
        kl: Tensor | None = None,
        kl_coef: float = 0.0,
        reward_clip: tuple[float, float] | None = None,
        n_samples_per_prompt: int = 1,
        gamma: float = 1.0,
        lam: float = 1.0,
        whiten: bool | None = None,
        whiten_std: bool = True,
    ) -> tuple[Tensor, Tensor]:
        if values is not None:
            raise ValueError(f"{name} is critic-free: values are only used by 'gae'")
        if shaping is not None:
            scores = shaping(scores, n_samples_per_prompt)
        rewards = assemble_token_rewards(scores, mask, kl, kl_coef, reward_clip)
        ret = discounted_returns(rewards, mask, gamma)
        return _finish(name, ret.clone(), ret, mask, whiten, whiten_std)

    estimator.__name__ = f"{name}_advantages"
    estimator.__doc__ = (
        f"``{name}`` advantages; see the module table. Returns (advantages [B, T], returns [B, T])."
    )
    return estimator


@torch.no_grad()
def gae_advantages(
    scores: Tensor,
    mask: Tensor,
    *,
    values: Tensor | None = None,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    reward_clip: tuple[float, float] | None = None,
    n_samples_per_prompt: int = 1,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool | None = None,
    whiten_std: bool = True,
) -> tuple[Tensor, Tensor]:
    """``gae`` advantages: token rewards, then GAE with the critic's ``values`` [B, T] (required).

    ``n_samples_per_prompt`` is ignored. Returns (advantages, returns), both [B, T]; returns are
    taken before whitening.
    """
    if values is None:
        raise ValueError("gae needs the critic's values [B, T] (values=None)")
    rewards = assemble_token_rewards(scores, mask, kl, kl_coef, reward_clip)
    adv, ret = gae(rewards, values, mask, gamma, lam)
    return _finish("gae", adv, ret, mask, whiten, whiten_std)


def _flash_shaping(scores: Tensor, n: int) -> Tensor:
    return batch_mean_baseline(scores)


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., tuple[Tensor, Tensor]]] = {
    "gae": gae_advantages,
    "reinforce": _make_critic_free("reinforce", None),
    "reinforce_baseline": _make_critic_free("reinforce_baseline", reinforce_baseline),
    "rloo": _make_critic_free("rloo", rloo),
    "group_norm": _make_critic_free("group_norm", group_norm),
    "dr_grpo": _make_critic_free("dr_grpo", dr_grpo),
    "flash_reinforce": _make_critic_free("flash_reinforce", _flash_shaping),
    "on_policy_distill": on_policy_distill_advantages,  # takes student_logprobs / teacher_logprobs too
}


def get_advantage_estimator(name: str) -> Callable[..., tuple[Tensor, Tensor]]:
    """The estimator called ``name``; ValueError lists the valid names.

    Every estimator has the signature ``(scores [B], mask [B, T], *, values=None, kl=None,
    kl_coef=0.0, reward_clip=None, n_samples_per_prompt=1, gamma=1.0, lam=1.0, whiten=None,
    whiten_std=True) -> (advantages [B, T], returns [B, T])``; ``whiten=None`` means the
    estimator's default (``WHITEN_BY_DEFAULT``).
    """
    return lookup(ADVANTAGE_ESTIMATORS, name, "advantage estimator")


def compute_advantages(name: str, scores: Tensor, mask: Tensor, **kwargs) -> tuple[Tensor, Tensor]:
    """``get_advantage_estimator(name)(scores, mask, **kwargs)``."""
    return get_advantage_estimator(name)(scores, mask, **kwargs)
