"""Per-model work of the RL loop behind a small worker-group seam.

The loop never touches a model directly; it calls methods on groups::

    actor.map_gather("logprobs", samples, ...)   -> one result per sample, in order
    actor.map_train("train_step", samples, ...)  -> metrics per rank
    actor.call("save_state", path)               -> same call on every rank

(:mod:`rlhforge.distributed.groups`): an in-process group runs one worker in this process (the CPU /
single-GPU path); a Ray group (:mod:`rlhforge.distributed.ray_group`) builds the same worker classes
inside N Ray actors, one data-parallel rank each. Workers:

- :class:`ActorWorker`: the policy (strategy, optimizer, scheduler); log-probs, PPO/GSPO updates,
  full state dict for weight sync and export.
- :class:`RefWorker`: a frozen copy of the initial policy; log-probs.
- :class:`CriticWorker` (:mod:`rlhforge.workers.critic`, re-exported here): a value model
  (sequence classifier with one label, read per token); values and clipped value-loss updates.

What they share (checkpoint state, export, sleep, metric reduction) is in
:mod:`rlhforge.workers.base`.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from rlhforge.backend.device import seed_everything
from rlhforge.backend.step import StepNormaliser, run_no_grad, run_step, step_normaliser
from rlhforge.config.batching import RLBatchPlan
from rlhforge.workers.critic import CriticWorker, token_values
from rlhforge.workers.experience import ExperienceSample, collate_experience
from rlhforge.workers.losses import PolicyLossSpec, policy_objective
from rlhforge.workers.micro_batches import micro_batch_groups, packed_as_rows
from rlhforge.workers.base import (
    TrainableWorker,
    per_sample,
    reduce_step_metrics,
    scatter,
    shifted_entropy,
    to_device,
)
from rlhforge.models.forward import token_logprobs

__all__ = ["ActorWorker", "RefWorker", "CriticWorker", "token_values", "PolicyLossSpec",
           "reduce_step_metrics"]


def check_routing_replay(model, device) -> None:
    """``--train.routing_replay`` at start-up: the actor must be an MoE model whose router replays exactly."""
    from rlhforge.config.parsing import ConfigError
    from rlhforge.models.routing import check_replayable

    try:
        with torch.no_grad():
            check_replayable(model, torch.arange(8, device=device)[None] % 5 + 1)
    except ValueError as err:
        raise ConfigError(f"--train.routing_replay: {err}") from err


class ActorWorker(TrainableWorker):
    ring = None  # this rank's context_parallel.RingGroup with --ds.ring_attn_size > 1
    ring_size = 1
    routing_replay = False  # --train.routing_replay: batches carry the rollout's MoE routing
    aux_loss_coef = 0.0  # --actor.aux_loss_coef on an MoE model (0: no load-balancing term)
    image_token_id = None  # a vision-language actor's image token (its batches then carry pixels)

    def __init__(self, cfg, tokenizer, plan: RLBatchPlan, group_size: int = 1):
        """``plan``: the run's batch plan (:func:`rlhforge.config.batching.plan_rl_run`); ``group_size``: the
        actor ranks (those of one ring / AutoTP group share their samples)."""
        from rlhforge.backend.factory import build_strategy
        from rlhforge.models.vlm import image_token_of, load_policy

        self.cfg, self.tokenizer = cfg, tokenizer
        self.image_token_id = image_token_of(tokenizer)  # a vision-language actor (docs/vlm.md)
        step_plan = plan.strategy_plan(max(group_size // (cfg.ds.ring_attn_size * cfg.ds.tensor_parallel_size), 1))
        self.strategy = build_strategy(cfg.ds, cfg.actor.optim_config(), cfg.train, step_plan)
        seed_everything(cfg.train.seed, cfg.train.full_determinism_enable)
        with self.strategy.model_init():  # ZeRO-3: partitioned as it loads
            model = load_policy(cfg.actor.model_name_or_path, cfg.actor, cfg.ds, self.strategy.device, tokenizer,
                                freeze_visual_encoder=cfg.actor.freeze_visual_encoder)
        if cfg.ds.ring_attn_size > 1:
            from rlhforge.backend.context_parallel import new_ring_group, use_ring_attention

            self.ring = new_ring_group(cfg.ds.ring_attn_size, cfg.ds.ring_attn_head_stride)
            use_ring_attention(model)
            self.ring_size = self.ring.ring_size
        self.model = self.strategy.prepare(model, step_plan.total_steps)
        self.device = self.strategy.device
        self.packed = cfg.ds.packing_samples
        if cfg.train.enable_ema:  # of each rank's local shard, from the initial weights (backend/ema.py)
            from rlhforge.backend.ema import ParamEMA

            self.ema = ParamEMA(self.strategy.module, cfg.train.ema_beta, self.strategy.rank)
        self.train_tokens, self.pass_tokens = plan.train_tokens, plan.pass_tokens
        if self.ring is not None:  # a ring holds ring_size times a worker's budget (each rank 1/ring of it), as OpenRLHF
            self.train_tokens, self.pass_tokens = (b * self.ring_size if b else b for b in (self.train_tokens,
                                                                                              self.pass_tokens))
        self.routing_replay = cfg.train.routing_replay
        if self.routing_replay:
            check_routing_replay(self.strategy.module, self.device)
        from rlhforge.models.moe import aux_loss_enabled

        coef = cfg.actor.aux_loss_coef  # MoE load-balancing loss (0 on a dense model: one notice)
        self.aux_loss_coef = coef if aux_loss_enabled(coef, self.strategy.module, "--actor.aux_loss_coef") else 0.0

    def _token_logprobs(self, batch: dict, temperature: float, return_entropy: bool = False,
                        entropy_grad: bool = True, **kwargs):
        """``token_logprobs`` of a micro-batch (with ``return_entropy``: ``(logprobs, entropy, *aux)``), across
        the ring when ring attention is on (every rank of a ring holds the same samples and gets the same
        result). Off the ring the full-vocabulary logits are never materialised (models.chunked_head)."""
        if self.ring is not None:
            from rlhforge.backend.context_parallel import ring_token_logprobs

            out = ring_token_logprobs(self.model, batch, self.ring, temperature, return_logits=return_entropy)
            keep = batch["loss_mask"].to(torch.float32)  # as off the ring: the action tokens' values only
            if not return_entropy:
                return out * keep
            logp, logits = out
            return logp * keep, shifted_entropy(logits if entropy_grad else logits.detach(), temperature) * keep
        return token_logprobs(self.model, batch, temperature, return_entropy=return_entropy, entropy_grad=entropy_grad,
                              share_prefixes=True, needed=batch["loss_mask"], **kwargs)  # actions only

    def _experience(self, chunk, **kw) -> dict:
        return self._batch(chunk, routing=self.routing_replay, image_token_id=self.image_token_id, **kw)

    # -- inference --------------------------------------------------------------------------------
    def logprobs(self, samples: Sequence[ExperienceSample], micro_batch_size: int, temperature: float
                 ) -> list[torch.Tensor]:
        groups = micro_batch_groups([len(s) for s in samples], micro_batch_size, self.pass_tokens,
                                    self.strategy.all_reduce)

        def logprobs_of(idx):
            chunk = [samples[i] for i in idx]
            batch = self._experience(chunk, fields=())
            return per_sample(self._token_logprobs(batch, temperature), batch, chunk)

        return scatter(groups, run_no_grad(self.strategy, groups, logprobs_of), len(samples))

    # -- one optimizer step -----------------------------------------------------------------------
    def _loss(self, chunk, norm: StepNormaliser, spec: PolicyLossSpec, passes: int):
        """One micro-batch's forward: its log-probs and entropy (and what the objective's extra terms need),
        then its share of the step's loss and its totals (:func:`rlhforge.workers.losses.policy_objective`)."""
        batch = self._experience(chunk)
        topk = {"return_logits": True} if spec.distill_topk_coef > 0 else {}  # the student's logits at top-k ids
        logp, *rest = self._token_logprobs(batch, spec.temperature, return_entropy=True,
                                           entropy_grad=bool(spec.entropy_coef),
                                           return_aux_loss=bool(self.aux_loss_coef), **topk)
        distill = []
        if topk:  # on-policy distillation, forward_kl_topk (workers/distill.py)
            from rlhforge.workers.distill import distill_topk_term

            distill = [distill_topk_term(rest.pop(0), batch, chunk, spec.temperature)]
        entropy, *aux = rest
        if self.packed:  # one row per sample: sequence-level terms (seq-mean modes, GSPO) need samples
            batch, logp, entropy, *distill = packed_as_rows(batch, logp, entropy, *distill)
        return policy_objective(spec, norm, batch, logp, entropy, distill[0] if distill else None,
                                aux[0] if aux else None, self.aux_loss_coef, passes)

    def train_step(self, samples: Sequence[ExperienceSample], spec: PolicyLossSpec) -> dict[str, float]:
        strategy = self.strategy
        # ring attention / AutoTP: the ranks of a ring or tensor-parallel group hold the same samples (copies)
        norm = step_normaliser(strategy, tokens=sum(sum(s.loss_mask) for s in samples),
                               seqs=sum(1 for s in samples if any(s.loss_mask)), ring_size=self.ring_size,
                               norm_constant=spec.norm_constant)
        groups = [[samples[i] for i in idx] for idx in micro_batch_groups(
            [len(s) for s in samples], self.cfg.train.micro_batch_size, self.train_tokens, strategy.all_reduce)]
        step = run_step(strategy, groups, lambda mb, n: self._loss(mb, n, spec, len(groups)), norm, reduce=False)
        if self.ema is not None and not step.skipped:
            self.ema.update()  # once per applied optimizer step
        dp_keys = ["policy_loss"] + ["kl_loss"] * (spec.kl_loss_coef > 0) + ["aux_loss"] * bool(self.aux_loss_coef)
        losses = {k: step.totals.get(k, 0.0) for k in dp_keys}  # dp-scaled (aggregate_loss): mean over ranks
        weighted = {"entropy": 0.0, **{k: v for k, v in step.totals.items() if k not in losses}}  # token-share: sum
        out = reduce_step_metrics(losses, weighted, strategy.all_reduce, norm.dp_size)
        for name in (*losses, *weighted):  # every rank of a ring / AutoTP group holds the same samples
            out[name] /= norm.copies
        out.update(grad_norm=step.stats["grad_norm"], lr=step.stats["lr"], skipped=step.stats.get("skipped", 0.0))
        out["micro_batches"] = float(step.micro_batches)  # forward/backward passes of this step on each rank
        return out

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        return self.strategy.full_state_dict()

    def engine_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The weights generation engines load: the full state dict (all ranks take part, rank 0 gets it),
        with LoRA adapters merged into the base weights (base-model names). QLoRA stays unmerged (its
        in-process engine is a copy of the PEFT model)."""
        from rlhforge.backend.fingerprint import state_fingerprint

        state = self.strategy.full_state_dict()
        if state is not None and self.cfg.ds.lora.rank > 0 and not self.cfg.ds.load_in_4bit:
            from rlhforge.models.export import merged_lora_state

            state = merged_lora_state(state, self.strategy.module)
        self._sent_fingerprint = state_fingerprint(state) if state is not None else None
        return state

    # -- weight sync over a dedicated group (Ray workers; rlhforge.workers.weight_sync) --------
    def open_weight_channel(self, host: str, port: int, world_size: int, bucket_bytes: int,
                            backend: str = "gloo", timeout_s: float = 1800.0) -> None:
        """Rank 0 only: host a new sync group (the previous one, if any, is dropped) and join it as sender."""
        from rlhforge.backend.collective import SyncGroup

        device = str(self.device) if backend == "nccl" else "cpu"
        self._sender = None
        self._sender = SyncGroup(host, port, 0, world_size, backend, device, timeout_s)
        self._bucket_bytes = int(bucket_bytes)

    def _engine_weights(self):
        """(name, tensor) pairs the engines load, the same sequence on every rank (the CUDA-IPC sync has
        every rank send each bucket; the group sync sends rank 0's): streamed one gathered parameter at a
        time, with LoRA adapters merged into their base weights as they pass."""
        stream = self.strategy.iter_full_weights()
        if self.cfg.ds.lora.rank > 0 and not self.cfg.ds.load_in_4bit:
            from rlhforge.models.export import merged_lora_stream

            stream = merged_lora_stream(stream, self.strategy.module)
        return self._fingerprinted(stream)

    def _fingerprinted(self, stream):
        """Rank 0: the fingerprint of everything streamed (rlhforge.backend.fingerprint), kept for
        :meth:`sent_fingerprint` once the stream was read to its end (a broken sync leaves None)."""
        from rlhforge.backend.fingerprint import Fingerprint

        fp = Fingerprint() if self.strategy.is_rank0 else None
        self._sent_fingerprint = None
        for name, t in stream:
            if fp is not None:
                fp.add(name, t)
            yield name, t
        if fp is not None:
            self._sent_fingerprint = fp.hexdigest()

    def sent_fingerprint(self) -> str | None:
        """Rank 0: the fingerprint of the weights the last sync sent (None elsewhere, or before any)."""
        return getattr(self, "_sent_fingerprint", None)

    def send_weights(self) -> int:
        """All ranks gather; rank 0 streams to the group. Returns the number of buckets (rank 0)."""
        stream = self._engine_weights()
        sender = getattr(self, "_sender", None)
        if sender is None or not self.strategy.is_rank0:
            for _ in stream:  # take part in the gathers
                pass
            return 0
        return sender.send(stream, self._bucket_bytes)

    def set_ipc_targets(self, targets: list) -> None:
        """Rank 0: the colocated engines of a CUDA-IPC sync, ``[(engine index, engine actor)]`` (each engine
        worker picks the handle made on its own GPU, by UUID: rlhforge.workers.ipc_sync)."""
        self._ipc_targets = targets

    def send_weights_ipc(self, bucket_bytes: int, fingerprint: bool = False, timeout_s: float = 300.0) -> dict:
        """All ranks: the weights by CUDA IPC to the engines on their GPUs, from this rank's own device
        (rlhforge.workers.ipc_sync); ``{"buckets", "failed": {engine index: cause}}`` (rank 0)."""
        from rlhforge.backend.device import dist_info
        from rlhforge.workers.ipc_sync import stream_ipc

        return stream_ipc(self._engine_weights(), getattr(self, "_ipc_targets", None), bucket_bytes,
                          rank=dist_info().rank, world_size=self.strategy.world_size, device=self.device,
                          fingerprint=fingerprint, timeout_s=timeout_s)

    def weights_fingerprint(self) -> str | None:
        """Fingerprint of the weights the engines load, as a sync would send them (all ranks take part;
        rank 0 returns it)."""
        for _ in self._engine_weights():
            pass
        return self.sent_fingerprint()


class RefWorker:
    """Frozen reference policy (the actor's initial weights, without LoRA), prepared like the actor
    (:class:`~rlhforge.backend.frozen.FrozenModel`): the actor's dtype mechanism, so KL is exactly 0
    before the first update; ZeRO-3 partitioned over the ref group when the actor runs ZeRO-3;
    ``--ref.offload`` keeps it in host memory between uses."""

    pass_tokens: int | None = None
    """``--train.dynamic_batch_enable``: token budget of a log-prob micro-batch (None: fixed micro-batches)."""
    image_token_id = None  # a vision-language reference's image token

    def __init__(self, cfg, tokenizer, device=None, *, model_path: str | None = None, offload: bool | None = None):
        """``model_path`` / ``offload``: another frozen model (on-policy distillation's teacher,
        :class:`rlhforge.workers.teacher.TeacherWorker`); default the actor's folder and ``--ref.offload``."""
        from rlhforge.backend.device import dist_info, resolve_device
        from rlhforge.backend.frozen import FrozenModel
        from rlhforge.config.components import LoraConfig
        from rlhforge.workers.reward import actor_strategy_kind
        from rlhforge.models.vlm import image_token_of, load_policy

        device = device if device is not None else resolve_device(cfg.train.device, dist_info().local_rank)
        ds = dataclasses.replace(cfg.ds, lora=LoraConfig(), load_in_4bit=False)
        model_cfg = dataclasses.replace(cfg.actor, gradient_checkpointing_enable=False)
        model = load_policy(model_path or cfg.actor.model_name_or_path, model_cfg, ds, device, tokenizer)
        self.image_token_id = image_token_of(tokenizer)
        self.frozen = FrozenModel(model, ds, device, kind=actor_strategy_kind(cfg),
                                  offload=cfg.ref.offload if offload is None else offload)
        self.tokenizer, self.device, self.packed = tokenizer, device, cfg.ds.packing_samples
        self.pass_tokens = cfg.token_budgets()[1]

    @torch.no_grad()
    def logprobs(self, samples, micro_batch_size: int, temperature: float) -> list[torch.Tensor]:
        def score(model, batch, chunk):
            logps = token_logprobs(model, batch, temperature, share_prefixes=True, needed=batch["loss_mask"])
            return per_sample(logps, batch, chunk)

        return self.score_samples(samples, micro_batch_size, score)

    def score_samples(self, samples, micro_batch_size: int, score) -> list:
        """``score(model, batch, chunk) -> one result per sample of chunk`` over the no-grad micro-batches
        (collated on this worker's device), results in the order of ``samples``."""
        from rlhforge.backend.device import dist_info
        from rlhforge.backend.strategy import all_reduce_tensor

        out: list = [None] * len(samples)
        world = dist_info().world_size
        groups = micro_batch_groups([len(s) for s in samples], micro_batch_size, self.pass_tokens,
                                    lambda t, op: all_reduce_tensor(t, op, world))
        with self.frozen.use() as model:
            for idx in groups:
                chunk = [samples[i] for i in idx]
                batch = to_device(collate_experience(chunk, self.tokenizer.pad_token_id, self.packed, fields=(),
                                                     image_token_id=self.image_token_id), self.device)
                for i, row in zip(idx, score(model, batch, chunk)):
                    out[i] = row
        return out

    def offload_stats(self) -> dict:
        return self.frozen.stats()

    def release_cached_memory(self) -> int:
        from rlhforge.backend.device import release_cached_memory

        return release_cached_memory(self.device)
