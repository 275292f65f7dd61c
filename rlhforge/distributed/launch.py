"""Starting Ray and the RL worker groups (``--train.workers ray``; docs/distributed.md).

The driver (this process: ``python -m rlhforge.cli.train_ppo_ray`` run directly, by ``ray job
submit``, or by a Slurm script) is the single controller: it owns the prompt stream, the agent
executors and the reward functions, and calls the worker groups. The models live in Ray actor
groups, and the vLLM engines (``--vllm.num_engines``) in engine actors of their own
(:mod:`rlhforge.distributed.engine_actors`); the HF engine stays in the driver.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from rlhforge.config.deadline import COLLECTIVE_TIMEOUT_ENV

__all__ = ["init_ray", "keep_loopback", "check_token_auth", "ray_device", "build_ray_groups", "wait_for_resources", "close_groups", "placement_line"]

#: Set in every Ray worker (the driver's own value wins when it has one, as in OpenRLHF).
RAY_ENV_DEFAULTS = {"TOKENIZERS_PARALLELISM": "false", "NCCL_DEBUG": "WARN"}
#: Ray's switch for token authentication (``token`` | ``disabled``), read from the environment only.
AUTH_MODE_ENV = "RAY_AUTH_MODE"


def init_ray(num_cpus: int | None = None) -> None:
    """Connect to the cluster in ``RAY_ADDRESS`` (``ray job submit`` sets it), or start a local one.

    Without ``RAY_ADDRESS`` a new local cluster is started explicitly (Ray's ``address="local"``):
    a plain ``ray.init()`` would attach to the cluster named in Ray's ``ray_current_cluster`` file,
    which a stopped or crashed ``ray start --head`` leaves behind. A cluster that cannot be reached
    is a one-line :class:`~rlhforge.config.parsing.ConfigError` (exit 2) naming ``RAY_ADDRESS``."""
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS") or None
    kwargs = {"log_to_driver": True}  # no runtime_env here: a submitted job keeps its own (working_dir ...)
    if address is None:
        kwargs["num_cpus"] = num_cpus or os.cpu_count()
        kwargs["include_dashboard"] = False
        # a local cluster listens on loopback only: with the node address kept at 127.0.0.1 (keep_loopback),
        # `ss -ltnp` during a run shows the GCS, the raylet, the driver's and every worker's gRPC server on
        # [::ffff:127.0.0.1], the dashboard agent (gRPC, HTTP, metrics), the runtime-env agent and the two
        # helper processes on 127.0.0.1, and nothing of the Ray tree on another address
        # (tests/security/test_ray_listeners.py; docs/distributed.md, "Listeners and token authentication")
        kwargs["_node_ip_address"] = "127.0.0.1"
        _ask_token_auth()  # Ray 2.60's default, made explicit and checked after the start (check_token_auth)
    elif _is_loopback(address):
        # a cluster whose nodes run on 127.0.0.1 (docs/distributed.md, "Several nodes on one machine"): the
        # driver's node is on loopback too, and Ray must not rewrite the loopback address into the
        # machine's own one (which nothing listens on)
        kwargs["_node_ip_address"] = "127.0.0.1"
    try:
        with keep_loopback(address is None or _is_loopback(address)):
            ray.init(address=address or "local", **kwargs)
        check_token_auth(local=address is None)
    except ConnectionError as err:
        from rlhforge.config.parsing import ConfigError

        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        if address is None:
            raise ConfigError(f"could not start a local Ray cluster (RAY_ADDRESS is not set): {first}") from None
        raise ConfigError(f"could not connect to the Ray cluster at RAY_ADDRESS={address}: {first}; "
                          "start it (ray start --head), or unset RAY_ADDRESS for a local cluster") from None


def _ask_token_auth() -> None:
    """``RAY_AUTH_MODE=token`` for the cluster about to start, unless the user set the mode: in the
    environment (the cluster's processes inherit it) and in this process's cached Ray config, as Ray
    itself does when it turns token authentication on by default."""
    if os.environ.get(AUTH_MODE_ENV):
        return
    try:
        from ray._raylet import Config
    except ImportError:
        return
    os.environ[AUTH_MODE_ENV] = "token"
    Config.initialize("")


def check_token_auth(local: bool) -> str:
    """Ray's token authentication (``RAY_AUTH_MODE=token``: the GCS, raylet, workers and agents refuse a
    client without the cluster's token) is on, or the user turned it off on purpose: ``"token"``,
    ``"disabled"`` (``RAY_AUTH_MODE=disabled`` given: one warning line) or ``"unavailable"`` (a Ray
    without token authentication). On a local cluster rlhforge asked for it, so its absence is a
    :class:`~rlhforge.config.parsing.ConfigError` (exit 2)."""
    import sys

    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # Ray before token authentication: the listeners are loopback only
        return "unavailable"
    if is_token_auth_enabled():
        _owner_only(os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(os.path.expanduser("~"), ".ray", "auth_token"))
        return "token"
    where = "this local Ray cluster" if local else "the Ray cluster in RAY_ADDRESS"
    if os.environ.get(AUTH_MODE_ENV, "").lower() == "disabled":
        print(f"warning: {AUTH_MODE_ENV}=disabled: {where} runs without token authentication; any process "
              "that can reach its ports (on this machine: every local user) can run code in it", file=sys.stderr)
        return "disabled"
    if not local:
        print(f"warning: {where} runs without token authentication (start it with {AUTH_MODE_ENV}=token)",
              file=sys.stderr)
        return "disabled"
    from rlhforge.config.parsing import ConfigError

    raise ConfigError(f"the local Ray cluster started without token authentication although {AUTH_MODE_ENV}="
                      f"{os.environ.get(AUTH_MODE_ENV)!r} asked for it")


def _owner_only(path: str) -> None:
    """Ray writes its token file with the process's umask (often world-readable, 0644): make it 0600 when
    it is this user's."""
    try:
        st = os.stat(path)
        if st.st_uid == os.getuid() and st.st_mode & 0o077:
            os.chmod(path, 0o600)
    except OSError:
        pass


def _is_loopback(address: str | None) -> bool:
    if not address or address in ("auto", "local"):
        return False
    host = address.split("://")[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


@contextmanager
def keep_loopback(loopback: bool):
    """Ray (2.4x-2.6x) turns a loopback node address (``_node_ip_address``, a loopback ``RAY_ADDRESS``)
    into this machine's own address (``services.resolve_ip_for_localhost``), unless it believes
    multi-node clusters are off: a local cluster would then listen on every interface, and a driver
    joining a cluster started on 127.0.0.1 would look for it where nothing listens. Keep 127.0.0.1 as
    given while Ray starts or connects (the cluster's processes are told their address on the command
    line, so they listen on loopback only)."""
    from ray._private import ray_constants

    if not loopback or not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):
        yield
        return
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def ray_device(requested: str) -> str:
    """``cuda`` or ``cpu`` for the worker bundles (auto: GPUs when the cluster has any)."""
    import ray

    if requested != "auto":
        return requested
    return "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"


def build_ray_groups(cfg, tokenizer, plan, start_engines=None):
    """Placement groups, the generation engines and the actor / ref / critic Ray worker groups of one run.

    ``start_engines(placement, pgs)`` (the vLLM engine actors, or None) runs *before* any model loads,
    as in OpenRLHF: a colocated vLLM engine checks at start-up that the share of GPU memory it was given
    (``--vllm.gpu_memory_utilization``) is free, which it no longer is once the trainers sit on the GPU;
    with ``--vllm.enable_sleep`` the engines then go to sleep until the first generation. A wake re-maps
    the start-up allocation, so the caller first checks that engines on the models' GPUs fit beside the
    models (:func:`~rlhforge.distributed.plan_report.check_colocated_engines`).

    Returns ``(actor, ref, critic, placement, reward, engine)``; ref/critic/reward/engine are None when
    the run has none (``reward``: the reward-model group, :mod:`rlhforge.workers.reward`)."""
    from rlhforge.distributed.placement import plan_from_config
    from rlhforge.distributed.ray_group import create_placement_groups

    init_ray()
    device = ray_device(cfg.train.device)
    placement = plan_from_config(cfg, device)  # the plan --train.plan_only prints; engines are Ray actors too
    wait_for_resources(placement)
    pgs = create_placement_groups(placement, timeout_s=cfg.deadline.startup_s)
    engine = None
    if start_engines is not None:
        engine = start_engines(placement, pgs)  # ready: every engine has started (EngineActors.ready)
        if cfg.vllm.enable_sleep:
            engine.sleep()
    try:
        actor, ref, critic, reward = _start_groups(cfg, tokenizer, plan, placement, pgs, device)
    except BaseException:
        if engine is not None:
            engine.close()
        raise
    actor.placement_groups = list(pgs.values())  # removed by close_groups
    actor.pgs = pgs  # the engine actors' bundles (distributed.engine_actors.build_engine_actors)
    if not cfg.vllm.sync_with_ray and not placement.engines:  # the driver's engine: a channel rank 0 -> driver
        actor.open_weight_channel(cfg.vllm.sync_bucket_mb)
    return actor, ref, critic, placement, reward, engine


def _start_groups(cfg, tokenizer, plan, placement, pgs, device):
    """The model groups on their bundles, all loading at the same time: ``(actor, ref, critic, reward)``."""
    from rlhforge.distributed.ray_group import RayWorkerGroup
    from rlhforge.workers.reward import RewardWorker
    from rlhforge.workers.actor import ActorWorker, CriticWorker, RefWorker

    sizes = {name: g.num_workers for name, g in placement.groups.items()}
    env = {"RLHFORGE_RAY_WORKER": "1", COLLECTIVE_TIMEOUT_ENV: str(cfg.deadline.collective_s),
           **{k: os.environ.get(k, v) for k, v in RAY_ENV_DEFAULTS.items()}}

    def group(name, factory, args, process_group=True):
        g = placement.groups[name]
        return RayWorkerGroup(name, factory, args, num_workers=g.num_workers, pg=pgs[g.pg], share=g.share,
                              device=device, process_group=process_group, env=env, wait=False,
                              call_timeout_s=cfg.deadline.worker_call_s, startup_s=cfg.deadline.startup_s)

    actor = group("actor", ActorWorker, (cfg, tokenizer, plan, sizes["actor"]))  # the plan whole, and group sizes
    # the actor's rings / AutoTP groups share shards (the ref and critic run without either)
    actor.replica_size = cfg.ds.ring_attn_size * cfg.ds.tensor_parallel_size
    ref = group("ref", RefWorker, (cfg, tokenizer)) if "ref" in sizes else None  # a process group: ZeRO-3 shards
    reward = group("reward", RewardWorker, (cfg, tokenizer)) if "reward" in sizes else None
    teacher = None
    if "teacher" in sizes:  # on-policy distillation's teacher: a reference-like group (workers/teacher.py)
        from rlhforge.workers.teacher import TeacherWorker

        teacher = group("teacher", TeacherWorker, (cfg, tokenizer))
    actor.teacher_group = teacher  # the trainer's teacher (cli/train_ppo_ray.py); closed with the others
    critic = None
    if "critic" in sizes:
        critic = group("critic", CriticWorker, (cfg, tokenizer, plan, sizes["critic"]))
    for g in (actor, ref, critic, reward, teacher):  # all groups load their models at the same time; wait here
        if g is not None:
            g.ready()
    print(placement_line(actor, ref, critic, reward, teacher))
    return actor, ref, critic, reward


def placement_line(*groups) -> str:
    """Which Ray node holds each rank: ``[rlhforge] ray nodes: 2; actor ranks 0 1 on 1a2b3c4d, ...``."""
    nodes: dict[str, list[str]] = {}
    for g in groups:
        if g is None:
            continue
        for rank, node in enumerate(g.node_ids()):
            nodes.setdefault(node, []).append(f"{g.name}:{rank}")
    where = "; ".join(f"node {node[:8]}: {' '.join(ranks)}" for node, ranks in nodes.items())
    return f"[rlhforge] ray placement over {len(nodes)} node(s): {where}"


def wait_for_resources(placement, timeout_s: float = 30.0) -> None:
    """Fail at once (ConfigError, with the arithmetic) when the whole cluster cannot hold the plan;
    when only its *free* resources fall short, wait up to ``timeout_s`` first: Ray releases the
    bundles of actors and placement groups removed a moment ago (an earlier run in this process)
    asynchronously."""
    import time

    import ray

    from rlhforge.config.parsing import ConfigError
    from rlhforge.distributed.placement import check_resources

    check_resources(placement, ray.cluster_resources())
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            check_resources(placement, ray.available_resources())
            return
        except ConfigError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def close_groups(*groups) -> None:
    """Kill the groups' actors and remove their placement groups (a shared Ray cluster stays clean)."""
    from ray.util.placement_group import remove_placement_group

    for g in groups:
        if g is None:
            continue
        g.close()
        for pg in getattr(g, "placement_groups", []):
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - already removed
                pass
