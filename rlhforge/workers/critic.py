"""The critic's worker: a value model (sequence classifier with one label, read per token); values
and clipped value-loss updates (:mod:`rlhforge.workers.actor` has the actor and the reference)."""

from __future__ import annotations

import torch

from rlhforge.algorithms import value_loss
from rlhforge.backend.device import seed_everything
from rlhforge.backend.step import StepNormaliser, run_no_grad, run_step, step_normaliser
from rlhforge.config.batching import RLBatchPlan
from rlhforge.workers.micro_batches import micro_batch_groups
from rlhforge.workers.base import TrainableWorker, per_sample, reduce_step_metrics, scatter
from rlhforge.models.forward import is_packed

__all__ = ["CriticWorker", "token_values"]


def token_values(model, batch: dict, prefix: str = "score") -> torch.Tensor:
    """Critic values aligned like log-probs: ``values[:, t]`` = V(state before token t) = the value
    head at position ``t - 1`` (0 at t = 0). [B, T] (or [1, N] packed), differentiable."""
    from rlhforge.models.reward import value_head

    captured: dict[str, torch.Tensor] = {}

    def hook(_module, _inputs, output):
        captured["v"] = output

    rows = None
    if is_packed(batch):  # bounded rows, as for log-probs: attention never spans the whole micro-batch
        from rlhforge.models.forward import packed_model_inputs

        kwargs, rows = packed_model_inputs(model, batch)
    else:
        kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                  "position_ids": batch.get("position_ids"), "use_cache": False}
    handle = value_head(model, prefix).register_forward_hook(hook)
    try:
        model(**kwargs)
    finally:
        handle.remove()
    v = captured["v"][..., 0].float()
    if rows is not None:
        v = rows.to_packed(v)
    v = torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)
    if is_packed(batch):  # packed: 0 at each sample's first token too (the shift carried the previous sample's last)
        from rlhforge.models.forward import prediction_mask

        v = v * prediction_mask(batch).to(v.dtype)
    return v


class CriticWorker(TrainableWorker):
    def __init__(self, cfg, tokenizer, plan: RLBatchPlan, group_size: int = 1):
        """``plan``: the run's batch plan (:func:`rlhforge.config.batching.plan_rl_run`); ``group_size``: the
        critic ranks, over which each optimizer step's ``plan.batch_size`` samples are split."""
        from rlhforge.backend.factory import build_strategy
        from rlhforge.models.reward import load_reward_model

        self.cfg, self.tokenizer = cfg, tokenizer
        from rlhforge.rewards.sources import reward_model_paths

        first_rm = (reward_model_paths(cfg.reward.model_name_or_path) or [None])[0]  # OpenRLHF: the first reward model
        path = cfg.critic.model_name_or_path or first_rm or cfg.actor.model_name_or_path
        step_plan = plan.strategy_plan(max(group_size, 1))
        self.strategy = build_strategy(cfg.ds, cfg.critic.optim_config(), cfg.train, step_plan)
        seed_everything(cfg.train.seed, cfg.train.full_determinism_enable)  # a new value head: same init on
        # every rank and in every process layout (in-process or Ray)
        model = load_reward_model(path, cfg.critic, cfg.ds, self.strategy.device, pad_token_id=tokenizer.pad_token_id,
                                  value_head_prefix=cfg.ds.value_head_prefix)
        self.model = self.strategy.prepare(model, step_plan.total_steps)
        self.device, self.packed, self.prefix = self.strategy.device, cfg.ds.packing_samples, cfg.ds.value_head_prefix
        self.train_tokens, self.pass_tokens = plan.train_tokens, plan.pass_tokens
        self.path = path

    def values(self, samples, micro_batch_size: int) -> list[torch.Tensor]:
        groups = micro_batch_groups([len(s) for s in samples], micro_batch_size, self.pass_tokens,
                                    self.strategy.all_reduce)

        def values_of(idx):
            chunk = [samples[i] for i in idx]
            batch = self._batch(chunk, fields=())
            return per_sample(token_values(self.model, batch, self.prefix), batch, chunk)

        return scatter(groups, run_no_grad(self.strategy, groups, values_of), len(samples))

    def _loss(self, chunk, norm: StepNormaliser, value_clip: float | None):
        """The clipped value loss of a micro-batch (its share of the step's token mean) and its totals."""
        batch = self._batch(chunk)
        mask = batch["loss_mask"]
        values = token_values(self.model, batch, self.prefix)
        tok_loss, metrics = value_loss(values, batch["values"], batch["returns"], mask, value_clip=value_clip)
        loss = norm.aggregate(tok_loss, mask)
        weight = float(mask.sum()) / max(norm.tokens, 1.0)  # token share of this micro-batch
        return loss, {"value_loss": loss, "clip_frac": float(metrics["clip_frac"]) * weight,
                      "values_mean": float(metrics["values_mean"]) * weight}

    def train_step(self, samples, value_clip: float | None) -> dict[str, float]:
        strategy = self.strategy
        norm = step_normaliser(strategy, tokens=sum(sum(s.loss_mask) for s in samples))
        groups = [[samples[i] for i in idx] for idx in micro_batch_groups(
            [len(s) for s in samples], self.cfg.train.micro_batch_size, self.train_tokens, strategy.all_reduce)]
        step = run_step(strategy, groups, lambda mb, n: self._loss(mb, n, value_clip), norm, reduce=False)
        t = step.totals  # value_loss: dp-scaled (mean over ranks); the others token-share weighted (sum)
        out = reduce_step_metrics({"value_loss": t.get("value_loss", 0.0)},
                                  {k: t.get(k, 0.0) for k in ("clip_frac", "values_mean")},
                                  strategy.all_reduce, norm.dp_size)
        out.update(grad_norm=step.stats["grad_norm"], lr=step.stats["lr"], skipped=step.stats.get("skipped", 0.0))
        out["micro_batches"] = float(step.micro_batches)  # forward/backward passes of this step on each rank
        return out
