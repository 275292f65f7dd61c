"""The RL actor's objective, apart from the worker that runs the forward (issue 45; veRL's ``losses.py`` shape).

"Where is the PPO loss assembled?" - here: :func:`policy_loss_spec` reads the run's flags once into a
:class:`PolicyLossSpec` (which loss, its hyper-parameters, aggregation, pi_old's source, the entropy, KL,
forward-KL distillation and their coefficients), and :func:`policy_objective` turns one micro-batch's
log-probs and entropy into its share of the step's loss and its metric totals. The formulas are
``rlhforge.algorithms``' pure functions; :class:`rlhforge.workers.actor.ActorWorker` only runs the forward.
"""

from __future__ import annotations

import dataclasses

import torch

from rlhforge.algorithms import entropy_bonus, get_policy_loss, kl_loss
from rlhforge.algorithms.kl import kl_loss_unbiased_gradient
from rlhforge.backend.step import StepNormaliser

__all__ = ["PolicyLossSpec", "policy_loss_spec", "policy_objective"]


@dataclasses.dataclass(frozen=True)
class PolicyLossSpec:
    """Everything the actor update needs besides the data."""

    loss_type: str = "ppo"
    """A key of ``rlhforge.algorithms.POLICY_LOSSES`` (``ppo``, ``gspo``, ``cispo`` ... ``flash_reinforce``)."""
    loss_kwargs: dict = dataclasses.field(default_factory=dict)
    agg_mode: str = "token_mean"
    norm_constant: float | None = None
    temperature: float = 1.0
    entropy_coef: float = 0.0
    kl_loss_coef: float = 0.0
    """beta of the KL loss term: the KL controller's value for this step (the trainer replaces the
    spec every step; 0 disables the term)."""
    kl_estimator: str = "k3"
    kl_unbiased_gradient: bool = False
    """``--algo.kl.unbiased_gradient``: the KL term keeps its value but back-propagates
    ``w * (log pi - log pi_ref)``, ``w = pi / pi_old`` (``algorithms.kl.kl_loss_unbiased_gradient``)."""
    use_rollout_logprobs_as_old: bool = False
    distill_topk_coef: float = 0.0
    """On-policy distillation's ``forward_kl_topk`` mode: weight of the forward KL over the teacher's top-k
    (the samples carry the teacher's ids and log-probs; :mod:`rlhforge.workers.distill`); 0: off."""
    old_from_this_forward: bool = False
    """pi_old = this forward's detached log-probs (ratio 1 by construction): set by the trainer when the
    rollout feeds exactly one optimizer step with nothing else needing pi_old first, so the separate
    old-log-prob pass is skipped. Also reports the rollout-vs-trainer log-prob gap from this forward."""


def policy_loss_spec(cfg, max_new_tokens: int, kl_loss_coef: float) -> PolicyLossSpec:
    """The run's :class:`PolicyLossSpec` from its flags (``--actor.policy_loss_type`` and its aliases and
    hyper-parameters, ``--actor.loss_agg_mode``, the estimator's own loss, ``--algo.kl.*``,
    ``--algo.distill.*``); ``kl_loss_coef`` is the KL controller's current value."""
    from rlhforge.config.rl_distill import distill_topk_coef
    from rlhforge.config.rl_losses import policy_loss_setup

    a, est = cfg.actor, cfg.algo.advantage.record
    agg = a.loss_agg_mode.replace("-", "_")  # every estimator, dr_grpo included (as OpenRLHF)
    if est.policy_loss is not None:  # the estimator comes with its loss (flash_reinforce)
        loss_type, kwargs, agg = est.policy_loss, {}, est.loss_agg_mode or agg
    else:  # aliases resolved, the loss's own flags read; GSPO / GMPO are sequence-level (config/rl_losses.py)
        loss_type, kwargs, forced_agg = policy_loss_setup(a)
        agg = forced_agg or agg
    # the Dr. GRPO paper's normaliser, on request: per-sequence token sum / max response length
    norm = float(max_new_tokens) if agg == "seq_mean_token_sum_norm" else None
    return PolicyLossSpec(
        loss_type=loss_type, loss_kwargs=kwargs, agg_mode=agg, norm_constant=norm,
        temperature=cfg.rollout.temperature, entropy_coef=a.entropy_coef or 0.0,
        kl_loss_coef=kl_loss_coef, kl_estimator=cfg.algo.kl.estimator,
        kl_unbiased_gradient=cfg.algo.kl.unbiased_gradient,
        use_rollout_logprobs_as_old=est.old_logprobs == "rollout", distill_topk_coef=distill_topk_coef(cfg),
    )


