"""RL training of the PPO family: one loop, top to bottom.

    generate -> score -> reference/old log-probs and values -> advantages
             -> policy (and critic) update -> sync weights -> log -> eval -> checkpoint

The algorithm is a choice, not a separate trainer: ``--algo.advantage.estimator`` (gae with a
critic; reinforce, reinforce_baseline, rloo, group_norm = GRPO, dr_grpo, flash_reinforce without
one) and ``--actor.policy_loss_type`` (ppo, gspo, cispo, sapo, dppo, dro, gmpo, clip_cov, kl_cov). Per-model work lives in worker groups
(:mod:`rlhforge.distributed`: in this process, or Ray actor groups of data-parallel ranks; workers in
:mod:`rlhforge.workers.actor`); generation behind a ``GenerationEngine``; rollouts come from
an agent executor as token-level :class:`~rlhforge.agents.types.Trajectory` objects, generated when
a step asks (sync) or ahead of it by at most ``train.async_queue_size`` weight versions
(``--train.async_enable``, :mod:`rlhforge.trainers.rl.rollouts`).

One RL *step* = one rollout of ``rollout.batch_size`` prompts x ``n_samples_per_prompt`` samples,
then ``train.max_epochs`` passes over it in optimizer steps of ``train.batch_size`` samples.
Losses are normalised by global counts over each whole optimizer step (``algorithms.aggregation``).
Every request is sampled with its own seed derived from ``train.seed`` and the prompt's position
in the prompt stream, so a resumed run reproduces the straight run exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import threading
import time
from pathlib import Path

import torch

from rlhforge.agents.episode import AgentError, drop_failed_groups
from rlhforge.agents.single_turn import PromptRequest, SingleTurnExecutor
from rlhforge.algorithms import dynamic_filter, make_kl_controller
from rlhforge.backend.fingerprint import check_engine_sync
from rlhforge.backend.sync_probe import (PROBE_FALLBACK_TEXT, check_probe, compare_probe, default_probe_bound,
                                         probe_prompts)
from rlhforge.config.rl_workers import uses_ray
from rlhforge.config.batching import RLBatchPlan
from rlhforge.trainers.rl.rollouts import AsyncRollouts, RolloutBatch, SyncRollouts
from rlhforge.rollout.engine import SamplingParams
from rlhforge.workers.experience import ExperienceSample
from rlhforge.trainers.rl.checkpoints import RLCheckpointing, RLState, rl_guard
from rlhforge.trainers.rl.prompts import GroupBuffer, PromptStream, gather_groups
from rlhforge.trainers.rl.metrics import eval_metrics, version_lag
from rlhforge.trainers.rl.experience import RLExperience
from rlhforge.workers.losses import policy_loss_spec
from rlhforge.tracking.progress import Progress, progress_enabled

__all__ = ["RLTrainer", "RLState", "request_seed"]

_SEED_MOD = 2**62


def request_seed(base: int, stream_position: int, sample_index: int, salt: int = 0) -> int:
    """Sampling seed of one request: a pure function of the run seed, the prompt's position in the
    prompt stream and the sample index (so resume and batch composition do not change it)."""
    return ((base * 1_000_003 + salt) * 2_654_435_761 + stream_position * 7919 + sample_index) % _SEED_MOD


def _mean(xs) -> float:
    xs = list(xs)
    return float(sum(xs) / len(xs)) if xs else 0.0


def _std(xs) -> float:
    xs = list(xs)
    if len(xs) < 2:
        return 0.0
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


class RLTrainer(RLCheckpointing, RLExperience):  # checkpoints.py: checkpoints, resume, faults; experience.py
    def __init__(self, cfg, tokenizer, prompts, eval_prompts, plan: RLBatchPlan, *, actor, ref, critic, engine,
                 reward_source, logger, run_dir: Path, executor=None):
        self.cfg, self.tokenizer, self.plan = cfg, tokenizer, plan
        self.prompts, self.eval_prompts = prompts, eval_prompts
        self.actor, self.ref, self.critic = actor, ref, critic  # worker groups (critic/ref may be None)
        self.engine, self.logger, self.run_dir = engine, logger, Path(run_dir)
        self.executor = executor or SingleTurnExecutor(  # agents: agents/loader.py
            tokenizer, reward_source, check_tokens=cfg.train.check_tokens)
        self.state = RLState()
        self.guard = rl_guard(cfg)  # SIGTERM/SIGINT, non-finite steps, checkpoint write errors (trainers/faults.py)
        kl = cfg.algo.kl
        self.kl_ctl = make_kl_controller(kl.init_coef, kl.target, kl.horizon)
        self.stream = PromptStream(len(prompts), cfg.train.seed)
        self.rollout_buffer = GroupBuffer()  # oversampling: accepted groups not trained yet
        self.max_new_tokens = cfg.rollout.max_new_tokens or max(1, cfg.data.max_len - max(len(p.ids) for p in prompts))
        self.gamma = self._gamma()
        # kl_loss_coef is set from the KL controller at every step
        self.loss_spec = policy_loss_spec(cfg, self.max_new_tokens, self._kl_loss_coef())
        self.old_from_update = False  # this step's pi_old comes from the update's forward (make_experience)
        self._loops = threading.local()  # one asyncio loop per thread (the async generator has its own)
        self.engine_lock = threading.Lock()  # generation vs weight sync (async mode)
        self.engine_version = 0  # the weights version the engines hold (stamped on every sample)

    # ------------------------------------------------------------------------------------ setup
    def _gamma(self) -> float:
        """OpenRLHF forces gamma = 1 for the group / batch-baseline estimators (with a warning)."""
        adv = self.cfg.algo.advantage
        if adv.record.gamma_one and adv.gamma != 1.0:
            why = ("its discount is --algo.distill.discount" if adv.estimator == "on_policy_distill"
                   else "gamma is forced to 1.0 (as OpenRLHF does)")
            print(f"[rlhforge] warning: --algo.advantage.gamma {adv.gamma} is ignored with {adv.estimator}: {why}",
                  flush=True)
            return 1.0
        return adv.gamma

    def _kl_loss_coef(self) -> float:
        """beta of the KL loss term for this step: the controller's current value (0 without use_loss)."""
        return self.kl_ctl.value if (self.cfg.algo.kl.use_loss and self.ref is not None) else 0.0

    def _run(self, coro):
        loop = getattr(self._loops, "loop", None)
        if loop is None:
            loop = self._loops.loop = asyncio.new_event_loop()
        return loop.run_until_complete(coro)

    def _rollout_source(self):
        t = self.cfg.train
        if not t.async_enable:
            return SyncRollouts(self.rollout)
        return AsyncRollouts(self.rollout, queue_size=t.async_queue_size, total=self.plan.total_steps,
                             engine_lock=self.engine_lock, partial=t.partial_rollout_enable)

    def _engine_guard(self):
        """Hold the engine between generation and weight sync, unless partial rollouts interleave them."""
        if self.cfg.train.async_enable and not self.cfg.train.partial_rollout_enable:
            return self.engine_lock
        return contextlib.nullcontext()

    # ------------------------------------------------------------------------------------ the loop
    def fit(self) -> None:
        cfg, plan = self.cfg, self.plan
        self._maybe_resume()
        if cfg.ds.enable_sleep:  # states leave the device once now (each update reloads, then offloads them)
            for g in (self.critic, self.actor):
                if g is not None:
                    g.call("offload_states")
        self.sync_weights()
        bar = Progress(plan.total_steps, self.state.global_step,
                       enabled=progress_enabled(cfg.logger.progress_bar, True), desc="rl")
        if cfg.eval.steps > 0 and self.eval_prompts and self.state.global_step == 0:
            self.logger.log(0, self.evaluate())
        self.rollouts = self._rollout_source()
        self.rollouts.start(self.state.global_step, self.state.global_step)
        with self.guard:
            try:
                self._loop_steps(bar)
            finally:
                self.rollouts.close()
            self.guard.finished()
            bar.close()
            if not cfg.ckpt.disable_ds and cfg.ckpt.save_steps > 0:
                self.save_checkpoint()
            self.actor.call("save_hf", cfg.ckpt.output_dir)
            if self.critic is not None and cfg.critic.save_value_network:
                self.critic.call("save_hf", Path(cfg.ckpt.output_dir) / "critic")

    def _loop_steps(self, bar) -> None:
        cfg, plan = self.cfg, self.plan
        while self.state.global_step < plan.total_steps:
            metrics = self.step(self.rollouts.next(self.state.global_step))
            step = self.state.global_step
            if cfg.eval.steps > 0 and self.eval_prompts and (step % cfg.eval.steps == 0 or step == plan.total_steps):
                t = time.perf_counter()
                metrics.update(self.evaluate())
                metrics["timing/eval"] = time.perf_counter() - t
                self._update_best(metrics)
            if step % cfg.logger.logging_steps == 0 or step == plan.total_steps:
                metrics["perf/peak_memory_gb"] = max(self.actor.call("peak_memory_gb"))
                self.logger.log(step, {**metrics, **self.guard.metrics()})
            bar.update(1, reward=round(metrics["rollout/reward_mean"], 3))
            if (cfg.ckpt.save_steps > 0 and step % cfg.ckpt.save_steps == 0 and step < plan.total_steps
                    and not cfg.ckpt.disable_ds):
                self.save_checkpoint()
            self.guard.after_step(step, self._preempt_save)

    def step(self, batch: RolloutBatch | None = None) -> dict[str, float]:
        """One RL step on a generated batch (None: generate it now, synchronously); returns its metrics."""
        if batch is None:
            source = SyncRollouts(self.rollout)
            source.start(self.state.global_step, self.state.global_step)
            batch = source.next(self.state.global_step)
        t0 = time.perf_counter()
        trajs, metrics = batch.trajs, dict(batch.metrics)
        self.state.prompt_position, self.state.buffered_positions = batch.stream_position, list(batch.carry)
        metrics.update(version_lag(trajs, self.state.global_step))
        metrics.update({"async/staleness": float(self.state.global_step - batch.version_start),
                        "async/staleness_at_end": float(self.state.global_step - batch.version_end),
                        "async/weights_version": float(batch.version_start),
                        "timing/wait_rollout": batch.extra.get("wait_s", batch.generation_s)})
        t1 = time.perf_counter()
        kl_coef = self.kl_ctl.value  # this step's beta (reward penalty or KL loss); updated after the step
        samples, exp_metrics = self.make_experience(trajs)
        metrics.update(exp_metrics)
        t2 = time.perf_counter()
        metrics.update(self.train(samples))
        t3 = time.perf_counter()
        if "actor/kl_ref" in exp_metrics:  # as OpenRLHF: the controller moves after the step that used it
            self.kl_ctl.update(exp_metrics["actor/kl_ref"], len(samples))
        self.state.global_step += 1
        self.sync_weights()
        metrics.update(getattr(self, "sync_metrics", {}))  # the post-sync probe (sync/probe_*)
        t4 = time.perf_counter()
        tokens = sum(len(s) for s in samples)
        step_s = t4 - t0 + (0.0 if self.cfg.train.async_enable else batch.generation_s)
        metrics.update({  # OpenRLHF's timing names
            "timing/generation": batch.generation_s, "timing/make_experience": t2 - t1,
            "timing/ppo_train": t3 - t2, "timing/broadcast": t4 - t3, "timing/step_total": step_s,
            "perf/tokens_per_s": tokens / max(step_s, 1e-9), "perf/samples_per_s": len(samples) / max(step_s, 1e-9),
            "rollout/kl_coef": kl_coef,
        })
        if self.state.global_step % self.cfg.logger.logging_steps == 0:
            self._write_samples(trajs[: min(len(trajs), 8)])
        return metrics

    # ------------------------------------------------------------------------------------ generate + score
    def _requests(self, prompt_idx: list[int], positions: list[int], n: int, temperature: float, max_new: int,
                  salt: int, prompts=None) -> tuple[list[PromptRequest], list[SamplingParams]]:
        cfg = self.cfg
        prompts = self.prompts if prompts is None else prompts
        reqs, params = [], []
        for i, pos in zip(prompt_idx, positions):
            p = prompts[i]
            for j in range(n):
                reqs.append(PromptRequest(p.ids, p.label, p.datasource, p.index, j, p.raw, p.vision))
                params.append(SamplingParams(max_new_tokens=max_new, temperature=temperature, top_p=cfg.rollout.top_p,
                                             top_k=cfg.rollout.top_k, seed=request_seed(cfg.train.seed, pos, j, salt)))
        return reqs, params

    def rollout(self):
        """Generate and score ``rollout.batch_size`` prompt groups (refilling past dynamic filtering).
        Returns ``(trajectories, metrics, prompt-stream position after them, stream positions of the
        groups still buffered)``; runs in the trainer's
        thread (sync) or in the generator thread (async), which then owns the prompt stream."""
        cfg = self.cfg
        n, need = cfg.rollout.n_samples_per_prompt, cfg.rollout.batch_size
        dropped: dict[str, float] = {}

        def generate(idx: list[int], positions: list[int]) -> list:
            reqs, params = self._requests(idx, positions, n, cfg.rollout.temperature, self.max_new_tokens, salt=0)
            version = self.engine_version
            trajs = self._run(self.executor.execute_batch(reqs, params, self.engine))
            for t in trajs:  # the weights version that generated each sample (docs/reliability.md)
                t.policy_version, t.policy_version_end = version, self.engine_version
            groups = []
            for g in range(len(positions)):  # failed environments / registry filters drop their group
                group, counts = drop_failed_groups(trajs[g * n : (g + 1) * n], n)
                for k, v in counts.items():
                    dropped[k] = dropped.get(k, 0.0) + v
                groups.append(group or None)
            return groups

        def accept(group) -> bool:
            lo, hi = cfg.algo.dynamic_filtering_range
            return bool(dynamic_filter(torch.tensor([t.score for t in group]), n, lo, hi)[0])

        self._wake_engine()  # oversampling buffer and its resume accounting: trainers/rl/prompts.py
        reward_s = getattr(self.executor, "reward_seconds", None)  # executors that time their reward calls
        got = gather_groups(self.stream, self.rollout_buffer, need=need, round_size=cfg.rollout.vllm_generate_batch_size,
                            generate=generate, accept=accept if cfg.algo.dynamic_filtering_enable else None,
                            max_refills=cfg.algo.max_filter_refills)
        self.engine.sleep()
        kept, rounds, generated_groups, passed_groups = got.groups, got.rounds, got.generated_groups, got.passed_groups
        all_trajs = got.generated or [t for g in kept for t in g]  # metrics: what this step generated
        if not kept and not all_trajs:
            raise AgentError(f"every prompt group of this step was dropped ({dropped}); see the messages above")
        if not kept:
            raise RuntimeError(
                f"dynamic filtering kept no prompt group in {rounds} rounds ({generated_groups} groups): every group's "
                f"mean score is outside {cfg.algo.dynamic_filtering_range}; raise algo.max_filter_refills or disable it"
            )
        trajs = [t for g in kept for t in g]
        rewards = [t.reward for t in all_trajs]
        scores = [t.score for t in all_trajs]
        metrics = {
            "rollout/reward_mean": _mean(rewards), "rollout/reward_std": _std(rewards),
            "rollout/score_mean": _mean(scores),
            "rollout/response_length": _mean(t.response_length for t in all_trajs),
            "rollout/response_length_max": float(max(t.response_length for t in all_trajs)),
            "rollout/truncated_frac": _mean(float(t.truncated) for t in all_trajs),
            "rollout/filter_pass_rate": passed_groups / max(generated_groups, 1),
            "rollout/generation_rounds": float(rounds),
            "rollout/prompts_consumed": float(got.new_prompts), "rollout/groups_from_buffer": float(got.from_buffer),
            "rollout/buffered_groups": float(len(self.rollout_buffer.groups)),
            "rollout/samples": float(len(trajs)),
            **{f"rollout/{k}": v for k, v in dropped.items()},
        }
        if n > 1:
            metrics["rollout/group_reward_std"] = _mean(
                _std(t.reward for t in all_trajs[g * n : (g + 1) * n]) for g in range(len(all_trajs) // n))
        # reward extra_logs / agent metrics: the mean over *every* sample of the rollout, a sample without
        # the key counting as 0 (OpenRLHF's average over the whole batch)
        for key in sorted({k for t in all_trajs for k in t.extra}):
            metrics[f"rollout/{key}"] = _mean(float(t.extra.get(key, 0.0)) for t in all_trajs)
        metrics.update(getattr(self.engine, "step_metrics", dict)())  # engine actors: restarts, requests each
        if reward_s is not None:  # the part of timing/generation spent scoring
            metrics["timing/reward"] = self.executor.reward_seconds - reward_s
        return trajs, metrics, self.stream.position, self.rollout_buffer.positions()

    # ------------------------------------------------------------------------------------ experience
    # shaped_rewards, make_experience: RLExperience (trainers/rl/experience.py)

    # ------------------------------------------------------------------------------------ update
    def train(self, samples: list[ExperienceSample]) -> dict[str, float]:
        cfg = self.cfg
        bs = cfg.train.batch_size
        actor_frozen = self.critic is not None and self.state.global_step < cfg.critic.freezing_steps
        sums: dict[str, list[float]] = {}
        spec = dataclasses.replace(self.loss_spec, kl_loss_coef=self._kl_loss_coef(),  # this step's beta
                                   old_from_this_forward=self.old_from_update)
        sleep = cfg.ds.enable_sleep
        models = [g for g in (self.critic, self.actor) if g is not None]
        if sleep:
            for g in models:
                g.call("reload_states")
        for epoch in range(cfg.train.max_epochs):
            g = torch.Generator().manual_seed(request_seed(cfg.train.seed, self.state.global_step, epoch, salt=99))
            order = torch.randperm(len(samples), generator=g).tolist()
            for start in range(0, len(order), bs):
                chunk = [samples[i] for i in order[start : start + bs]]
                if self.critic is not None:
                    self._add_update(sums, "critic", self.critic.map_train("train_step", chunk, cfg.critic.value_clip),
                                     chunk)
                if not actor_frozen:
                    self._add_update(sums, "actor", self.actor.map_train("train_step", chunk, spec), chunk)
        if sleep:
            for g in models:
                g.call("offload_states")
        out = {k: _mean(v) for k, v in sums.items()}
        for name in ("logprob_diff_rollout_vs_train", "vllm_kl"):  # measured in the update (old_from_update)
            if f"actor/{name}" in out:
                out[f"rollout/{name}"] = out.pop(f"actor/{name}")
        out["actor/frozen"] = float(actor_frozen)
        return out

    def _wake_engine(self) -> None:
        """Wake the engines; with vLLM's sleep mode, every model group first hands its cached, unused device
        memory back: a waking engine re-maps the KV cache it allocated at start-up, at its start-up size, into
        what the GPU has free (the start-up check in distributed/plan_report.py makes that size fit beside the
        models; the released cache is what the models' allocators would otherwise still hold)."""
        self._release_model_caches()
        self.engine.wake_up()

    def _release_model_caches(self) -> None:
        """With vLLM's sleep mode (engines sharing GPUs with the models), every model group hands its cached,
        unused device memory back before an engine maps memory: its KV cache (:meth:`_wake_engine`) or its
        weights (a sync, :meth:`sync_weights`)."""
        if self.cfg.vllm.enable_sleep:
            for g in (self.actor, self.critic, self.ref, getattr(self, "reward_group", None), self.teacher):
                if g is not None:
                    g.call("release_cached_memory")

    def sync_weights(self) -> None:
        """Gather the actor's full weights (all ranks take part; rank 0 returns them) and load them into
        the engines; check that they arrived (fingerprints) and are in effect (the probe:
        :meth:`_check_probe`); then tell the rollout source which weights version the engines hold. An HF
        engine that generates with the actor's own module (``--rollout.hf_engine_weights auto``) has nothing
        to load or check."""
        if getattr(self.engine, "shared", False):
            self.sync_metrics = {}
        else:
            sync_from = getattr(self.engine, "sync_from", None)  # engine actors: straight from actor rank 0
            state = None if sync_from else self.actor.gather_weights()
            with self._engine_guard():
                self._release_model_caches()  # before the engines' weights wake (sleep mode)
                if sync_from:
                    sync_from(self.actor)  # verifies every engine's fingerprint itself
                else:
                    self.engine.update_weights(state)
                    check_engine_sync(self.engine, self.actor.call("sent_fingerprint")[0], self.state.global_step)
                self._check_probe()
        self.engine_version = self.state.global_step
        rollouts = getattr(self, "rollouts", None)
        if rollouts is not None:
            rollouts.synced(self.state.global_step)

    # ------------------------------------------------------------------------------------ post-sync probe
    def _probe(self) -> tuple[list[list[int]], list[ExperienceSample]]:
        """The run's fixed probe (backend.sync_probe.probe_prompts): its token ids and, for the actor's
        log-prob pass, the same sequences as experience samples (every token after the first scored)."""
        probe = getattr(self, "_probe_cache", None)
        if probe is None:
            text_only = (p.ids for p in self.prompts if getattr(p, "vision", None) is None)
            tok = getattr(self.tokenizer, "tokenizer", self.tokenizer)  # a VLM's processor holds its tokenizer
            ids = probe_prompts(text_only, self.cfg.train.sync_probe_tokens,
                                fallback=lambda: tok.encode(PROBE_FALLBACK_TEXT))
            probe = self._probe_cache = (ids, [ExperienceSample(list(p), [0] + [1] * (len(p) - 1), 0.0, 0.0)
                                               for p in ids])
        return probe

    def _probe_bound(self) -> float:
        """``--train.sync_probe_bound``, else the default of the run's precision (engines follow the trainer's
        ``--ds.param_dtype``; ``auto`` is fp32 only where the models surely run on CPU)."""
        t = self.cfg.train
        if t.sync_probe_bound is not None:
            return float(t.sync_probe_bound)
        prec = self.cfg.ds.param_dtype
        if prec == "auto":
            on_cpu = t.device == "cpu" or (not uses_ray(self.cfg) and not torch.cuda.is_available())
            prec = "fp32" if on_cpu else "bf16"
        return default_probe_bound(prec, prec)

    def _check_probe(self) -> None:
        """After a sync: every engine scores the probe, the actor scores it through its old-log-prob pass, and
        an engine whose mean absolute difference exceeds the bound stops the run (WeightsNotInEffect, exit 4)
        naming it and the sync. Sets ``sync_metrics`` (``sync/probe_logprob_diff`` and ``_max``: the largest over
        engines; ``sync/probe_policy_change``: how far the actor's own probe log-probs moved since the previous
        sync, i.e. what an engine that kept the old weights would show). Engines without ``probe_logprobs``
        (test doubles, a user's engine) are not checked."""
        score = getattr(self.engine, "probe_logprobs", None)
        if score is None:
            self.sync_metrics = {}
            return
        t0 = time.perf_counter()
        ids, samples = self._probe()
        if self.cfg.vllm.enable_sleep:  # scoring needs the KV cache: wake it, and sleep again after
            self._wake_engine()
        try:
            engines = score(ids)
        finally:
            if self.cfg.vllm.enable_sleep:
                self.engine.sleep()
        if not engines:  # a router over engines that cannot score
            self.sync_metrics = {}
            return
        rows = self.actor.map_gather("logprobs", samples, self.cfg.rollout.micro_batch_size, 1.0)
        trainer = [r[1:].tolist() for r in rows]
        stats = compare_probe(trainer, engines)
        metrics = {"sync/probe_logprob_diff": max(m for m, _ in stats.values()),
                   "sync/probe_logprob_diff_max": max(x for _, x in stats.values())}
        previous = getattr(self, "_probe_previous", None)
        if previous is not None:
            metrics["sync/probe_policy_change"] = compare_probe(previous, [("", trainer)])[""][0]
        self._probe_previous = trainer
        metrics["timing/sync_probe"] = time.perf_counter() - t0
        self.sync_metrics = metrics
        check_probe(stats, self._probe_bound(), self.state.global_step)

    # ------------------------------------------------------------------------------------ eval
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        cfg = self.cfg
        n = cfg.eval.n_samples_per_prompt
        max_new = cfg.eval.max_new_tokens or self.max_new_tokens
        idx = list(range(len(self.eval_prompts)))
        reqs, params = self._requests(idx, idx, n, cfg.eval.temperature, max_new, salt=7, prompts=self.eval_prompts)
        with self._engine_guard():
            self._wake_engine()
            trajs = self._run(self.executor.execute_batch(reqs, params, self.engine))
            self.engine.sleep()
        trajs, _ = drop_failed_groups(trajs, n)
        return eval_metrics(trajs, n)

    def _update_best(self, metrics: dict[str, float]) -> None:
        key = self.cfg.ckpt.best_metric_key or "eval/pass1"
        if key == "none" or key not in metrics:
            return
        value = float(metrics[key])
        if self.state.best_metric is None or value > self.state.best_metric:
            self.state.best_metric, self.state.best_step = value, self.state.global_step
            metrics["eval/best"] = value
            if not self.cfg.ckpt.disable_ds and self.cfg.ckpt.save_steps > 0:
                self.save_checkpoint()

    # ------------------------------------------------------------------------------------ samples table
    def _write_samples(self, trajs) -> None:
        path = self.run_dir / "samples.jsonl"
        tok = self.tokenizer
        with open(path, "a") as f:
            for t in trajs:
                f.write(json.dumps({
                    "step": self.state.global_step,
                    "prompt": tok.decode(t.prompt_ids, skip_special_tokens=False),
                    "response": tok.decode(t.response_ids, skip_special_tokens=False),
                    "label": t.label if isinstance(t.label, (str, int, float, type(None))) else str(t.label),
                    "reward": t.reward, "score": t.score, "finish_reason": t.finish_reason,
                }) + "\n")
