"""Direct preference optimisation (DPO, cDPO, IPO; optional NLL term): one loop, top to bottom.

Per pair, with summed response log-probs (chosen and rejected run in one forward pass, padded or
packed) ``h = (log pi_c - log pi_r) - (log pi_ref_c - log pi_ref_r)``:

- DPO ``-log sigmoid(beta h)``; cDPO (``label_smoothing`` eps) ``-(1-eps) log sigmoid(beta h) - eps log sigmoid(-beta h)``;
- IPO (``ipo_enable``) ``(h - 1/(2 beta))^2``;
- plus ``nll_loss_coef`` x the chosen response's token-averaged NLL.

(:mod:`rlhforge.algorithms.preference_losses`.) The step loss is the mean over every pair of the
optimizer step on all ranks: each micro-batch contributes ``sum(pair losses) * world_size /
global_pairs`` (:meth:`rlhforge.backend.step.StepNormaliser.seq_share`).

The reference log-probs come from (:class:`Reference`): a separate frozen model
(``ref.model_name_or_path``, default the policy's checkpoint; ``ref.offload`` parks it on the CPU
between uses), or, with LoRA, the policy itself with its adapter disabled (no second copy). With
``ref.precompute_enable`` they are computed once for every train and eval pair before training
and the separate reference model is freed.

Ring attention (``--ds.ring_attn_size R``, ``ring``): the ``R`` ranks of one ring share a data shard
and every packed row (policy and reference), each runs its slice, and the token log-probs are
gathered back (:func:`rlhforge.backend.context_parallel.ring_token_logprobs`) before the per-sequence
sums, so every ring rank computes the same pair losses; pair counts summed over all ranks are divided
by ``R`` and the ring's partial gradients, averaged over the world, give the one-rank step.

Metrics: loss, accuracy (implicit reward of chosen > rejected), implicit rewards
``beta (log pi - log pi_ref)`` of chosen and rejected and their margin, summed log-probs of chosen
and rejected (``train/``, ``eval/``).
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from rlhforge.algorithms.preference_losses import chosen_nll_loss, dpo_sigmoid_loss, ipo_loss
from rlhforge.backend.autotp import copies, data_shard
from rlhforge.backend.device import empty_cache
from rlhforge.backend.step import StepNormaliser, pad_micro_batch_count, run_step, step_normaliser
from rlhforge.config.batching import BatchPlan
from rlhforge.data.preference import collate_pairs
from rlhforge.data.vlm_preference import VLMPreferenceSample, collate_vlm_pairs
from rlhforge.models.export import save_hf
from rlhforge.models.forward import sequence_logprob_sums, token_logprobs
from rlhforge.trainers.common import (add_aux_loss, aux_loss, eval_totals, moe_aux_loss_coef, resume_trainer,
                                      save_trainer_checkpoint, shard_batches, step_micro_batches, supervised_loop)
from rlhforge.trainers.faults import guard_for
from rlhforge.tracking.metrics import MetricsLogger

class DPOObjective:
    """The DPO-family loss of a micro-batch of pairs (DPO, cDPO, IPO, + NLL): what :class:`DPOTrainer` runs
    unless it is handed another objective (``rlhforge kto``: :class:`rlhforge.trainers.kto.KTOObjective`).

    An objective is called with the pairs' summed log-probs (policy ``sums`` [2B], reference ``ref`` [2B]:
    the B chosen then the B rejected sequences), the policy's token log-probs and response masks [2B, T] and
    the samples; it returns the summed loss over the pairs (differentiable) and detached totals named as
    ``FIELDS``, which :meth:`metrics` turns into ``train/``/``eval/`` metrics (``pairs``: the pairs counted)
    and :meth:`bar` into the progress bar's fields."""

    # totals per step / eval: loss, correct, chosen reward, rejected reward, chosen logp, rejected logp, nll, tokens
    UNIT = "pairs"  # what a step's examples are called in the metrics (train/pairs, perf/pairs_per_s)
    FIELDS = ("loss", "acc", "chosen_reward", "rejected_reward", "chosen_logp", "rejected_logp", "nll_loss", "tokens")

    def __init__(self, cfg):
        self.m = cfg.model

    def __call__(self, sums: Tensor, ref: Tensor, token_logps: Tensor, mask: Tensor, samples) -> tuple[Tensor, dict]:
        m, n = self.m, len(samples)
        pc, pr, rc, rr = sums[:n], sums[n:], ref[:n].to(sums.dtype), ref[n:].to(sums.dtype)
        if m.ipo_enable:
            loss, chosen_rewards, rejected_rewards = ipo_loss(pc, pr, rc, rr, beta=m.beta)
        else:
            loss, chosen_rewards, rejected_rewards = dpo_sigmoid_loss(pc, pr, rc, rr, beta=m.beta,
                                                                      label_smoothing=m.label_smoothing)
        loss_sum = loss * n
        nll_sum = torch.zeros((), device=loss.device)
        if m.nll_loss_coef > 0:
            nll_sum = chosen_nll_loss(token_logps[:n], mask[:n]) * n
            loss_sum = loss_sum + m.nll_loss_coef * nll_sum
        c, r = chosen_rewards.detach().double(), rejected_rewards.detach().double()
        totals = dict(zip(self.FIELDS, (loss_sum, (c > r).sum(), c.sum(), r.sum(), pc.detach().double().sum(),
                                        pr.detach().double().sum(), nll_sum, sum(len(s) for s in samples))))
        return loss_sum, totals

    def metrics(self, t: dict[str, float], pairs: float, prefix: str) -> dict[str, float]:
        t = {k: t.get(k, 0.0) for k in self.FIELDS}
        out = {f"{prefix}/{k}": t[k] / pairs for k in self.FIELDS if k not in ("tokens", "nll_loss")}
        out[f"{prefix}/reward_margin"] = (t["chosen_reward"] - t["rejected_reward"]) / pairs
        if self.m.nll_loss_coef > 0:
            out[f"{prefix}/nll_loss"] = t["nll_loss"] / pairs
        out[f"{prefix}/pairs"] = pairs
        out[f"{prefix}/tokens"] = t["tokens"]
        return out

    @staticmethod
    def bar(metrics: dict[str, float]) -> dict[str, float]:
        return {"loss": metrics["train/loss"], "acc": metrics["train/acc"], "margin": metrics["train/reward_margin"]}

