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

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhforge.algorithms.aggregation import aggregate_token_mean
from rlhforge.backend.device import peak_memory_bytes
from rlhforge.config.batching import BatchPlan
from rlhforge.data.packing import collate_packed, collate_padded
from rlhforge.data.images import collate_vlm
from rlhforge.data.vlm_sft import VLMSFTSample
from rlhforge.models.export import save_hf
from rlhforge.models.forward import token_logprobs
from rlhforge.config.parsing import to_dict
from rlhforge.trainers.common import (
    batch_record,
    indices_for_step,
    is_eval_step,
    micro_batches,
    pad_micro_batch_count,
    resume_trainer_state,
    save_step_checkpoint,
    step_timing,
)
from rlhforge.trainers.faults import guard_for
from rlhforge.tracking.metrics import MetricsLogger
from rlhforge.tracking.progress import Progress, progress_enabled


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
        from rlhforge.models.moe import aux_loss_enabled

        coef = cfg.model.aux_loss_coef  # MoE load-balancing loss (0 on a dense model: one notice)
        self.aux_loss_coef = coef if aux_loss_enabled(coef, strategy.module, "--model.aux_loss_coef") else 0.0

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
        the MoE load-balancing loss of the micro-batch)."""
        batch = self._collate(samples)
        with self.strategy.autocast():
            if self.ring is not None:
                from rlhforge.backend.context_parallel import ring_token_logprobs

                out = ring_token_logprobs(self.model, batch, self.ring)  # no aux loss with a ring (refused)
            else:
                out = token_logprobs(self.model, batch, return_aux_loss=with_aux)
        logps, aux = out if with_aux else (out, None)
        return (-logps.float(), batch["loss_mask"].float()) + ((aux,) if with_aux else ())

    # -- the loop --------------------------------------------------------------------------------
    def fit(self) -> None:
        cfg, strategy, plan = self.cfg, self.strategy, self.plan
        self._maybe_resume()
        bar = Progress(plan.total_steps, self.state.global_step,
                       enabled=progress_enabled(cfg.logger.progress_bar, strategy.is_rank0), desc="sft")
        strategy.train()
        with self.guard:
            self._loop(bar)

    def _loop(self, bar) -> None:
        cfg, strategy, plan = self.cfg, self.strategy, self.plan
        while self.state.global_step < plan.total_steps:
            epoch, step_in_epoch, indices = indices_for_step(self.state.global_step, plan, len(self.train_samples),
                                                             cfg.train.seed, strategy, shard=self.data_shard)
            start = time.perf_counter()
            metrics = self.train_step(indices)
            self.state.global_step += 1
            step = self.state.global_step
            self.guard.record(step, self.step_skipped, grad_norm=metrics["train/grad_norm"],
                              batch=lambda: batch_record(step - 1, plan, len(self.train_samples), cfg.train.seed))
            metrics.update(self.guard.metrics())
            metrics.update(step_timing(metrics, epoch, step_in_epoch, plan.steps_per_epoch, time.perf_counter() - start,
                                       per_s=('tokens',)))
            if is_eval_step(step, plan.steps_per_epoch, cfg.eval.steps):
                metrics.update(self.evaluate())
            if step % cfg.logger.logging_steps == 0 or step == plan.total_steps:
                metrics["perf/peak_memory_gb"] = peak_memory_bytes(strategy.device) / 2**30
                self.logger.log(step, metrics)
            bar.update(1, loss=metrics["train/loss"], lr=metrics["train/lr"],
                       tok_s=round(metrics["perf/tokens_per_s"]))
            if cfg.ckpt.save_steps > 0 and step % cfg.ckpt.save_steps == 0 and step < plan.total_steps:
                self.save_checkpoint()
            self.guard.after_step(step, self.save_checkpoint)
        self.guard.finished()
        bar.close()
        if cfg.ckpt.save_steps > 0:
            self.save_checkpoint()
        save_hf(strategy, self.tokenizer, cfg.ckpt.output_dir)

    def train_step(self, indices: list[int]) -> dict[str, float]:
        strategy, cfg = self.strategy, self.cfg
        samples = self.train_samples
        local_tokens = sum(sum(samples[i].loss_mask) for i in indices)
        global_tokens = strategy.all_reduce(torch.tensor(float(local_tokens)), op="sum").item() / self.copies
        if global_tokens == 0:
            raise RuntimeError(f"optimizer step {self.state.global_step + 1} has no target tokens on any rank")
        groups = micro_batches(indices, lambda i: len(samples[i].input_ids),
                               micro_batch_size=cfg.train.micro_batch_size,
                               max_tokens=cfg.train.max_tokens_per_device * self.ring_size)  # a ring: R devices
        groups = pad_micro_batch_count(strategy, groups)
        nll_total, aux_total = torch.zeros(()), torch.zeros(2)
        for k, group in enumerate(groups):
            is_dummy = group is None  # a zero-weighted pass keeping ranks aligned
            nll, mask, *aux = self._token_nll([samples[indices[0]]] if is_dummy else [samples[i] for i in group],
                                              with_aux=bool(self.aux_loss_coef))
            loss = aggregate_token_mean(nll, mask, global_tokens=global_tokens,
                                        dp_size=strategy.world_size // self.tp_size)
            if aux:  # as OpenRLHF: + coef x the micro-batch's balancing loss (the step's mean over micro-batches)
                loss = loss + self.aux_loss_coef * aux[0] / len(groups)
                if not is_dummy:
                    aux_total += torch.stack([aux[0].detach().float().cpu(), torch.ones(())])
            strategy.backward(loss * 0.0 if is_dummy else loss, is_last_micro_batch=k == len(groups) - 1)
            if not is_dummy:
                nll_total += (nll * mask).sum().detach().cpu()
        stats = strategy.step()
        self.step_skipped = bool(stats.get("skipped", 0.0))
        global_nll = strategy.all_reduce(nll_total, op="sum").item() / self.copies
        out = {"train/loss": global_nll / global_tokens, "train/lr": stats["lr"],
               "train/grad_norm": stats["grad_norm"], "train/tokens": global_tokens}
        if self.aux_loss_coef:
            aux_sum, passes = strategy.all_reduce(aux_total, op="sum").tolist()
            out["train/aux_loss"] = aux_sum / max(passes, 1.0)
        return out

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        if not self.eval_samples:
            return {}
        strategy = self.strategy
        strategy.eval()
        shard = list(range(self.data_shard[0], len(self.eval_samples), self.data_shard[1]))
        nll, count = torch.zeros(()), torch.zeros(())
        mb = self.cfg.train.micro_batch_size
        batches = [shard[i : i + mb] for i in range(0, len(shard), mb)]
        for group in pad_micro_batch_count(strategy, batches):
            if group is None:  # keep collectives aligned across ranks (ZeRO-3)
                self._token_nll([self.eval_samples[0]])
                continue
            token_nll, mask = self._token_nll([self.eval_samples[i] for i in group])  # eval/loss: NLL only
            nll += (token_nll * mask).sum().cpu()
            count += mask.sum().cpu()
        strategy.train()
        nll = strategy.all_reduce(nll, op="sum").item() / self.copies
        count = strategy.all_reduce(count, op="sum").item() / self.copies
        return {"eval/loss": nll / max(count, 1.0), "eval/tokens": count}

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self) -> Path | None:
        state = {**self.state.as_dict(), "faults": self.guard.state_dict()}
        return save_step_checkpoint(self.strategy, self.cfg.ckpt, self.state.global_step, state,
                                    config=to_dict(self.cfg),
                                    export=lambda d: save_hf(self.strategy, self.tokenizer, d))

    def _maybe_resume(self) -> None:
        state = resume_trainer_state(self.strategy, self.cfg.ckpt, self.logger, self.cfg, self.plan)
        if state is not None:
            self.guard.load_state_dict(state.get("faults"))
            self.state = SFTState(global_step=int(state["global_step"]))
