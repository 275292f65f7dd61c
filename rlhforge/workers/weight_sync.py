"""Weight-sync channels from the actor's Ray workers (rank 0 sends) to whoever generates.

Two receivers, one mechanism (:mod:`rlhforge.backend.collective`: a standalone group with its own
``TCPStore`` hosted by actor rank 0, the layout then one broadcast per ``--vllm.sync_bucket_mb``
bucket; ZeRO-3 shards are all-gathered one parameter at a time by every rank first):

- **engine actors** (:mod:`rlhforge.distributed.engine_actors`): the group is actor rank 0 plus
  every worker of every engine (world ``1 + engines x TP``), gloo on CPU engines, NCCL on GPU
  engines (``--vllm.sync_backend``). The driver only starts the calls; no weight passes through it.
- **the driver's in-process engine** (HF, or vLLM without Ray): a two-member gloo group, actor
  rank 0 and the driver (:class:`DriverReceiver`), which hands the tensors to the engine.

``--vllm.sync_with_ray`` sends the state dict through Ray's object store instead (a full copy passes
through the object store; with engine actors it goes from rank 0's return value straight to the
engines' calls, not through the driver's memory).
"""

from __future__ import annotations

import torch

from rlhforge.backend.collective import SyncGroup, pack_bucket, plan_buckets, unpack_bucket

__all__ = ["DriverReceiver", "plan_buckets", "pack_bucket", "unpack_bucket"]


class DriverReceiver:
    """The driver's end of a two-member group (rank 1; actor rank 0 hosts the store at ``host:port``)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.group: SyncGroup | None = None

    def connect(self) -> None:
        """Blocks until the sender has joined (run it while the sender's ``open_weight_channel`` runs)."""
        self.group = SyncGroup(self.host, self.port, 1, 2, "gloo", "cpu")

    def receive(self) -> dict[str, torch.Tensor]:
        return dict(self.group.receive())