def _rows(values: Tensor, seq_lens) -> Tensor:
    """A packed [1, N] tensor as [S, max_len] rows (zero-padded on the right)."""
    parts = torch.split(values[0], list(seq_lens))
    return torch.nn.utils.rnn.pad_sequence(parts, batch_first=True)


def _sequence_logps(model, batch, with_aux: bool = False, ring=None) -> tuple[Tensor, ...]:
    """(summed response log-probs [S], token log-probs [S, T], response mask [S, T]) of every sequence;
    with ``with_aux``, and the MoE load-balancing loss of the forward. ``ring``: a
    :class:`~rlhforge.backend.context_parallel.RingGroup` (packed batch, no aux loss), the log-probs
    computed across the ring and gathered (the same on every ring rank)."""
    if ring is not None:
        from rlhforge.backend.context_parallel import ring_token_logprobs

        logps, aux = ring_token_logprobs(model, batch, ring), ()
    else:
        # a pair's chosen and rejected share their prompt: computed once (rlhforge.models.shared_prefix);
        # the lm_head runs on the response tokens only (the only ones summed or read)
        out = token_logprobs(model, batch, return_aux_loss=with_aux, share_prefixes=True, needed=batch["loss_mask"])
        logps, aux = (out[0], out[1:]) if with_aux else (out, ())
    packed = batch.get("attention_mask") is None
    sums = sequence_logprob_sums(logps, batch["loss_mask"], batch["seq_lens"] if packed else None)
    if packed:
        return (sums, _rows(logps, batch["seq_lens"]), _rows(batch["loss_mask"], batch["seq_lens"]), *aux)
    return (sums, logps, batch["loss_mask"], *aux)


