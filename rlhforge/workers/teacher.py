"""On-policy distillation's teacher (docs/algorithms.md, "On-policy distillation"): the frozen teacher, a
:class:`~rlhforge.workers.actor.RefWorker` over ``--teacher.model_name_or_path``, so it is built, sharded,
offloaded and placed as the reference is. Its ``logprobs`` score the sampled tokens (``reverse_kl`` mode),
:meth:`TeacherWorker.topk_logprobs` its ``k`` most likely tokens at every generated position
(``forward_kl_topk`` mode): ``[len, k]`` per sample, ids int32 and log-probs fp32, 0 off the action tokens.
"""

from __future__ import annotations

from typing import Sequence

import torch

from rlhforge.algorithms.distillation import shifted_topk_logprobs
from rlhforge.models.forward import token_logprobs
from rlhforge.workers.actor import RefWorker
from rlhforge.workers.base import per_sample
from rlhforge.workers.experience import ExperienceSample

__all__ = ["TeacherWorker"]


class TeacherWorker(RefWorker):
    """The teacher: the reference worker's machinery over ``--teacher.model_name_or_path``."""

    def __init__(self, cfg, tokenizer, device=None):
        super().__init__(cfg, tokenizer, device, model_path=cfg.teacher.model_name_or_path,
                         offload=cfg.teacher.offload)

    @torch.no_grad()
    def topk_logprobs(self, samples: Sequence[ExperienceSample], micro_batch_size: int, temperature: float,
                      k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per sample ``(ids [len, k] int32, logprobs [len, k] fp32)``: row ``t`` holds the teacher's ``k`` most
        likely candidates for token ``t`` (at ``temperature``), zeros where ``t`` is not an action token."""

        def score(model, batch, chunk):
            _, logits = token_logprobs(model, batch, temperature, return_logits=True)
            ids, lps = shifted_topk_logprobs(logits, k, temperature)
            keep = batch["loss_mask"].bool()[..., None]
            return list(zip(per_sample(ids * keep, batch, chunk, torch.int32), per_sample(lps * keep, batch, chunk)))

        return self.score_samples(samples, micro_batch_size, score)
