"""vLLM engines as Ray actors (``--vllm.num_engines N`` with Ray workers; docs/distributed.md).

Each engine is one Ray actor (:class:`EngineHost`) that owns one vLLM engine on its own bundles
(``--vllm.tensor_parallel_size`` of them; or a share of the actor's bundles with
``--train.colocate_all``, OpenRLHF's hybrid engine). The driver sees them through one
``GenerationEngine`` (:class:`EngineActors`):

- **generate**: requests are split by prompt group over the live engines (least outstanding work
  first, as :class:`~rlhforge.rollout.vllm_engine.EngineRouter`) and run on all of them at once;
  each actor runs its own engine loop.
- **weight sync** (:meth:`EngineActors.sync_from`): actor rank 0 streams the weights to every
  engine worker over a dedicated group (:mod:`rlhforge.backend.collective`; gloo on CPU engines,
  ``--vllm.sync_backend`` on GPU engines); GPU engines that share the actor's GPUs
  (``--train.colocate_all``) get CUDA IPC handles from the rank on their GPU instead
  (:mod:`rlhforge.workers.ipc_sync`); with ``--vllm.sync_with_ray``, rank 0's state dict goes
  through Ray's object store straight into the engines' calls. Nothing passes through the driver's
  memory in any of them.
- **faults**: an engine whose actor died, or whose call did not answer within
  ``--vllm.request_timeout_s``, is killed and restarted on the same bundles (at most
  ``--vllm.max_restarts`` times per engine), loaded with the current weights, and its requests are
  sent again; until it is back, the other engines serve. Every weight-sync collective and engine
  RPC has one deadline, ``--vllm.sync_timeout_s``: an engine that dies or hangs during a sync is
  restarted the same way, every other engine reloads the current weights through the object store,
  and the sync group is rebuilt at the next sync (actor rank 0's side of the broken collective
  returns by the same deadline: every wait of a sync broadcast has it, backend.collective.SyncGroup).
  Restarts count in ``rollout/engine_restarts``. With no engine left the run stops (WorkerError, exit 4) naming each
  engine and its cause.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Callable, Sequence

from rlhforge.distributed.groups import WorkerError
from rlhforge.workers.ipc_sync import cause_line, engine_fault
from rlhforge.distributed.ray_group import bundle_index
from rlhforge.rollout.engine import GenerationOutput, params_per_prompt
from rlhforge.rollout.vllm_engine import EngineRouter, vllm_dtype
from rlhforge.rollout.vllm_memory import engine_kv_cache_bytes

__all__ = ["EngineHost", "EngineActors", "build_engine_actors"]


class EngineHost:
    """The Ray actor around one :class:`~rlhforge.rollout.vllm_engine.VLLMEngine` (in this process)."""

    def __init__(self, env: dict[str, str], model_path: str, kwargs: dict):
        import ray

        from rlhforge.distributed.ray_group import device_env_for

        os.environ.update(env)
        # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: vLLM in this process takes cuda:0, so narrow the devices
        os.environ.update(device_env_for(os.environ, ray.get_gpu_ids(), engine=True))
        from rlhforge.rollout.vllm_engine import VLLMEngine

        self.engine = VLLMEngine(model_path, **kwargs)
        self.served = 0

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def generate(self, prompts: list, params: list, vision: list | None = None) -> list[GenerationOutput]:
        out = self.engine.generate_sync(prompts, params, vision)
        self.served += len(prompts)
        return out

    def join_sync_group(self, host: str, port: int, rank_base: int, world_size: int, backend: str,
                        timeout_s: float) -> list[int]:
        return self.engine.join_sync_group(host, port, rank_base, world_size, backend, timeout_s)

    def receive_weights(self, fingerprint: bool = False) -> str | None:
        return self.engine.receive_weights(fingerprint)

    def load_state(self, state: dict, fingerprint: bool = False) -> str | None:
        """``--vllm.sync_with_ray`` (and restarts): ``state`` arrives through the object store."""
        self.engine.update_weights(state, fingerprint=fingerprint)
        return self.engine.fingerprint()

    def fingerprint(self) -> str | None:
        return self.engine.fingerprint()

    def sync_report(self) -> list:
        return self.engine.sync_report()

    def load_ipc(self, entries: list, handles_by_gpu: dict, fingerprint: bool = False, last: bool = False) -> int:
        return self.engine.load_ipc(entries, handles_by_gpu, fingerprint, last)

    def probe_logprobs(self, prompts: list) -> list:
        """The post-sync probe scored by this engine (rlhforge.backend.sync_probe)."""
        return self.engine.probe_logprobs(prompts)[0][1]

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    def close(self) -> None:
        self.engine.close()


class _Engine:
    """The driver's record of one engine actor."""

    def __init__(self, index: int, handle, tp: int):
        self.index, self.handle, self.tp = index, handle, tp
        self.load = 0.0  # outstanding work (prompt + max new tokens) for the router
        self.alive = True
        self.restarts = 0
        self.requests = 0
        self.failure = ""


