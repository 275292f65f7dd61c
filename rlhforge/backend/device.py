"""The one module that knows device strings and process-group backends."""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def dist_info() -> DistInfo:
    """Rank/world size from the launcher's environment (torchrun, deepspeed, Ray)."""
    return DistInfo(
        rank=int(os.environ.get("RANK", 0)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
    )


def resolve_device(name: str = "auto", local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--train.device cuda was requested but CUDA is not available")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def process_group_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(device: torch.device, force: bool = False) -> None:
    """Initialise torch.distributed once when launched with several processes (``force``: also for
    one process, whose environment :func:`single_process_env` provides)."""
    import torch.distributed as dist

    info = dist_info()
    if (info.world_size > 1 or force) and not dist.is_initialized():
        with one_rank_store():
            dist.init_process_group(backend=process_group_backend(device), **collective_timeout_kwargs())
        destroy_group_at_exit()
    from rlhforge.backend.strict_device import install

    install()  # RLHFORGE_STRICT_DEVICE=1 (the tests): rlhforge's collectives checked for the group's device


def collective_timeout_kwargs() -> dict:
    """``{"timeout": timedelta}`` from ``--deadline.collective_s`` (set by the launcher in every rank's
    environment: rlhforge.config.deadline.COLLECTIVE_TIMEOUT_ENV), or {} for torch's default. Passed to
    ``init_process_group`` and to DeepSpeed's ``init_distributed``: gloo's timeout, NCCL's watchdog."""
    import datetime

    from rlhforge.config.deadline import collective_timeout_s

    seconds = collective_timeout_s()
    return {} if seconds is None else {"timeout": datetime.timedelta(seconds=seconds)}


@functools.cache
def destroy_group_at_exit() -> None:
    """Destroy the default process group at exit, before the interpreter tears down (once per process;
    call after any ``init_process_group`` / ``deepspeed.init_distributed``). A gloo group left to the C++
    static destructors can abort a rank after a finished run ("terminate called without an active
    exception", SIGABRT), which torchrun reports as a failed job."""
    atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    """Shut every group down and drop the references that would keep their gloo threads alive into the
    interpreter's teardown: DeepSpeed's cached groups, and groups held only by reference cycles."""
    import gc

    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    release_deepspeed_groups()
    gc.collect()


def release_deepspeed_groups() -> None:
    """Drop DeepSpeed's references to its cached process groups (``deepspeed.utils.groups``), if it is
    loaded: ``_release_process_group_references``; older DeepSpeed: its world clone, the one that matters."""
    import sys

    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    release = getattr(groups, "_release_process_group_references", None)
    if release is not None:
        release()
    else:
        groups._WORLD_GROUP = None


def single_process_env() -> None:
    """Environment for a one-rank process group in a plain process (a free local port)."""
    import os
    import socket

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(key, value)
    # a one-rank group's store port is private: a MASTER_PORT inherited from a parent process (which may
    # still hold it) is replaced by a free one rather than failing with EADDRINUSE. Not under torchrun, nor
    # with a store hosted for the rank (TORCHELASTIC_USE_AGENT_STORE: a Ray worker on a loopback node,
    # distributed.ray_group): the port is held on purpose and the rank connects to it.
    port = os.environ.get("MASTER_PORT")
    inherited = os.environ["WORLD_SIZE"] == "1" and "TORCHELASTIC_RUN_ID" not in os.environ \
        and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    if port is None or (inherited and not _port_free(int(port))):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(sock.getsockname()[1])


_ONE_RANK_STORES: dict = {}  # port -> hosted store, kept for the process's life (a live group may still use one)


@contextlib.contextmanager
def one_rank_store():
    """While a one-rank process group of a plain process (:func:`single_process_env`) is opened through torch's
    ``env://`` rendezvous (``init_process_group``, DeepSpeed's ``init_distributed``): its store is hosted here on
    127.0.0.1 (``backend.collective.store_server``) and the rank joins it as a client
    (``TORCHELASTIC_USE_AGENT_STORE``, set only for the call, so child processes never inherit it). torch would
    host it on every interface. Nothing changes under torchrun, with a store already hosted for the rank (a Ray
    worker, ``distributed.ray_group``), for several ranks, or for a non-loopback ``MASTER_ADDR``."""
    import torch.distributed as dist

    env = os.environ
    if env.get("WORLD_SIZE") != "1" or "TORCHELASTIC_RUN_ID" in env or env.get("TORCHELASTIC_USE_AGENT_STORE") \
            or env.get("MASTER_ADDR") not in ("127.0.0.1", "localhost") or not env.get("MASTER_PORT") \
            or dist.is_initialized():  # initialised already: no rendezvous will happen
        yield
        return
    import datetime

    from rlhforge.backend.collective import store_server

    port = int(env["MASTER_PORT"])
    if port not in _ONE_RANK_STORES:
        _ONE_RANK_STORES[port] = store_server("127.0.0.1", port, None, datetime.timedelta(seconds=3600),
                                              wait_for_workers=False)
    env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    try:
        yield
    finally:
        env.pop("TORCHELASTIC_USE_AGENT_STORE", None)


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def peak_memory_bytes(device: torch.device) -> int:
    """Peak accelerator memory, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def release_cached_memory(device: torch.device) -> int:
    """Give the caching allocator's unused blocks back to the device (before a colocated vLLM engine wakes
    up into the same GPU: it re-maps its start-up allocation, which must fit in what is free; vLLM does not
    re-size it). Returns the bytes released (0 on CPU, which has no such cache)."""
    if device.type != "cuda":
        return 0
    import gc

    gc.collect()
    before = torch.cuda.memory_reserved(device)
    torch.cuda.empty_cache()
    return int(before - torch.cuda.memory_reserved(device))


def seed_everything(seed: int, full_determinism: bool = False) -> None:
    """Seed Python, NumPy and torch (every process of a run calls this with the run's seed)."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if full_determinism:
        torch.use_deterministic_algorithms(True, warn_only=True)
