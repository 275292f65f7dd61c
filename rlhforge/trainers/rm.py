"""Pairwise reward-model training: one loop, top to bottom.

Each micro-batch runs chosen and rejected sequences in one forward pass (padded or packed); the
reward of a sequence is the value head at its last token (:func:`rlhforge.models.reward.sequence_rewards`).

Loss: mean over every pair of the optimizer step, on all ranks together: each micro-batch
contributes ``sum(pair losses) * world_size / global_pairs`` (:meth:`rlhforge.backend.step.StepNormaliser.seq_share`,
the contract of :mod:`rlhforge.algorithms.aggregation`; strategies sum over micro-batches and average over
ranks), so the result does not depend on the number of ranks or micro-batches.
Pair loss: ``sigmoid`` -log sigmoid(r_c - r_r - m) or ``logexp`` log(1 + exp(r_r - r_c + m))
(:mod:`rlhforge.algorithms.preference_losses`), m = the record's margin with
``--model.margin_loss_enable``, else 0.

Ring attention (``--ds.ring_attn_size R``, ``ring``): the ``R`` ranks of one ring share a data shard
and every packed row, each runs its slice, and the value head's per-token outputs are gathered
before the rewards are read at each sample's last token
(:func:`rlhforge.backend.context_parallel.ring_sequence_rewards`); pair counts summed over all ranks
are divided by ``R`` and the ring's partial gradients, averaged over the world, give the one-rank step.

Evaluation (every ``eval.steps``, at each epoch end and always after the last step): loss,
accuracy (r_c > r_r), chosen/rejected reward means, and the mean/std of all eval rewards (chosen
and rejected), which are exported as ``reward_mean``/``reward_std`` in config.json. Without eval
data the statistics come from (up to 1024) training pairs after training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhforge.algorithms.preference_losses import get_rm_loss
from rlhforge.backend.autotp import copies, data_shard
from rlhforge.backend.step import StepNormaliser, run_step, step_normaliser
from rlhforge.config.batching import BatchPlan
from rlhforge.data.preference import collate_pairs
from rlhforge.models.reward import save_reward_model, sequence_rewards
from rlhforge.trainers.common import (add_aux_loss, aux_loss, eval_totals, moe_aux_loss_coef, resume_trainer,
                                      save_trainer_checkpoint, step_micro_batches, supervised_loop)
from rlhforge.trainers.faults import guard_for
from rlhforge.tracking.metrics import MetricsLogger

STATS_SAMPLES_WITHOUT_EVAL = 1024


@dataclass
class RMState:
    global_step: int = 0
    reward_stats: tuple[float, float] | None = None
    """(mean, std) of the rewards at the last evaluation."""

    def as_dict(self) -> dict:
        return {"global_step": self.global_step,
                "reward_stats": list(self.reward_stats) if self.reward_stats is not None else None}


class RMTrainer:
    def __init__(self, cfg, strategy, model, tokenizer, train_samples, eval_samples, plan: BatchPlan,
                 logger: MetricsLogger, ring=None):
        self.cfg, self.strategy, self.tokenizer = cfg, strategy, tokenizer
        self.model = model  # the wrapped module returned by strategy.prepare
        self.ring = ring  # a context_parallel.RingGroup with --ds.ring_attn_size > 1, else None
        self.ring_size = ring.ring_size if ring is not None else 1
        # a ring's ranks share one data shard; AutoTP: a tensor-parallel group shares one shard
        self.shard = (ring.dp_rank, ring.dp_size) if ring is not None else data_shard(strategy)
        self.copies = copies(strategy) * self.ring_size  # ranks that hold each pair
        self.train_samples, self.eval_samples = train_samples, eval_samples
        self.plan, self.logger = plan, logger
        self.loss_fn = get_rm_loss(cfg.model.loss_type)
        self.state = RMState()
        self.guard = guard_for(cfg, strategy)  # preemption, non-finite steps, checkpoint write errors
        self.step_skipped = False  # the last optimizer step was skipped (non-finite loss or gradient norm)
        self.aux_loss_coef = moe_aux_loss_coef(cfg, strategy)  # 0 on a dense model (one notice)
        self.aux = None  # the last training micro-batch's balancing loss (differentiable)

    # -- one micro-batch -------------------------------------------------------------------------
    def _rewards(self, samples, with_aux: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(chosen rewards [B], rejected rewards [B], margins [B]) of ``samples`` in one forward pass
        (with ``with_aux``, the MoE load-balancing loss of that forward goes to ``self.aux``); called under
        the strategy's autocast."""
        batch = collate_pairs(samples, self.tokenizer.pad_token_id, packed=self.cfg.ds.packing_samples)
        device = self.strategy.device
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
        if self.ring is not None:  # no aux loss with a ring (refused)
            from rlhforge.backend.context_parallel import ring_sequence_rewards

            rewards = ring_sequence_rewards(self.model, batch, self.ring, self.cfg.ds.value_head_prefix)
        else:
            rewards = sequence_rewards(self.model, batch, self.cfg.ds.value_head_prefix, return_aux_loss=with_aux)
        rewards, self.aux = rewards if with_aux else (rewards, None)
        if self.cfg.model.compute_fp32_loss_enable:
            rewards = rewards.float()
        n = len(samples)
        return rewards[:n], rewards[n:], batch["margin"].to(rewards.dtype)

    def _loss_sum(self, chosen, rejected, margin) -> torch.Tensor:
        margin = margin if self.cfg.model.margin_loss_enable else None
        return self.loss_fn(chosen, rejected, margin) * chosen.shape[0]

    def _totals(self, chunk, with_aux: bool = False) -> tuple[torch.Tensor, dict]:
        """(summed pair loss of ``chunk`` (differentiable), its detached totals)."""
        chosen, rejected, margin = self._rewards(chunk, with_aux=with_aux)
        loss_sum = self._loss_sum(chosen, rejected, margin)
        c, r = chosen.detach().double(), rejected.detach().double()
        return loss_sum, {"loss": loss_sum, "correct": (c > r).sum(), "chosen": c.sum(), "rejected": r.sum(),
                          "sq": c.square().sum() + r.square().sum(), "pairs": len(chunk),
                          "tokens": sum(len(s) for s in chunk)}

    def _loss(self, chunk, norm: StepNormaliser, passes: int):
        """This micro-batch's share of the step's mean pair loss (+ MoE balancing loss), and its totals."""
        loss_sum, totals = self._totals(chunk, with_aux=bool(self.aux_loss_coef))
        loss = norm.seq_share(loss_sum)
        return add_aux_loss(loss, totals, self.aux_loss_coef, self.aux, passes), totals

    # -- the loop --------------------------------------------------------------------------------
    def fit(self) -> None:
        self._maybe_resume()
        supervised_loop(self, desc="rm", shard=self.shard, per_s=("pairs", "tokens"), eval_at_last_step=True,
                        bar_fields=lambda m: {"loss": m["train/loss"], "acc": m["train/acc"]},
                        finish=self._finish)

    def _finish(self) -> None:
        """After the last step: the final checkpoint and the export."""
        cfg = self.cfg
        if self.state.reward_stats is None:
            self.state.reward_stats = self._stats_from_train()
        if cfg.ckpt.save_steps > 0:
            self.save_checkpoint()
        self.export(cfg.ckpt.output_dir)

    def train_step(self, indices: list[int]) -> dict[str, float]:
        strategy, samples = self.strategy, self.train_samples
        norm = step_normaliser(strategy, seqs=len(indices), ring_size=self.ring_size)
        groups = [None if g is None else [samples[i] for i in g]
                  for g in step_micro_batches(self, indices, lambda i: len(samples[i]))]
        out = run_step(strategy, groups, lambda mb, n: self._loss(mb, n, len(groups)), norm,
                       dummy=[samples[indices[0]]])
        self.step_skipped = out.skipped
        t, pairs = out.totals, norm.seqs
        metrics = {}
        if self.aux_loss_coef:
            metrics["train/aux_loss"] = aux_loss(t, norm)
        return {**metrics, "train/loss": t["loss"] / pairs, "train/acc": t["correct"] / pairs,
                "train/chosen_reward": t["chosen"] / pairs, "train/rejected_reward": t["rejected"] / pairs,
                "train/reward_margin": (t["chosen"] - t["rejected"]) / pairs,
                "train/lr": out.stats["lr"], "train/grad_norm": out.stats["grad_norm"], "train/pairs": pairs,
                "train/tokens": t["tokens"]}

    def _score(self, samples, prefix: str) -> dict[str, float]:
        """Loss/accuracy/reward statistics of ``samples`` (sharded over ranks, reduced)."""
        t = eval_totals(self, len(samples), self.shard, lambda g: self._totals([samples[i] for i in g])[1])
        pairs = max(t.get("pairs", 0.0), 1.0)
        loss, correct, chosen_sum, rejected_sum, sq_sum = (t.get(k, 0.0) for k in ("loss", "correct", "chosen",
                                                                                  "rejected", "sq"))
        mean = (chosen_sum + rejected_sum) / (2 * pairs)
        std = max(math.sqrt(max(sq_sum / (2 * pairs) - mean * mean, 0.0)), 1e-8)
        return {f"{prefix}/loss": loss / pairs, f"{prefix}/acc": correct / pairs,
                f"{prefix}/chosen_reward": chosen_sum / pairs, f"{prefix}/rejected_reward": rejected_sum / pairs,
                f"{prefix}/reward_margin": (chosen_sum - rejected_sum) / pairs,
                f"{prefix}/reward_mean": mean, f"{prefix}/reward_std": std, f"{prefix}/pairs": pairs}

    def evaluate(self) -> dict[str, float]:
        if not self.eval_samples:
            return {}
        metrics = self._score(self.eval_samples, "eval")
        self.state.reward_stats = (metrics["eval/reward_mean"], metrics["eval/reward_std"])
        return metrics

    def _stats_from_train(self) -> tuple[float, float]:
        subset = self.train_samples[:STATS_SAMPLES_WITHOUT_EVAL]
        metrics = self._score(subset, "train_stats")
        if self.strategy.is_rank0:
            print(f"[rlhforge] rm: no eval data; reward mean/std for normalisation taken from {len(subset)} "
                  "training pairs")
        return metrics["train_stats/reward_mean"], metrics["train_stats/reward_std"]

    # -- outputs and checkpoints -----------------------------------------------------------------
    def export(self, out_dir) -> None:
        cfg = self.cfg
        save_reward_model(self.strategy, self.tokenizer, out_dir, stats=self.state.reward_stats,
                          base_path=cfg.model.model_name_or_path, model_cfg=cfg.model, ds_cfg=cfg.ds)

    def save_checkpoint(self) -> Path | None:
        return save_trainer_checkpoint(self, export=self.export)

    def _maybe_resume(self) -> None:
        state = resume_trainer(self)
        if state is not None:
            stats = state.get("reward_stats")
            self.state = RMState(global_step=int(state["global_step"]), reward_stats=tuple(stats) if stats else None)
