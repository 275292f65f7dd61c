"""Weight sync by CUDA IPC: engines that share their GPUs with the actor's ranks (``--train.colocate_all``
on GPUs, OpenRLHF's hybrid engine).

NCCL cannot put two members of one group on the same GPU, so a colocated engine is not fed over the
sync group: every actor rank streams the same weights (ZeRO-3 parameters gathered one at a time),
packs each bucket into one buffer on its own GPU and shares a CUDA IPC handle to it; rank 0 gathers
the handles over the training group and has every engine load the bucket, each engine worker from the
rank on its GPU (``{tp_rank: actor_rank}``, from the placement plan). The buffers are freed after a
barrier, so each GPU holds one bucket beyond the model. GPU only (the CPU build has no CUDA IPC); the
GPU check (benchmarks/gpu/check_rl.sh) exercises it.
"""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["stream_ipc"]


def stream_ipc(named: Iterable, targets: list | None, bucket_bytes: int, *, rank: int, world_size: int,
               fingerprint: bool = False) -> int:
    """Every actor rank calls this with the same stream; ``targets`` (rank 0): ``[(engine actor handle,
    {tp_rank: actor_rank}), ...]``. Returns the number of buckets."""
    import ray
    import torch.distributed as dist
    from torch.multiprocessing.reductions import reduce_tensor

    from rlhforge.backend.collective import stream_buckets

    buckets = 0
    for entries, buf, last in stream_buckets(named, bucket_bytes, torch.device("cuda", torch.cuda.current_device())):
        torch.cuda.synchronize()
        handle = reduce_tensor(buf) if buf is not None else None
        gathered = [handle]
        if world_size > 1:
            gathered = [None] * world_size
            dist.all_gather_object(gathered, handle)
        if rank == 0:
            refs = [engine.load_ipc.remote(entries, {t: gathered[r] for t, r in ranks.items()}, fingerprint, last)
                    for engine, ranks in (targets or [])]
            ray.get(refs)
        if world_size > 1:
            dist.barrier()  # every engine has copied the bucket out: the buffer may go
        buckets += bool(entries)
        del buf, handle
    return buckets
