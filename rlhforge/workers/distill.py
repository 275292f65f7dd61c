"""On-policy distillation's ``forward_kl_topk`` mode on the actor's side (docs/algorithms.md): the teacher's
top-k rows a sample carries (:data:`TOPK_IDS`, :data:`TOPK_LOGPROBS`, ``[len, k]`` each, written by
:meth:`rlhforge.workers.teacher.TeacherWorker.topk_logprobs`) laid out like a micro-batch, and
:func:`distill_topk_term`: the student's log-probs at those ids and the per-token forward KL
(:func:`rlhforge.algorithms.distillation.forward_kl_topk`), inside the actor's loss.
"""

from __future__ import annotations

from typing import Sequence

import torch

from rlhforge.algorithms.distillation import forward_kl_topk, shifted_gather_logprobs
from rlhforge.models.forward import is_packed
from rlhforge.workers.experience import ExperienceSample

__all__ = ["TOPK_IDS", "TOPK_LOGPROBS", "distill_topk_term", "topk_batch"]

#: the sample tensors (``ExperienceSample.tensors``) of the forward_kl_topk mode, ``[len, k]`` each
TOPK_IDS, TOPK_LOGPROBS = "teacher_topk_ids", "teacher_topk_logprobs"


def topk_batch(chunk: Sequence[ExperienceSample], batch: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples' teacher top-k in the micro-batch's layout: ``[B, T, k]`` (padded) or ``[1, N, k]`` (packed)
    ids (int64) and log-probs, zeros on padding."""
    ids = [s.tensors[TOPK_IDS] for s in chunk]
    lps = [s.tensors[TOPK_LOGPROBS] for s in chunk]
    if is_packed(batch):
        return torch.cat(ids)[None].long().to(device), torch.cat(lps)[None].to(device)
    width, k = batch["input_ids"].shape[1], ids[0].shape[1]
    out_ids = torch.zeros((len(chunk), width, k), dtype=torch.long)
    out_lps = torch.zeros((len(chunk), width, k), dtype=torch.float32)
    for i, (a, b) in enumerate(zip(ids, lps)):
        out_ids[i, : len(a)], out_lps[i, : len(b)] = a, b
    return out_ids.to(device), out_lps.to(device)


def distill_topk_term(logits: torch.Tensor, batch: dict, chunk: Sequence[ExperienceSample],
                      temperature: float) -> torch.Tensor:
    """The per-token forward KL over the teacher's top-k, ``[B, T]`` (packed ``[1, N]``), in the layout of the
    micro-batch's ``logits`` (the student's, differentiable); 0 off the action tokens."""
    ids, teacher = topk_batch(chunk, batch, logits.device)
    student = shifted_gather_logprobs(logits, ids, temperature)
    return forward_kl_topk(student, teacher, batch["loss_mask"])
