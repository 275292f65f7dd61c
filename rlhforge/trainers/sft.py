"""Supervised fine-tuning: one loop, top to bottom.

Loss: mean negative log-likelihood over every target token of the optimizer step, on all ranks
together: each micro-batch contributes ``sum(nll) * world_size / global_tokens`` (strategies sum
over micro-batches and average over ranks), so the result does not depend on the number of ranks,
micro-batches or padding.

Ring attention (``--ds.ring_attn_size R``, ``ring``): the ``R`` ranks of one ring share a data shard
(data-parallel size ``world / R``), each runs its slice of the packed row, and the log-probs are
gathered back (:func:`rlhforge.backend.context_parallel.ring_token_logprobs`); token counts summed
over all ranks are divided by ``R`` (each ring counts its tokens ``R`` times), so the loss above is
unchanged and the ring's partial gradients, averaged over the world, give the same step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from rlhforge.backend.step import StepNormaliser, run_step, step_normaliser
from rlhforge.config.batching import BatchPlan
from rlhforge.data.packing import collate_packed, collate_padded
from rlhforge.data.images import collate_vlm
from rlhforge.data.vlm_sft import VLMSFTSample
from rlhforge.models.export import save_hf
from rlhforge.models.forward import token_logprobs
from rlhforge.trainers.common import (add_aux_loss, aux_loss, eval_totals, moe_aux_loss_coef, resume_trainer,
                                      save_trainer_checkpoint, step_micro_batches, supervised_loop)
from rlhforge.trainers.faults import guard_for
from rlhforge.tracking.metrics import MetricsLogger


@dataclass
class SFTState:
    global_step: int = 0

    def as_dict(self) -> dict:
        return {"global_step": self.global_step}


class SFTTrainer:
    def __init__(self, cfg, strategy, model, tokenizer, train_samples, eval_samples, plan: BatchPlan, logger: MetricsLogger,
                 ring=None):
        self.cfg, self.strategy, self.tokenizer = cfg, strategy, tokenizer
        self.ring = ring  # a context_parallel.RingGroup with --ds.ring_attn_size > 1, else None
        self.ring_size = ring.ring_size if ring is not None else 1
        self.data_shard = (ring.dp_rank, ring.dp_size) if ring is not None else (strategy.rank, strategy.world_size)
        # AutoTP (--ds.tensor_parallel_size, backend/autotp.py): the ranks of one tensor-parallel group
        # share a shard too, and DeepSpeed averages gradients over the world / tp data-parallel ranks
        self.tp_size = getattr(strategy, "tp_size", 1)
        if self.tp_size > 1:
            self.data_shard = (strategy.dp_rank, strategy.dp_size)
        self.copies = self.ring_size * self.tp_size  # ranks that hold the same samples
        self.model = model  # the wrapped module returned by strategy.prepare
        self.train_samples, self.eval_samples = train_samples, eval_samples
        self.plan, self.logger = plan, logger
        self.state = SFTState()
        self.guard = guard_for(cfg, strategy)  # preemption, non-finite steps, checkpoint write errors
        self.step_skipped = False  # the last optimizer step was skipped (non-finite loss or gradient norm)
        self.aux_loss_coef = moe_aux_loss_coef(cfg, strategy)  # 0 on a dense model (one notice)

    # -- one micro-batch -------------------------------------------------------------------------
    def _collate(self, samples):
        if isinstance(samples[0], VLMSFTSample):  # images: padded, M-RoPE positions from the model (docs/vlm.md)
            batch = collate_vlm(samples, self.tokenizer.pad_token_id, self.tokenizer.image_token_id)
        elif self.cfg.ds.packing_samples:
            batch = collate_packed(samples)
        else:
            batch = collate_padded(samples, self.tokenizer.pad_token_id)
        return {k: v.to(self.strategy.device) if torch.is_tensor(v) else v for k, v in batch.items()}

    def _token_nll(self, samples, with_aux: bool = False) -> tuple[torch.Tensor, ...]:
        """Per-token NLL ``[B, T]`` of ``samples`` and the target mask ``[B, T]`` (with ``with_aux``, and
        the MoE load-balancing loss of the micro-batch); called under the strategy's autocast."""
        batch = self._collate(samples)
        if self.ring is not None:
            from rlhforge.backend.context_parallel import ring_token_logprobs

            out = ring_token_logprobs(self.model, batch, self.ring)  # no aux loss with a ring (refused)
        else:
            # the lm_head runs on the trained (loss-mask) tokens only: a prompt's logits are never read
            out = token_logprobs(self.model, batch, return_aux_loss=with_aux, needed=batch["loss_mask"])
        logps, aux = out if with_aux else (out, None)
        return (-logps.float(), batch["loss_mask"].float()) + ((aux,) if with_aux else ())

    def _loss(self, samples, norm: StepNormaliser, passes: int):
        """This micro-batch's share of the step's token-mean NLL (+ MoE balancing loss), and its totals."""
        nll, mask, *aux = self._token_nll(samples, with_aux=bool(self.aux_loss_coef))
        loss = norm.aggregate(nll, mask)
        totals = {"nll": (nll * mask).sum()}
        return add_aux_loss(loss, totals, self.aux_loss_coef, aux[0] if aux else None, passes), totals

    # -- the loop --------------------------------------------------------------------------------
    def fit(self) -> None:
        self._maybe_resume()
        supervised_loop(self, desc="sft", shard=self.data_shard, per_s=("tokens",), eval_at_last_step=False,
                        bar_fields=lambda m: {"loss": m["train/loss"], "tok_s": round(m["perf/tokens_per_s"])},
                        finish=self._finish)

    def _finish(self) -> None:
        """After the last step: the final checkpoint and the export."""
        cfg, strategy = self.cfg, self.strategy
        if cfg.ckpt.save_steps > 0:
            self.save_checkpoint()
        save_hf(strategy, self.tokenizer, cfg.ckpt.output_dir)

    def train_step(self, indices: list[int]) -> dict[str, float]:
        strategy, samples = self.strategy, self.train_samples
        norm = step_normaliser(strategy, tokens=sum(sum(samples[i].loss_mask) for i in indices),
                               ring_size=self.ring_size)
        if norm.tokens == 0:
            raise RuntimeError(f"optimizer step {self.state.global_step + 1} has no target tokens on any rank")
        groups = [None if g is None else [samples[i] for i in g]
                  for g in step_micro_batches(self, indices, lambda i: len(samples[i].input_ids))]
        out = run_step(strategy, groups, lambda mb, n: self._loss(mb, n, len(groups)), norm,
                       dummy=[samples[indices[0]]])
        self.step_skipped = out.skipped
        t = out.totals
        metrics = {"train/loss": t["nll"] / norm.tokens, "train/lr": out.stats["lr"],
                   "train/grad_norm": out.stats["grad_norm"], "train/tokens": norm.tokens}
        if self.aux_loss_coef:
            metrics["train/aux_loss"] = aux_loss(t, norm)
        return metrics

    def evaluate(self) -> dict[str, float]:
        if not self.eval_samples:
            return {}
        samples = self.eval_samples

        def nll(group):  # eval/loss: NLL only
            token_nll, mask = self._token_nll([samples[i] for i in group])
            return {"nll": (token_nll * mask).sum(), "tokens": mask.sum()}

        totals = eval_totals(self, len(samples), self.data_shard, nll)
        count = totals.get("tokens", 0.0)
        return {"eval/loss": totals.get("nll", 0.0) / max(count, 1.0), "eval/tokens": count}

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self) -> Path | None:
        return save_trainer_checkpoint(self, export=lambda d: save_hf(self.strategy, self.tokenizer, d))

    def _maybe_resume(self) -> None:
        state = resume_trainer(self)
        if state is not None:
            self.state = SFTState(global_step=int(state["global_step"]))