class Reference:
    """Reference log-probs: a separate frozen model (a :class:`~rlhforge.backend.frozen.FrozenModel`,
    prepared like the policy: ZeRO-3 partitioned over the ranks when the policy is, FSDP2 sharded
    under FSDP2), the policy with its LoRA adapter disabled (``model=None``), or values precomputed
    once per pair (:meth:`precompute`). With ``ring`` the forward runs across the ring (a separate
    model must use ring attention too)."""

    def __init__(self, strategy, policy, model=None, *, offload: bool = False, ring=None):
        self.strategy, self.policy, self.model, self.offload = strategy, policy, model, offload
        self.ring = ring
        # a ring's ranks share one data shard; AutoTP: a tensor-parallel group shares one shard
        self.shard = (ring.dp_rank, ring.dp_size) if ring is not None else data_shard(strategy)
        self.copies = copies(strategy) * (ring.ring_size if ring is not None else 1)  # ranks holding each pair
        self.tables: dict[str, Tensor] = {}  # split -> [num_pairs, 2] (chosen, rejected)

    @property
    def kind(self) -> str:
        if self.tables:
            return "precomputed"
        if self.model is None:
            return "adapter-disabled policy"
        st = self.model.stats()
        total = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in self.model.model.parameters())
        part = f", {st['local_numel']} of {total} parameters on this rank" if st["local_numel"] < total else ""
        return f"separate model ({st['kind']}{part}{', offloaded' if self.offload else ''})"

    @contextlib.contextmanager
    def active(self):
        """Keep an offloaded reference on the device for a while (one optimizer step, one eval)."""
        if self.model is None:
            yield
            return
        with self.model.hold():
            yield
        if self.offload:
            empty_cache(self.strategy.device)

    @torch.no_grad()
    def logps(self, batch) -> Tensor:
        """Summed response log-probs [2B] of a collated pair batch."""
        if self.model is None:
            module = self.strategy.module
            was_training = module.training
            module.eval()
            try:
                with module.disable_adapter(), self.strategy.autocast():
                    sums, _, _ = _sequence_logps(self.policy, batch, ring=self.ring)
            finally:
                module.train(was_training)
            return sums.detach()
        with self.model.use() as model:
            sums, _, _ = _sequence_logps(model, batch, ring=self.ring)
        return sums.detach()

    def lookup(self, split: str, indices: list[int]) -> Tensor | None:
        table = self.tables.get(split)
        if table is None:
            return None
        rows = table[torch.as_tensor(indices, dtype=torch.long)]
        return torch.cat([rows[:, 0], rows[:, 1]]).to(self.strategy.device)

    def precompute(self, split: str, samples, micro_batch_size: int, collate) -> None:
        """Reference log-probs of every pair of ``samples`` (sharded over ranks, then summed)."""
        strategy = self.strategy
        table = torch.zeros(len(samples), 2, dtype=torch.float64)
        batches = shard_batches(len(samples), self.shard, micro_batch_size)
        with self.active():
            for group in pad_micro_batch_count(strategy, batches):
                chunk = [samples[0]] if group is None else [samples[i] for i in group]
                sums = self.logps(collate(chunk)).double().cpu()
                if group is not None:
                    n = len(group)
                    table[torch.as_tensor(group)] = torch.stack([sums[:n], sums[n:]], dim=1)
        self.tables[split] = (strategy.all_reduce(table, op="sum") / self.copies).float()

    def release_model(self) -> None:
        """Free a separate reference model (after precomputing)."""
        if self.model is not None:
            self.model = None
            gc.collect()
            empty_cache(self.strategy.device)


@dataclass
class DPOState:
    global_step: int = 0

    def as_dict(self) -> dict:
        return {"global_step": self.global_step}


