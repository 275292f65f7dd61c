"""Standalone collective groups for weight sync, and the bucketed broadcast of a state dict over them.

A weight-sync group is not the training group: it has its own ``TCPStore`` (hosted by rank 0, the
sender) and its own members (actor rank 0 plus every engine worker, or plus the driver), so it is
built with the process-group classes directly (``ProcessGroupGloo`` / ``ProcessGroupNCCL``), never
with ``init_process_group`` (a process has one default group, and the trainer's is already taken).

Per sync, rank 0 streams the weights in buckets: for each, a small header (names, dtypes, shapes,
pickled into a byte tensor), then the bucket as one flat byte buffer, so the sender never holds more
than one bucket beyond the model (ZeRO-3 parameters are gathered one at a time as they are sent).
On NCCL the buffers live on the member's CUDA device; on gloo in host memory.
"""

from __future__ import annotations

import datetime
import pickle
import socket
from typing import Iterator

import torch

from rlhforge.backend.fingerprint import Fingerprint, state_fingerprint  # noqa: F401 - re-exported
from rlhforge.backend.strict_device import check, place

__all__ = ["SyncTimeout", "open_group", "store_server", "loopback_gloo_env", "free_port", "plan_buckets", "pack_bucket", "unpack_bucket", "broadcast_state",
           "stream_buckets", "receive_state", "state_fingerprint", "Fingerprint", "SyncGroup"]


class SyncTimeout(RuntimeError):
    """A weight-sync collective made no progress within its deadline (a member died or hung)."""


