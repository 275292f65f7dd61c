"""On-policy distillation in the experience step (``--algo.advantage.estimator on_policy_distill``; docs/algorithms.md).

The teacher group (:class:`rlhforge.workers.teacher.TeacherWorker`) scores the rollout after the student's
own log-probs were taken:

- ``reverse_kl``: the teacher's log-probs of the sampled tokens; with the student's (pi_old, the trainer's
  pass over the rollout) they become the advantage's per-token reward ``-(log pi_S - log pi_T)``
  (:func:`rlhforge.algorithms.distillation.on_policy_distill_advantages`);
- ``forward_kl_topk``: the teacher's top-k ids and log-probs per action token, stored on each sample for the
  actor's loss term (:mod:`rlhforge.workers.distill`); the advantage then holds the environment's reward only.
"""

from __future__ import annotations

import time

import torch

from rlhforge.algorithms.distillation import distill_metrics
from rlhforge.config.rl_distill import distill_mode
from rlhforge.workers.distill import TOPK_IDS, TOPK_LOGPROBS
from rlhforge.workers.experience import pad_rows

__all__ = ["needs_student_logprobs", "teacher_experience"]


def needs_student_logprobs(cfg) -> bool:
    """The reverse-KL reward reads the student's log-probs before the update (the old-log-prob pass runs)."""
    return cfg.uses_teacher and distill_mode(cfg) == "reverse_kl" and cfg.algo.distill.coef > 0


def teacher_experience(cfg, teacher, samples, old_lp: torch.Tensor, mask: torch.Tensor
                       ) -> tuple[dict, dict[str, float]]:
    """Score ``samples`` with the teacher group; returns the keyword arguments the ``on_policy_distill``
    estimator takes beyond the common ones, and the ``distill/*`` metrics."""
    t0, d = time.perf_counter(), cfg.algo.distill
    mb, temp = cfg.rollout.micro_batch_size, cfg.rollout.temperature
    kwargs = {"distill_coef": d.coef, "env_coef": d.env_reward_coef, "discount": d.discount}
    if distill_mode(cfg) == "reverse_kl":
        teacher_lp = pad_rows(teacher.map_gather("logprobs", samples, mb, temp), old_lp.shape[1])
        kwargs.update(student_logprobs=old_lp, teacher_logprobs=teacher_lp)
        metrics = {f"distill/{k}": v for k, v in distill_metrics(old_lp, teacher_lp, mask).items()}
        return kwargs, {**metrics, "timing/teacher": time.perf_counter() - t0}
    mass, tokens = 0.0, 0.0
    for s, (ids, lps) in zip(samples, teacher.map_gather("topk_logprobs", samples, mb, temp, d.topk)):
        s.tensors[TOPK_IDS], s.tensors[TOPK_LOGPROBS] = ids, lps
        keep = torch.tensor(s.loss_mask, dtype=torch.bool)
        mass += float(lps[keep].exp().sum())
        tokens += float(keep.sum())
    kwargs["distill_coef"] = 0.0  # the distillation is the actor's loss term here
    return kwargs, {"distill/teacher_topk_mass": mass / max(tokens, 1.0), "timing/teacher": time.perf_counter() - t0}