class DPOTrainer:
    def __init__(self, cfg, strategy, model, reference: Reference, tokenizer, train_samples, eval_samples,
                 plan: BatchPlan, logger: MetricsLogger, ring=None, objective=None, name: str = "dpo"):
        self.cfg, self.strategy, self.tokenizer = cfg, strategy, tokenizer
        self.objective = objective if objective is not None else DPOObjective(cfg)
        self.name = name  # the command: progress bar and messages
        self.model = model  # the wrapped module returned by strategy.prepare
        self.reference = reference
        self.ring = ring  # a context_parallel.RingGroup with --ds.ring_attn_size > 1, else None
        self.ring_size = ring.ring_size if ring is not None else 1
        self.shard, self.copies = reference.shard, reference.copies  # data shard, ranks holding each pair
        self.train_samples, self.eval_samples = train_samples, eval_samples
        self.plan, self.logger = plan, logger
        self.state = DPOState()
        self.guard = guard_for(cfg, strategy)  # preemption, non-finite steps, checkpoint write errors
        self.step_skipped = False  # the last optimizer step was skipped (non-finite loss or gradient norm)
        self.aux_loss_coef = moe_aux_loss_coef(cfg, strategy)  # 0 on a dense model (one notice)
        self.aux = None  # the last training micro-batch's balancing loss (differentiable)

    # -- one micro-batch -------------------------------------------------------------------------
    def _collate(self, samples):
        if isinstance(samples[0], VLMPreferenceSample):  # images: padded, M-RoPE positions from the model
            batch = collate_vlm_pairs(samples, self.tokenizer.pad_token_id, self.tokenizer.image_token_id)
        else:
            batch = collate_pairs(samples, self.tokenizer.pad_token_id, packed=self.cfg.ds.packing_samples)
        return {k: v.to(self.strategy.device) if torch.is_tensor(v) else v for k, v in batch.items()}

    def _pair_losses(self, split: str, indices: list[int], samples) -> tuple[Tensor, dict]:
        """(summed loss over the pairs (differentiable), detached totals named as the objective's ``FIELDS``);
        called under the strategy's autocast."""
        batch = self._collate(samples)
        ref = self.reference.lookup(split, indices)
        if ref is None:
            ref = self.reference.logps(batch)
        sums, token_logps, mask, *aux = _sequence_logps(self.model, batch, ring=self.ring,
                                                        with_aux=split == "train" and bool(self.aux_loss_coef))
        self.aux = aux[0] if aux else None
        return self.objective(sums, ref, token_logps, mask, samples)

    def _loss(self, ids: list[int], norm: StepNormaliser, passes: int):
        """This micro-batch's share of the step's mean pair loss (+ MoE balancing loss), and its totals."""
        loss_sum, totals = self._pair_losses("train", ids, [self.train_samples[i] for i in ids])
        loss = norm.seq_share(loss_sum)
        return add_aux_loss(loss, totals, self.aux_loss_coef, self.aux, passes), totals

    # -- the loop --------------------------------------------------------------------------------
    def fit(self) -> None:
        cfg, strategy = self.cfg, self.strategy
        if cfg.ref.precompute_enable:
            start = time.perf_counter()
            mb = cfg.train.micro_batch_size
            self.reference.precompute("train", self.train_samples, mb, self._collate)
            if self.eval_samples:
                self.reference.precompute("eval", self.eval_samples, mb, self._collate)
            self.reference.release_model()
            if strategy.is_rank0:
                print(f"[rlhforge] {self.name}: reference log-probs of {len(self.train_samples)} train / "
                      f"{len(self.eval_samples)} eval pairs precomputed in {time.perf_counter() - start:.1f}s")
        self._maybe_resume()
        supervised_loop(self, desc=self.name, shard=self.shard, per_s=(self.objective.UNIT, "tokens"),
                        eval_at_last_step=True, bar_fields=self.objective.bar, finish=self._finish)

    def _finish(self) -> None:
        """After the last step: the final checkpoint and the export."""
        if self.cfg.ckpt.save_steps > 0:
            self.save_checkpoint()
        save_hf(self.strategy, self.tokenizer, self.cfg.ckpt.output_dir)

    def train_step(self, indices: list[int]) -> dict[str, float]:
        strategy, samples = self.strategy, self.train_samples
        norm = step_normaliser(strategy, seqs=len(indices), ring_size=self.ring_size)
        groups = step_micro_batches(self, indices, lambda i: len(samples[i]))
        with self.reference.active():
            out = run_step(strategy, groups, lambda ids, n: self._loss(ids, n, len(groups)), norm, dummy=[indices[0]])
        self.step_skipped = out.skipped
        metrics = self.objective.metrics(out.totals, norm.seqs, "train")
        metrics.update({"train/lr": out.stats["lr"], "train/grad_norm": out.stats["grad_norm"]})
        if self.aux_loss_coef:
            metrics["train/aux_loss"] = aux_loss(out.totals, norm)
        return metrics

    def evaluate(self) -> dict[str, float]:
        if not self.eval_samples:
            return {}
        samples = self.eval_samples

        def totals(ids):
            return {**self._pair_losses("eval", ids, [samples[i] for i in ids])[1], "pairs": len(ids)}

        with self.reference.active():  # a dummy pass keeps collectives aligned (ZeRO-3)
            t = eval_totals(self, len(samples), self.shard, totals)
        return self.objective.metrics(t, max(t.get("pairs", 0.0), 1.0), "eval")

    # -- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self) -> Path | None:
        return save_trainer_checkpoint(self, export=lambda d: save_hf(self.strategy, self.tokenizer, d))

    def _maybe_resume(self) -> None:
        state = resume_trainer(self)
        if state is not None:
            self.state = DPOState(global_step=int(state["global_step"]))