def policy_objective(spec: PolicyLossSpec, norm: StepNormaliser, batch: dict, logp: torch.Tensor,
                     entropy: torch.Tensor, distill: torch.Tensor | None = None, aux: torch.Tensor | None = None,
                     aux_coef: float = 0.0, passes: int = 1) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch's share of the step's policy loss (+ entropy bonus, KL loss, forward-KL distillation
    term ``distill`` [B, T], MoE balancing loss ``aux``) and its totals: the loss terms dp-scaled, the rest
    token-share weighted (:func:`rlhforge.workers.base.reduce_step_metrics`). ``batch`` holds the
    micro-batch's rows (``loss_mask``, ``advantages``, ``is_weights``, the log-probs pi_old comes from)."""
    mask = batch["loss_mask"]
    gap_metrics = {}
    if spec.use_rollout_logprobs_as_old:
        old = batch["rollout_logprobs"]
    elif spec.old_from_this_forward:
        old = logp.detach()
        gap, tokens = (batch["rollout_logprobs"] - old) * mask, mask.sum().clamp_min(1)
        gap_metrics = {"logprob_diff_rollout_vs_train": gap.abs().sum() / tokens, "vllm_kl": gap.sum() / tokens}
    else:
        old = batch["old_logprobs"]
    tok_loss, metrics = get_policy_loss(spec.loss_type)(logp, old, batch["advantages"], mask,
                                                        is_weights=batch["is_weights"], **spec.loss_kwargs)
    policy_loss = norm.aggregate(tok_loss, mask, spec.agg_mode)
    loss, totals = policy_loss, {"policy_loss": float(policy_loss.detach())}
    if spec.entropy_coef:
        loss = loss + norm.aggregate(entropy_bonus(entropy, mask, spec.entropy_coef), mask, spec.agg_mode)
    if spec.kl_loss_coef > 0:
        if spec.kl_unbiased_gradient:
            kl_tok = kl_loss_unbiased_gradient(logp, batch["ref_logprobs"], mask, spec.kl_estimator, old)
        else:
            kl_tok = kl_loss(logp, batch["ref_logprobs"], mask, spec.kl_estimator)
        kl_term = norm.aggregate(kl_tok, mask, spec.agg_mode)
        loss = loss + spec.kl_loss_coef * kl_term
        totals["kl_loss"] = float(kl_term.detach())
    if distill is not None:  # forward KL over the teacher's top-k (algorithms.distillation.forward_kl_topk)
        fkl = norm.aggregate(distill, mask, spec.agg_mode)
        loss = loss + spec.distill_topk_coef * fkl
        metrics = {**metrics, "distill_forward_kl": (distill.detach() * mask).sum() / mask.sum().clamp_min(1)}
    if aux is not None:  # as OpenRLHF: coef x the micro-batch's balancing loss; the step's mean over micro-batches
        loss = loss + aux_coef * aux / passes
        totals["aux_loss"] = float(aux.detach()) / passes
    weight = float(mask.sum()) / max(norm.tokens, 1.0)  # token share of this micro-batch
    totals["entropy"] = float((entropy.detach() * mask).sum() / mask.sum().clamp_min(1)) * weight
    for name, value in {**gap_metrics, **metrics}.items():
        totals[name] = float(value) * weight
    return loss, totals
