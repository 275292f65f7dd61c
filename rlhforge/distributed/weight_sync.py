"""Weight sync from the actor's Ray workers to the driver's engines over a dedicated process group.

After each update every actor rank takes part in gathering the full weights (ZeRO-3 shards are
all-gathered one parameter at a time); rank 0 then *broadcasts* them to the driver over a
two-member gloo process group that exists only for this (its own ``TCPStore``, not the workers'
training group), in buckets of ``bucket_mb`` MiB: one collective per bucket, not per tensor.

Per sync, rank 0 sends first the layout (names, dtypes, shapes and bucket boundaries, pickled
into a byte tensor), then each bucket as one flat byte buffer. The driver rebuilds the tensors
from the buffer and hands them to the engine (``update_weights``), which loads
them (HF: ``load_state_dict``; vLLM: ``reload_weights``, then the prefix cache is reset).

``--vllm.sync_with_ray`` sends the state dict through Ray's object store instead (simpler; a
full copy passes through the object store).
"""

from __future__ import annotations

import datetime
import pickle
import socket

import torch

__all__ = ["WeightReceiver", "WeightSender", "plan_buckets", "pack_bucket", "unpack_bucket"]

_TIMEOUT = datetime.timedelta(minutes=30)


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


def pack_bucket(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Tensors -> one flat uint8 buffer (CPU)."""
    parts = [t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


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


def _pg(host: str, port: int, rank: int, is_master: bool):
    from torch.distributed import ProcessGroupGloo, TCPStore

    store = TCPStore(host, port, 2, is_master, timeout=_TIMEOUT)
    return ProcessGroupGloo(store, rank, 2, _TIMEOUT)


def _node_ip() -> str:
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - no Ray: local only
        return "127.0.0.1"


class WeightReceiver:
    """The driver's end (rank 0 of the channel; it hosts the store)."""

    def __init__(self):
        self.host = _node_ip()
        with socket.socket() as s:
            s.bind(("", 0))
            self.port = s.getsockname()[1]
        self.pg = None

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def connect(self) -> None:
        """Blocks until the sender has joined (call it while the sender's ``__init__`` runs)."""
        self.pg = _pg(self.host, self.port, 0, True)

    def receive(self) -> dict[str, torch.Tensor]:
        size = torch.zeros(1, dtype=torch.int64)
        self.pg.broadcast(size, 1).wait()
        blob = torch.empty(int(size.item()), dtype=torch.uint8)
        self.pg.broadcast(blob, 1).wait()
        layout, buckets = pickle.loads(blob.numpy().tobytes())
        state: dict[str, torch.Tensor] = {}
        for idx in buckets:
            entries = [layout[i] for i in idx]
            buf = torch.empty(sum(_nbytes(d, s) for _, d, s in entries), dtype=torch.uint8)
            self.pg.broadcast(buf, 1).wait()
            state.update(unpack_bucket(buf, entries))
        return state


class WeightSender:
    """The actor rank 0's end."""

    def __init__(self, host: str, port: int, bucket_bytes: int):
        self.pg = _pg(host, port, 1, False)
        self.bucket_bytes = bucket_bytes
        self.last_buckets = 0

    def send(self, state: dict[str, torch.Tensor]) -> int:
        """Broadcast ``state``; returns the number of buckets (collectives after the layout)."""
        names = list(state)
        layout = [(n, state[n].dtype, tuple(state[n].shape)) for n in names]
        buckets = plan_buckets(layout, self.bucket_bytes)
        blob = torch.frombuffer(bytearray(pickle.dumps((layout, buckets))), dtype=torch.uint8)
        self.pg.broadcast(torch.tensor([blob.numel()], dtype=torch.int64), 1).wait()
        self.pg.broadcast(blob, 1).wait()
        for idx in buckets:
            self.pg.broadcast(pack_bucket([state[names[i]] for i in idx]), 1).wait()
        self.last_buckets = len(buckets)
        return len(buckets)