def watchdog_timeout_s(deadline_s: float) -> float:
    """The group's own (NCCL watchdog / gloo) timeout for a sync whose waits have ``deadline_s``: later than
    the deadline, so the member's own wait raises first and the group is aborted by rlhforge (by default
    NCCL's watchdog ends the whole process on its timeout: TORCH_NCCL_ASYNC_ERROR_HANDLING)."""
    return 2 * deadline_s + 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def is_loopback_host(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def loopback_gloo_env() -> dict[str, str]:
    """``{"GLOO_SOCKET_IFNAME": <the loopback interface>}`` for the members of a group on one machine: gloo binds
    its pair sockets to the address the host name resolves to, which need not be loopback; empty when the
    variable is already set or no loopback interface (``lo``, ``lo0``) is found."""
    import os

    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return {}
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return {}
    name = next((n for n in ("lo", "lo0") if n in names), None)
    return {"GLOO_SOCKET_IFNAME": name} if name else {}


def store_server(host: str, port: int, world_size: int | None, timeout: datetime.timedelta,
                 wait_for_workers: bool = True):
    """The ``TCPStore`` server of a group whose members meet at ``host:port`` (``port`` 0: a free one; the
    store's ``.port`` says which). torch binds its store server to every interface whatever ``host`` is;
    for a loopback ``host`` the server is handed a socket bound to 127.0.0.1 instead, so a group on one
    machine listens on loopback only (docs/security.md, "Ray cluster")."""
    from torch.distributed import TCPStore

    if not is_loopback_host(host):
        return TCPStore(host, port, world_size, True, timeout=timeout, wait_for_workers=wait_for_workers)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    port = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the listening socket from here on
    return TCPStore("127.0.0.1", port, world_size, True, timeout=timeout, wait_for_workers=wait_for_workers,
                    master_listen_fd=fd, use_libuv=True)


def open_group(host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
               timeout_s: float = 1800.0):
    """Join (rank 0: host) a ``world_size``-member group. Blocks until every member has joined (at most
    ``timeout_s``). A gloo group's timeout is ``timeout_s``; an NCCL group's watchdog gets
    :func:`watchdog_timeout_s` of it (the waits' own deadline comes first)."""
    from torch.distributed import TCPStore

    timeout = datetime.timedelta(seconds=timeout_s)
    store = store_server(host, port, world_size, timeout) if rank == 0 else TCPStore(host, port, world_size, False,
                                                                                      timeout=timeout)
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = datetime.timedelta(seconds=watchdog_timeout_s(timeout_s))  # after the waits' deadline
        return ProcessGroupNCCL(store, rank, world_size, opts)
    if backend != "gloo":
        raise ValueError(f"weight-sync backend {backend!r}: expected 'gloo' or 'nccl'")
    from torch.distributed import ProcessGroupGloo

    return ProcessGroupGloo(store, rank, world_size, timeout)


def plan_buckets(layout: list[tuple[str, torch.dtype, tuple[int, ...]]], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``layout`` grouped into buckets of at most ``bucket_bytes`` (a larger tensor is alone)."""
    buckets: list[list[int]] = []
    size = 0
    for i, (_, dtype, shape) in enumerate(layout):
        n = _nbytes(dtype, shape)
        if buckets and buckets[-1] and size + n <= bucket_bytes:
            buckets[-1].append(i)
            size += n
        else:
            buckets.append([i])
            size = n
    return buckets


def _nbytes(dtype: torch.dtype, shape) -> int:
    numel = 1
    for d in shape:
        numel *= int(d)
    return numel * torch.empty((), dtype=dtype).element_size()


def pack_bucket(tensors: list[torch.Tensor], device: str | torch.device = "cpu") -> torch.Tensor:
    """Tensors -> one flat uint8 buffer on ``device``."""
    parts = [t.detach().to(device).contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)


def unpack_bucket(buffer: torch.Tensor, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]
                  ) -> list[tuple[str, torch.Tensor]]:
    out, offset = [], 0
    for name, dtype, shape in entries:
        n = _nbytes(dtype, shape)
        out.append((name, buffer[offset : offset + n].clone().view(dtype).reshape(shape)))  # clone: aligned
        offset += n
    if offset != buffer.numel():
        raise RuntimeError(f"weight sync: bucket of {buffer.numel()} bytes, layout says {offset}")
    return out


def stream_buckets(named, bucket_bytes: int, device: str | torch.device = "cpu"
                   ) -> Iterator[tuple[list, torch.Tensor | None, bool]]:
    """Group (name, tensor) pairs (or a dict) into buckets of at most ``bucket_bytes`` (a larger tensor
    goes alone), each copied into one flat uint8 buffer on ``device`` as its tensors arrive (a tensor
    may be freed once the next is asked for, e.g. a ZeRO-3 parameter gathered for the moment).
    Yields ``(entries, buffer, last)`` with ``entries`` = [(name, dtype, shape)]; an empty stream
    yields one ``([], None, True)``. Peak memory: one bucket beyond the one being consumed."""
    items = named.items() if isinstance(named, dict) else named
    entries: list = []
    parts: list[torch.Tensor] = []
    size = 0
    pending = None
    for name, t in items:
        n = t.numel() * t.element_size()
        if entries and size + n > bucket_bytes:
            if pending is not None:
                yield (*pending, False)
            pending, entries, parts, size = (entries, torch.cat(parts)), [], [], 0
        entries.append((name, t.dtype, tuple(t.shape)))
        parts.append(t.detach().to(device).contiguous().reshape(-1).view(torch.uint8).clone())
        size += n
    if entries:
        if pending is not None:
            yield (*pending, False)
        pending = (entries, torch.cat(parts))
    yield (*(pending or ([], None)), True)


def _broadcast(pg, tensor: torch.Tensor, deadline_s: float | None = None) -> None:
    """One broadcast from member 0 of ``pg``, waited on for at most ``deadline_s`` (then :class:`SyncTimeout`;
    the caller aborts the group). Strict-device mode checks ``tensor`` for the group's device."""
    check(tensor, pg_backend(pg), "weight-sync broadcast")
    work = pg.broadcast(tensor, 0)
    if deadline_s is None:
        work.wait()
        return
    try:
        done = work.wait(datetime.timedelta(seconds=deadline_s))
    except RuntimeError as err:  # gloo and NCCL raise on an expired wait
        raise SyncTimeout(f"weight-sync broadcast: no progress within {deadline_s:g} s ({str(err).splitlines()[0]})"
                          ) from None
    if done is False:
        raise SyncTimeout(f"weight-sync broadcast: no progress within {deadline_s:g} s")


def pg_backend(pg) -> str | None:
    """'nccl' or 'gloo' for a group made by :func:`open_group` (None: unknown)."""
    name = type(pg).__name__.lower()
    return "nccl" if "nccl" in name else "gloo" if "gloo" in name else None


def broadcast_state(pg, named, bucket_bytes: int, device: str = "cpu", deadline_s: float | None = None) -> int:
    """Rank 0's side: stream ``named`` to every member (:func:`stream_buckets`); per bucket, its header
    (names, dtypes, shapes, last-or-not), then its bytes. Returns the number of buckets."""
    sent = 0
    for entries, buf, last in stream_buckets(named, bucket_bytes, device):
        header = place(torch.frombuffer(bytearray(pickle.dumps((entries, last))), dtype=torch.uint8), device)
        _broadcast(pg, place(torch.tensor([header.numel()], dtype=torch.int64), device), deadline_s)
        _broadcast(pg, header, deadline_s)
        if entries:
            _broadcast(pg, place(buf, device), deadline_s)
            sent += 1
    return sent


def receive_state(pg, device: str = "cpu", deadline_s: float | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every other member's side: (name, tensor) pairs in the sender's order, one bucket at a time
    (consume the iterator to the end: each bucket is a collective every member takes part in)."""
    while True:
        size = place(torch.zeros(1, dtype=torch.int64), device)
        _broadcast(pg, size, deadline_s)
        header = place(torch.empty(int(size.item()), dtype=torch.uint8), device)
        _broadcast(pg, header, deadline_s)
        entries, last = pickle.loads(header.cpu().numpy().tobytes())
        if entries:
            buf = place(torch.empty(sum(_nbytes(d, s) for _, d, s in entries), dtype=torch.uint8), device)
            _broadcast(pg, buf, deadline_s)
            yield from unpack_bucket(buf, entries)
        if last:
            return


class SyncGroup:
    """One member's handle: ``open_group`` + the side it plays. Every wait of a sync has ``timeout_s``; on
    expiry (or any failure) the group is aborted, so no NCCL watchdog is left waiting on a dead peer, and
    :class:`SyncTimeout` / the error is raised: the owner opens a new group for the next sync."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                 device: str = "cpu", timeout_s: float = 1800.0):
        self.rank, self.world_size, self.backend, self.device = rank, world_size, backend, device
        self.timeout_s = timeout_s
        self.pg = open_group(host, port, rank, world_size, backend, timeout_s)

    def send(self, named, bucket_bytes: int) -> int:
        """Broadcast a state dict or a stream of (name, tensor) pairs; returns the number of buckets."""
        assert self.rank == 0, "only rank 0 sends"
        try:
            return broadcast_state(self.pg, named, bucket_bytes, self.device, self.timeout_s)
        except BaseException:
            self.abort()
            raise

    def receive(self) -> Iterator[tuple[str, torch.Tensor]]:
        assert self.rank != 0, "rank 0 sends"
        try:
            yield from receive_state(self.pg, self.device, self.timeout_s)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Abort the group's communicators (NCCL: ``abort()``; gloo has nothing to abort); idempotent."""
        abort = getattr(self.pg, "abort", None)
        if abort is not None and self.backend == "nccl":
            try:
                abort()
            except Exception:  # noqa: BLE001 - already torn down
                pass