class EngineActors:
    """A ``GenerationEngine`` over N engine actors; ``spawn(i)`` creates (or re-creates) engine i's actor."""

    def __init__(self, spawn: Callable[[int], Any], num_engines: int, *, tp: int = 1, backend: str = "gloo",
                 bucket_bytes: int = 128 << 20, sync_with_ray: bool = False, max_restarts: int = 1,
                 timeout_s: float = 600.0, sync_timeout_s: float = 300.0, ipc: bool = False,
                 start_timeout_s: float | None = None, enable_sleep: bool = False):
        self.spawn, self.tp, self.backend, self.bucket_bytes = spawn, tp, backend, bucket_bytes
        self.sync_with_ray, self.max_restarts, self.timeout_s = sync_with_ray, max_restarts, timeout_s
        self.sync_timeout_s = sync_timeout_s  # --vllm.sync_timeout_s: every sync collective and engine RPC
        # an engine's start-up (vLLM loads the model): --deadline.startup_s
        self.start_timeout_s = start_timeout_s or max(timeout_s, sync_timeout_s)
        self.ipc = ipc  # GPU engines on the actor's GPUs: CUDA IPC, each worker takes its own GPU's handle
        self.enable_sleep = enable_sleep  # --vllm.enable_sleep: a restarted engine goes back to sleep if the rest are
        self.asleep = False
        self._ipc_members: tuple | None = None
        self.engines = [_Engine(i, spawn(i), tp) for i in range(num_engines)]
        self._group_members: tuple | None = None  # (handles...) of the current sync group
        self._source = None  # the actor group of the last sync (restarts reload from it)
        self.synced_versions = 0
        self.fingerprint_syncs = True  # every sync returns the engines' fingerprints (always on)
        self.last_fingerprints: list[str | None] = []
        self.restarts_total = 0
        self.ready()

    # -- start-up ---------------------------------------------------------------------------------
    def ready(self) -> "EngineActors":
        import ray

        for e in self.engines:
            try:
                ray.get(e.handle.pid.remote(), timeout=self.start_timeout_s)
            except Exception as err:  # noqa: BLE001
                raise WorkerError(f"vLLM engine {e.index} failed to start: {cause_line(err)}") from None
        nodes = ray.get([e.handle.node_id.remote() for e in self.engines], timeout=self.start_timeout_s)
        print("[rlhforge] engine placement: " + "; ".join(f"engine {e.index} on node {n[:8]}"
                                                         for e, n in zip(self.engines, nodes)))
        return self

    # -- GenerationEngine ---------------------------------------------------------------------------
    async def generate(self, prompts: Sequence[Sequence[int]], params, vision: Sequence | None = None
                       ) -> list[GenerationOutput]:
        """``vision``: a VisionInput or None per prompt (a vision-language model; each goes with its prompt)."""
        params = params_per_prompt(prompts, params, vision)
        out: list[GenerationOutput | None] = [None] * len(prompts)
        pending = list(range(len(prompts)))
        while pending:
            live = [e for e in self.engines if e.alive]
            if not live:
                causes = "; ".join(f"engine {e.index}: {e.failure}" for e in self.engines)
                raise WorkerError(f"no vLLM engine is left ({causes}); --vllm.max_restarts {self.max_restarts} "
                                  "restart(s) per engine were used; checkpoints already written are intact")
            where = EngineRouter(live).assign([prompts[i] for i in pending], [params[i] for i in pending])
            jobs = []
            for j, e in enumerate(live):
                idx = [pending[k] for k, w in enumerate(where) if w == j]
                if idx:
                    sub = None if vision is None else [vision[i] for i in idx]
                    jobs.append((e, idx, self._call(e, [list(prompts[i]) for i in idx], [params[i] for i in idx],
                                                    sub)))
            results = await asyncio.gather(*(job for _, _, job in jobs), return_exceptions=True)
            pending = []
            for (e, idx, _), res in zip(jobs, results):
                if isinstance(res, BaseException):
                    if not engine_fault(res):
                        raise res
                    await asyncio.to_thread(self._fail, e, cause_line(res))
                    pending.extend(idx)
                    continue
                e.requests += len(idx)
                for i, o in zip(idx, res):
                    out[i] = o
            pending.sort()
        return out  # type: ignore[return-value]

    async def _call(self, e: _Engine, prompts: list, params: list, vision: list | None = None):
        work = sum(len(p) + sp.max_new_tokens for p, sp in zip(prompts, params))
        e.load += work
        try:
            ref = e.handle.generate.remote(prompts, params, vision)
            try:
                return await asyncio.wait_for(asyncio.wrap_future(ref.future()), self.timeout_s)
            except asyncio.TimeoutError:
                raise TimeoutError(f"no answer within --vllm.request_timeout_s {self.timeout_s:g} s") from None
        finally:
            e.load -= work

    def update_weights(self, named_tensors) -> None:
        """Tensors in the driver (an in-process caller): through the object store to every engine."""
        import ray

        ref = ray.put(dict(named_tensors))
        self._wait([(e, e.handle.load_state.remote(ref)) for e in self.engines if e.alive], "update_weights")

    def sleep(self) -> None:
        self._broadcast("sleep")
        self.asleep = True

    def wake_up(self) -> None:
        self._broadcast("wake_up")
        self.asleep = False

    def close(self) -> None:
        import ray

        for e in self.engines:
            try:
                ray.get(e.handle.close.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - already gone
                pass
            try:
                ray.kill(e.handle)
            except Exception:  # noqa: BLE001
                pass

    # -- weight sync ---------------------------------------------------------------------------------
    def sync_from(self, actor) -> None:
        """Load actor rank 0's current weights into every live engine (``actor``: a RayWorkerGroup). An
        engine that dies or hangs meanwhile is restarted (``--vllm.max_restarts``) and every engine gets
        the current weights through the object store; the sync group is rebuilt at the next sync."""
        self._source = actor
        live = [e for e in self.engines if e.alive]
        try:
            self.last_fingerprints = self._sync(actor, live, self.fingerprint_syncs)
        except _SyncFault as fault:
            self._recover(actor, fault.failed)
        self.synced_versions += 1
        self.verify(actor)

    def verify(self, actor) -> None:
        """Every live engine reports what its last sync loaded; it must be what actor rank 0 sent, and an
        engine that received new weights must have changed its parameters (rlhforge.backend.fingerprint;
        always on: a mismatch stops the run with WeightSyncMismatch naming the engine)."""
        from rlhforge.backend.fingerprint import check_sync_reports

        expected = actor.wait([actor.hosts[0].run.remote("sent_fingerprint", (), {})], "sent_fingerprint")[0]
        live = [e for e in self.engines if e.alive]
        reports = self._wait([(e, e.handle.sync_report.remote()) for e in live], "the engines' sync reports")
        check_sync_reports(expected, [(f"vLLM engine {e.index}", r) for e, r in zip(live, reports)],
                           self.synced_versions)

    def probe_logprobs(self, prompts) -> list[tuple[str, list[list[float]]]]:
        """Every live engine's scoring of the post-sync probe (rlhforge.backend.sync_probe), named as in
        :meth:`verify`; within ``--vllm.sync_timeout_s``."""
        live = [e for e in self.engines if e.alive]
        rows = self._wait([(e, e.handle.probe_logprobs.remote([list(p) for p in prompts])) for e in live],
                          "the post-sync probe")
        return [(f"vLLM engine {e.index}", r) for e, r in zip(live, rows)]

    def _sync(self, actor, live: list[_Engine], fp: bool) -> list:
        actor_side = None  # the actor ranks' calls of the same transfer, waited on with the engines'
        if self.sync_with_ray:
            refs = actor.submit("engine_state_dict")  # every rank gathers; rank 0's result is the state
            pairs = [(e, e.handle.load_state.remote(refs[0], fp)) for e in live]
            actor_side = (actor, refs)
        elif self.ipc:
            if self._ipc_members != tuple(e.handle for e in live):
                targets = [(e.index, e.handle) for e in live]
                actor.wait([actor.hosts[0].run.remote("set_ipc_targets", (targets,), {})], "set_ipc_targets")
                self._ipc_members = tuple(e.handle for e in live)
            sent = actor.wait(actor.submit("send_weights_ipc", self.bucket_bytes, fp, self.sync_timeout_s),
                              "send_weights_ipc")[0]  # rank 0 waits on each engine with the deadline
            failed = {e: sent["failed"][e.index] for e in live if e.index in sent["failed"]}
            if failed:
                raise _SyncFault(failed)
            pairs = [(e, e.handle.fingerprint.remote()) for e in live]
        else:
            if self._group_members != tuple(e.handle for e in live):
                self._open_group(actor, live)
            sends = actor.submit("send_weights")
            pairs = [(e, e.handle.receive_weights.remote(fp)) for e in live]
            actor_side = (actor, sends)
        return self._wait(pairs, "weight sync", actor=actor_side, recover=True)

    def _recover(self, actor, failed: dict) -> None:
        """After a sync that engines broke (``failed``: engine -> cause, ``None`` cause: only caught in the
        broken collective): restart the dead or hung ones, reload every live engine from the object store."""
        self._group_members = self._ipc_members = None  # rebuilt at the next sync
        for e, cause in failed.items():
            if cause is not None and e.alive:
                self._fail(e, f"{cause} (during a weight sync)", load=False)
        live = [e for e in self.engines if e.alive]
        refs = actor.submit("engine_state_dict")
        pairs = [(e, e.handle.load_state.remote(refs[0], self.fingerprint_syncs)) for e in live]
        self.last_fingerprints = self._wait(pairs, "reloading the engines after a failed weight sync",
                                            actor=(actor, refs))
        print(f"[rlhforge] weight sync: {len(live)} engine(s) reloaded with the current weights after "
              f"{sum(c is not None for c in failed.values())} engine failure(s)", flush=True)

    def _open_group(self, actor, live: list[_Engine]) -> None:
        host, port = actor.rank0_address()
        world = 1 + sum(e.tp for e in live)
        send = actor.hosts[0].run.remote("open_weight_channel",
                                         (host, port, world, self.bucket_bytes, self.backend, self.sync_timeout_s), {})
        joins, base = [], 1
        for e in live:
            joins.append((e, e.handle.join_sync_group.remote(host, port, base, world, self.backend, self.sync_timeout_s)))
            base += e.tp
        self._wait(joins, "joining the weight-sync group", actor=(actor, [send]), recover=True)
        self._group_members = tuple(e.handle for e in live)

    # -- faults ----------------------------------------------------------------------------------------
    def _fail(self, e: _Engine, cause: str, load: bool = True) -> None:
        """Engine ``e`` died or hung: restart it (within the limit) with the current weights (``load``), or
        drop it."""
        import ray

        print(f"[rlhforge] vLLM engine {e.index} failed: {cause}", flush=True)
        try:
            ray.kill(e.handle)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self._group_members = None  # the sync group had it as a member: rebuilt at the next sync
        e.failure = cause
        if e.restarts >= self.max_restarts:
            e.alive = False
            print(f"[rlhforge] vLLM engine {e.index}: no restart left (--vllm.max_restarts {self.max_restarts}); "
                  "the other engines serve its requests", flush=True)
            return
        e.restarts += 1
        self.restarts_total += 1
        t0 = time.perf_counter()
        try:
            e.handle = self.spawn(e.index)
            ray.get(e.handle.pid.remote(), timeout=self.start_timeout_s)
            if load and self._source is not None and self.synced_versions:  # else it loaded the initial weights itself
                refs = self._source.submit("engine_state_dict")
                ray.get(e.handle.load_state.remote(refs[0], self.fingerprint_syncs), timeout=self.sync_timeout_s)
                self._source.wait(refs, "engine_state_dict")
            if self.enable_sleep and self.asleep:  # the models train beside it: it must not hold its KV cache
                ray.get(e.handle.sleep.remote(), timeout=self.sync_timeout_s)
        except Exception as err:  # noqa: BLE001
            e.alive, e.failure = False, f"{cause}; its restart failed too: {cause_line(err)}"
            print(f"[rlhforge] vLLM engine {e.index}: restart failed: {cause_line(err)}", flush=True)
            return
        print(f"[rlhforge] vLLM engine {e.index} restarted ({e.restarts}/{self.max_restarts}) in "
              f"{time.perf_counter() - t0:.1f} s with the current weights", flush=True)

    def step_metrics(self) -> dict[str, float]:
        """``rollout/engine_restarts`` (so far) and the requests each engine served since the last call."""
        out = {"rollout/engine_restarts": float(self.restarts_total),
               "rollout/engines_alive": float(sum(e.alive for e in self.engines))}
        for e in self.engines:
            out[f"rollout/engine{e.index}_requests"] = float(e.requests)
            e.requests = 0
        return out

    # -- helpers ---------------------------------------------------------------------------------------
    def _broadcast(self, method: str) -> None:
        self._wait([(e, getattr(e.handle, method).remote()) for e in self.engines if e.alive], method)

    def _wait(self, pairs: list, what: str, actor=None, recover: bool = False) -> list:
        """Results of engine calls (and, with ``actor=(group, refs)``, of the actor ranks' side of the same
        collective), within ``sync_timeout_s``. Without ``recover`` the first failure is raised naming its
        side. With it (a sync), an engine that died or hung makes the wait go on until every side has
        left the broken collective (each of its waits has the same deadline), then :class:`_SyncFault`
        lists the engines to restart and reload; anything else is raised."""
        import ray

        actor_refs = list(actor[1]) if actor else []
        refs = [r for _, r in pairs] + actor_refs
        deadline = time.monotonic() + self.sync_timeout_s
        failed: dict = {}  # engine -> cause (None: an error caught from the broken collective)
        other: list = []  # (owner, error) not caused by a dead engine, so far
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            for ref in done:
                try:
                    ray.get(ref)
                except Exception as err:  # noqa: BLE001
                    e = next((e for e, r in pairs if r == ref), None)
                    if not recover:
                        if e is None and actor:
                            actor[0].wait(actor[1], what)  # names the rank
                        raise WorkerError(f"{'actor rank 0' if e is None else f'vLLM engine {e.index}'} failed in "
                                          f"{what}: {cause_line(err)}") from None
                    if e is not None and engine_fault(err):
                        if not failed or all(c is None for c in failed.values()):  # the first death: from now
                            deadline = max(deadline, time.monotonic() + self.sync_timeout_s + 5)
                        failed[e] = cause_line(err)
                    elif e is not None:
                        failed.setdefault(e, None)
                        other.append((f"vLLM engine {e.index}", err))
                    else:
                        other.append(("actor rank 0", err))
            if pending and time.monotonic() > deadline:
                hung = [e for e, r in pairs if r in pending]
                if not recover or any(r in pending for r in actor_refs):
                    raise WorkerError(f"{what}: no answer within --vllm.sync_timeout_s {self.sync_timeout_s:g} s "
                                      f"from {', '.join(f'vLLM engine {e.index}' for e in hung) or 'actor rank 0'}")
                for e in hung:  # stuck past the deadline: killed and restarted
                    failed[e] = f"TimeoutError: no answer within --vllm.sync_timeout_s {self.sync_timeout_s:g} s"
                break
        if any(c is not None for c in failed.values()):
            raise _SyncFault(failed)
        if other:
            owner, err = other[0]
            if owner == "actor rank 0" and actor:
                actor[0].wait(actor[1], what)  # names the rank
            raise WorkerError(f"{owner} failed in {what}: {cause_line(err)}")
        return [ray.get(r) for _, r in pairs]


class _SyncFault(Exception):
    """Engines died or hung during a sync: ``failed`` = {engine: cause, or None for one that only saw the
    broken collective}."""

    def __init__(self, failed: dict):
        super().__init__(", ".join(f"engine {e.index}: {c}" for e, c in failed.items()))
        self.failed = failed


def build_engine_actors(cfg, tokenizer, max_model_len: int, placement, pgs: dict) -> EngineActors:
    """The engine actors of ``--vllm.*`` on the bundles ``placement.engines`` assigns (pgs: key -> group)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    v = cfg.vllm
    cpu = placement.device != "cuda"
    dtype = vllm_dtype(cfg.ds.param_dtype, cpu=cpu)
    env = {"RLHFORGE_RAY_WORKER": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    kv_cache_bytes = engine_kv_cache_bytes(cfg, dtype, max_model_len) if cpu else None  # (VLLMEngine sets the env)
    remote = ray.remote(EngineHost)
    backend = "gloo" if cpu else v.sync_backend

    def spawn(i: int):
        ep = placement.engines[i]
        kwargs = dict(eos_token_id=tokenizer.eos_token_id, dtype=dtype, max_model_len=max_model_len,
                      seed=cfg.train.seed + i, tensor_parallel_size=v.tensor_parallel_size,
                      gpu_memory_utilization=v.gpu_memory_utilization, enable_prefix_caching=v.enable_prefix_caching,
                      enforce_eager=v.enforce_eager, enable_sleep=v.enable_sleep, bucket_mb=v.sync_bucket_mb,
                      in_process=cpu or v.tensor_parallel_size == 1, record_routing=cfg.train.routing_replay,
                      kv_cache_bytes=kv_cache_bytes)
        engine_env = dict(env)
        one_device = v.tensor_parallel_size == 1
        pg = pgs[ep.pg]
        bundles = [bundle_index(pg, b) for b in ep.bundle_indices]  # node-ordered: a TP engine stays on one node
        if not one_device:  # vLLM's Ray executor places its TP workers on the bundles named here
            kwargs["distributed_executor_backend"] = "ray"
            engine_env["VLLM_RAY_PER_WORKER_GPUS"] = str(ep.share)
            engine_env["VLLM_RAY_BUNDLE_INDICES"] = ",".join(str(b) for b in bundles)
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundles[0],
                                                    placement_group_capture_child_tasks=True)
        opts = {"num_cpus": ep.share if cpu else 0, "num_gpus": ep.share if (not cpu and one_device) else 0,
                "scheduling_strategy": strategy, "max_restarts": 0, "max_concurrency": 4}
        return remote.options(**opts).remote(engine_env, cfg.actor.model_name_or_path, kwargs)

    actor_pg = placement.groups["actor"].pg
    colocated = not cpu and all(ep.pg == actor_pg for ep in placement.engines)  # NCCL: one member per GPU
    return EngineActors(spawn, v.num_engines, tp=v.tensor_parallel_size, backend=backend,
                        bucket_bytes=v.sync_bucket_mb << 20, sync_with_ray=v.sync_with_ray,
                        max_restarts=v.max_restarts, timeout_s=v.request_timeout_s,
                        sync_timeout_s=v.sync_timeout_s, ipc=colocated, start_timeout_s=cfg.deadline.startup_s,
                        enable_sleep=v.enable_sleep)
