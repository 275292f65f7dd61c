"""Ray worker groups: the data-parallel ranks of one model as Ray actors.

:class:`RayWorkerGroup` starts ``num_workers`` actors (:class:`WorkerHost`) on the bundles of a
placement group, gives them ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` (rank 0 picks
the address on its own node), and builds the same worker class the in-process path uses
(:class:`~rlhforge.workers.actor.ActorWorker` ...) inside each one. The worker's strategy then
opens the model's process group itself (gloo on CPU, nccl on GPU; DeepSpeed's ``init_distributed``
or ``torch.distributed``), so DeepSpeed ZeRO runs inside the actors exactly as under torchrun.

Calls shard their samples with :func:`~rlhforge.distributed.groups.balanced_shards` (equal counts,
balanced tokens), send each shard once through the object store, and gather the results in input
order. A worker that dies or raises becomes a :class:`~rlhforge.distributed.groups.WorkerError`
naming the group, the rank and the method.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable, Sequence

from rlhforge.distributed.groups import WorkerError, balanced_shards, lengths_of, pad_shards, zero_weight_copy

__all__ = ["RayWorkerGroup", "WorkerHost", "create_placement_groups", "device_env_for", "NOSET_ENV",
           "bundles_by_node", "bundle_index"]

NOSET_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
"""Set (true/1) on a cluster, Ray leaves ``CUDA_VISIBLE_DEVICES`` alone in GPU actors: every actor then sees
every GPU of its node, and ``cuda:0`` is the same GPU for all of them."""


def device_env_for(env, gpu_ids, *, engine: bool = False) -> dict[str, str]:
    """The variables that put a Ray actor on the GPU(s) Ray gave it when :data:`NOSET_ENV` is set (else
    ``{}``: Ray narrowed ``CUDA_VISIBLE_DEVICES`` itself, so ``cuda:0`` is the actor's GPU). A worker rank
    takes ``LOCAL_RANK`` = its GPU's index (OpenRLHF does the same), or, for GPU ids that are not indexes
    (UUIDs), a narrowed ``CUDA_VISIBLE_DEVICES``; an engine (vLLM on ``cuda:0`` in the actor) always gets
    ``CUDA_VISIBLE_DEVICES``. ``gpu_ids``: ``ray.get_gpu_ids()`` in the actor. (gpu-review-2 F4: without it
    every rank and every TP=1 engine sat on GPU 0.)"""
    if str(env.get(NOSET_ENV, "")).lower() not in ("1", "true") or not gpu_ids:
        return {}
    ids = [str(i) for i in gpu_ids]
    if engine or not all(i.isdigit() for i in ids):
        return {"CUDA_VISIBLE_DEVICES": ",".join(ids), **({} if engine else {"LOCAL_RANK": "0"})}
    return {"LOCAL_RANK": ids[0]}


def bundles_by_node(table: dict, node_ids: list[str] | None = None) -> list[int]:
    """Bundle indexes of one placement group ordered by node (``table``: the group's entry of
    ``ray.util.placement_group_table()``, whose ``bundles_to_node_id`` maps bundle -> node). Ray does not
    promise that consecutive bundles of a multi-node PACK group share a node, and rank ``i`` (and engine
    ``i``'s TP workers) take the ``i``-th entry, so ranks that form a TP engine, a ring or an AutoTP group
    stay on one node. Nodes keep the order of their first bundle; a one-node group is unchanged.
    (gpu-review-2 F7; OpenRLHF's ``get_bundle_indices``.)"""
    where = {int(b): n for b, n in table.get("bundles_to_node_id", {}).items()}
    bundles = sorted(where) if where else list(range(len(table.get("bundles", {}))))
    order: dict[str, int] = {}
    for b in bundles:
        order.setdefault(where.get(b, ""), len(order))
    return sorted(bundles, key=lambda b: (order[where.get(b, "")], b))


class WorkerHost:
    """The Ray actor around one worker: environment first, then the worker, then method calls."""

    def __init__(self, env: dict[str, str]):
        import ray

        os.environ.update(env)
        os.environ.update(device_env_for(os.environ, ray.get_gpu_ids()))  # RAY_EXPERIMENTAL_NOSET_...: its own GPU
        self.worker = None

    def address(self) -> tuple[str, int]:
        """This node's address and a free port (rank 0 hosts the weight-sync group's store there)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def group_address(self) -> tuple[str, int, bool]:
        """Where the model's process group meets (rank 0's host): this node's address, a port, and whether
        this host already serves the group's store there. On a loopback node (a local cluster) it does:
        torch's own rendezvous would host the store on every interface (``backend.collective.store_server``),
        so this host serves it on 127.0.0.1 for the actor's lifetime, and every rank joins it as a client
        (``TORCHELASTIC_USE_AGENT_STORE``, torch's switch for a store hosted outside the ranks)."""
        import datetime

        import ray

        from rlhforge.backend.collective import is_loopback_host, store_server

        ip = ray.util.get_node_ip_address()
        if is_loopback_host(ip):
            self._store = store_server(ip, 0, None, datetime.timedelta(seconds=3600), wait_for_workers=False)
            return ip, self._store.port, True
        return (*self.address(), False)

    def set_env(self, env: dict[str, str]) -> None:
        os.environ.update(env)

    def build(self, factory: Callable, args: tuple, kwargs: dict) -> str:
        import torch

        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        self.worker = factory(*args, **kwargs)
        return type(self.worker).__name__

    def run(self, method: str, args: tuple, kwargs: dict) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def run_items(self, method: str, items: list, args: tuple, kwargs: dict) -> Any:
        """``method(items, *args)``; ``items`` arrives as a top-level argument so Ray resolves it."""
        return getattr(self.worker, method)(items, *args, **kwargs)

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()


def create_placement_groups(plan, timeout_s: float = 120.0) -> dict[str, Any]:
    """One Ray placement group per key of ``plan.bundles`` (strategy PACK), ready; each knows its bundles in
    node order (:func:`bundle_index`)."""
    import ray
    from ray.util.placement_group import placement_group

    pgs = {}
    for key, n in plan.bundles.items():
        pg = placement_group([plan.bundle() for _ in range(n)], strategy="PACK", name=f"rlhforge-{key}-{os.getpid()}")
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            raise WorkerError(f"Ray could not place {n} bundle(s) of {plan.bundle()} for {key} within {timeout_s:.0f} s "
                              f"(cluster resources: {ray.cluster_resources()})")
        pg.rlhforge_bundle_order = bundles_by_node(ray.util.placement_group_table(pg))  # rank i -> this[i]
        pgs[key] = pg
    return pgs


def bundle_index(pg, i: int) -> int:
    """The bundle that rank (or engine bundle) ``i`` of ``pg`` takes: node-ordered (:func:`bundles_by_node`)."""
    order = getattr(pg, "rlhforge_bundle_order", None)
    return order[i] if order else i


class RayWorkerGroup:
    """``num_workers`` Ray actors, one rank each, on bundles ``0..num_workers-1`` of ``pg``."""

    def __init__(self, name: str, factory: Callable, args: tuple = (), kwargs: dict | None = None, *,
                 num_workers: int, pg, share: float, device: str, process_group: bool = True,
                 env: dict[str, str] | None = None, wait: bool = True, call_timeout_s: float | None = None,
                 startup_s: float | None = None):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        import threading

        self.name, self.world_size = name, num_workers
        self.call_timeout_s = call_timeout_s  # --deadline.worker_call_s: the wait on any call (None: none)
        self.startup_s = startup_s  # --deadline.startup_s: building the workers (loading the models)
        # ranks per model replica: consecutive ranks of a ring (--ds.ring_attn_size) or an AutoTP group
        # (--ds.tensor_parallel_size) take the same shard; ring x tp, set by the launcher
        self.replica_size = 1
        self._submit_lock = threading.Lock()
        remote_host = ray.remote(WorkerHost)
        base_env = {"LOCAL_RANK": "0", **(env or {})}
        self.hosts = []
        for rank in range(num_workers):
            opts = {"num_cpus": share, "num_gpus": share if device == "cuda" else 0,
                    "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle_index(pg, rank)),
                    "name": None, "max_restarts": 0}
            self.hosts.append(remote_host.options(**opts).remote(dict(base_env)))
        addr, port, hosted = self._get([self.hosts[0].group_address.remote()], "address")[0] if process_group \
            else (None, None, False)
        if process_group and (num_workers > 1 or hosted):  # hosted: a one-rank group's store too (DeepSpeed, FSDP2)
            from rlhforge.backend.collective import loopback_gloo_env

            # hosted: a loopback node; gloo's pair sockets pinned to the loopback interface as well
            store = {"TORCHELASTIC_USE_AGENT_STORE": "True", **loopback_gloo_env()} if hosted else {}
            self._get([h.set_env.remote({"RANK": str(r), "WORLD_SIZE": str(num_workers), "MASTER_ADDR": addr,
                                         "MASTER_PORT": str(port), **store}) for r, h in enumerate(self.hosts)],
                      "set_env")
        else:
            self._get([h.set_env.remote({"RANK": "0", "WORLD_SIZE": "1"}) for h in self.hosts], "set_env")
        self._building = [h.build.remote(factory, args, kwargs or {}) for h in self.hosts]
        if wait:
            self.ready()

    def ready(self) -> "RayWorkerGroup":
        """Wait until every rank has built its worker (groups built with ``wait=False`` load their
        models side by side)."""
        if self._building:
            refs, self._building = self._building, []
            self._get(refs, f"building {self.name}", self.startup_s, "--deadline.startup_s")
        return self

    # -- calls ------------------------------------------------------------------------------------
    def _get(self, refs: Sequence, what: str, timeout_s: float | None = -1.0,
             flag: str = "--deadline.worker_call_s") -> list[Any]:
        """Results of every rank; a dead actor is reported before the errors it caused on its peers
        (a rank whose collective lost its partner fails with a less useful message). Ranks with no answer
        within ``timeout_s`` (default: ``call_timeout_s``) are named in a WorkerError, after any rank
        that failed meanwhile (whose failure usually explains the others' wait)."""
        import ray

        timeout_s = self.call_timeout_s if timeout_s == -1.0 else timeout_s
        if timeout_s is not None and refs:
            _, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
            if pending:
                hung = [rank for rank, ref in enumerate(refs) if ref in pending]
                self._get([r for r in refs if r not in pending], what, None)  # a failed rank is named first
                raise WorkerError(f"{self.name} worker rank(s) {', '.join(map(str, hung))} gave no answer within "
                                  f"{flag} {timeout_s:g} s during {what} (hung, or slower than the deadline); "
                                  "checkpoints already written are intact")
        out, died, failed = [], [], []
        for rank, ref in enumerate(refs):
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayActorError as err:
                died.append((rank, str(err).splitlines()[0]))
            except ray.exceptions.RayTaskError as err:
                cause = err.cause if getattr(err, "cause", None) is not None else err
                failed.append((rank, f"{type(cause).__name__}: {cause}"))
        if died:
            rank, msg = died[0]
            others = f" ({len(died) + len(failed) - 1} other rank(s) failed with it)" if len(died) + len(failed) > 1 else ""
            raise WorkerError(f"{self.name} worker rank {rank} died during {what} (its Ray actor is gone: {msg}){others}; "
                              "checkpoints already written are intact")
        if failed:
            rank, msg = failed[0]
            raise WorkerError(f"{self.name} worker rank {rank} failed in {what}: {msg}")
        return out

    def call(self, method: str, *args, **kwargs) -> list[Any]:
        """The same call on every rank; one result per rank."""
        return self._get(self.submit(method, *args, **kwargs), method)

    def submit(self, method: str, *args, **kwargs) -> list:
        """Start the same call on every rank; returns the Ray object refs (rank order). Submissions from
        several driver threads never interleave across ranks (every rank runs the calls in the same
        order, so collectives inside them pair up)."""
        with self._submit_lock:
            return [h.run.remote(method, args, kwargs) for h in self.hosts]

    def wait(self, refs: Sequence, what: str) -> list[Any]:
        """Results of refs from :meth:`submit`, a failing rank named (see ``_get``)."""
        return self._get(refs, what)

    def rank0_address(self) -> tuple[str, int]:
        """Rank 0's node address and a free port there (it hosts the weight-sync group's store)."""
        return self._get([self.hosts[0].address.remote()], "address")[0]

    def _map(self, method: str, items: Sequence, args, kwargs, pad) -> tuple[list, list[list[int]], list[int]]:
        import ray

        replica = self.replica_size
        shards = balanced_shards(lengths_of(items), self.world_size // replica)  # one shard per data-parallel replica
        chunks, real = pad_shards(items, shards, pad)
        chunk_refs = [ray.put(chunk) for chunk in chunks]
        with self._submit_lock:
            refs = [h.run_items.remote(method, chunk_refs[rank // replica], args, kwargs)
                    for rank, h in enumerate(self.hosts)]
        return self._get(refs, method), shards, real

    def map_gather(self, method: str, items: Sequence, *args, **kwargs) -> list[Any]:
        """Shard ``items`` over the ranks; ``method(shard, *args)`` returns one result per item."""
        if not items:
            return []
        results, shards, real = self._map(method, items, args, kwargs, pad=None)
        out: list[Any] = [None] * len(items)
        for res, idx, n in zip(results[:: self.replica_size], shards, real):  # a replica's ranks return the same
            for i, r in zip(idx, list(res)[:n]):
                out[i] = r
        return out

    def map_train(self, method: str, items: Sequence, *args, **kwargs) -> list[Any]:
        """Shard one optimizer step's samples (padding copies carry no loss); a result per rank."""
        return self._map(method, items, args, kwargs, pad=zero_weight_copy)[0]

    # -- weights for the driver's engines ----------------------------------------------------------
    def _wait_with(self, refs: Sequence, what: str, local_fn):
        """Run ``local_fn`` here while the workers run ``refs``; a worker failing first is raised (the
        local end would otherwise wait for a peer that is gone)."""
        import threading

        import ray

        box: dict = {}

        def target():
            try:
                box["value"] = local_fn()
            except BaseException as err:  # noqa: BLE001
                box["error"] = err

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        pending = list(refs)
        deadline = None if self.call_timeout_s is None else time.monotonic() + self.call_timeout_s
        while pending:
            if deadline is not None and time.monotonic() > deadline:
                self._get(refs, what, timeout_s=0.0)  # names the ranks with no answer (WorkerError)
            done, pending = ray.wait(pending, timeout=1.0)
            for ref in done:
                try:
                    ray.get(ref)
                except Exception:  # noqa: BLE001 - named by _get below
                    self._get(refs, what)
        thread.join()
        if "error" in box:
            raise WorkerError(f"{self.name}: {what} failed on the driver's end: {box['error']}")
        self._get(refs, what)
        return box["value"]

    def open_weight_channel(self, bucket_mb: int) -> None:
        """A dedicated two-member gloo group, rank 0 -> the driver, for :meth:`gather_weights`."""
        from rlhforge.workers.weight_sync import DriverReceiver

        host, port = self.rank0_address()
        receiver = DriverReceiver(host, port)
        ref = self.hosts[0].run.remote("open_weight_channel", (host, port, 2, bucket_mb * 2**20), {})
        self._wait_with([ref], "opening the weight-sync channel", receiver.connect)
        self.receiver = receiver

    def gather_weights(self) -> dict:
        """Full weights: every rank gathers, rank 0 broadcasts them in buckets over the channel (or,
        without one, returns them through Ray's object store)."""
        if getattr(self, "receiver", None) is None:
            return self.call("engine_state_dict")[0]
        return self._wait_with(self.submit("send_weights"), "send_weights", self.receiver.receive)

    def pids(self) -> list[int]:
        return self._get([h.pid.remote() for h in self.hosts], "pid")

    def node_ids(self) -> list[str]:
        """The Ray node of each rank."""
        return self._get([h.node_id.remote() for h in self.hosts], "node_id")

    def close(self) -> None:
        import ray

        for h in self.hosts:
            try:
                ray.kill(h)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.hosts = []
