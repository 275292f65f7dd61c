"""The ``Strategy`` seam: how a model is wrapped, stepped, reduced, gathered and checkpointed.

Trainers talk only to this protocol. The loss contract: a trainer scales each micro-batch's summed
loss by ``world_size / global_count`` (global token or sample count of the whole optimizer step);
strategies sum gradients over micro-batches and *average* them over ranks, so the step's gradient is the gradient of the global mean, whatever the number of
ranks or micro-batches.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import Iterator, Any, Protocol

import torch


class Strategy(Protocol):
    rank: int
    world_size: int
    device: torch.device
    dtype: torch.dtype

    @property
    def is_rank0(self) -> bool: ...

    def prepare(self, model: torch.nn.Module, total_steps: int) -> torch.nn.Module:
        """Wrap ``model`` and build its optimizer and scheduler; returns the module to call."""

    @property
    def module(self) -> torch.nn.Module:
        """The unwrapped model (HF / peft), for saving and generation."""

    def autocast(self) -> AbstractContextManager: ...

    def model_init(self) -> AbstractContextManager:
        """Load the model inside this: DeepSpeed ZeRO-3 partitions it as it loads (``zero.Init``)."""

    def backward(self, loss: torch.Tensor, is_last_micro_batch: bool) -> None: ...

    def step(self) -> dict[str, float]:
        """Clip, optimizer step, scheduler step, zero grads; returns ``grad_norm``, ``lr`` and ``skipped``
        (1.0: the loss or the gradient norm was not finite on some rank, so nothing was stepped)."""

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor: ...

    def barrier(self) -> None: ...

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full (gathered) CPU state dict of the unwrapped model on rank 0, None elsewhere."""

    def iter_full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) of every state-dict entry on *every* rank (all ranks iterate to the end:
        sharded parameters are gathered one at a time), in the training dtype on the training device;
        each tensor is valid until the next one is asked for (weight sync streams them)."""

    def save_state(self, directory: Path) -> None:
        """Write model weights, optimizer and scheduler state (all ranks take part)."""

    def load_state(self, directory: Path) -> None: ...

    def train(self) -> None: ...

    def eval(self) -> None: ...


def reduce_op(op: str):
    import torch.distributed as dist

    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op == "mean":
        return dist.ReduceOp.SUM
    if op not in ops:
        raise ValueError(f"unknown reduce op {op!r}; valid: sum, mean, max, min")
    return ops[op]


def collective_device() -> torch.device:
    """The device the default process group's collectives take: the current CUDA device on NCCL, else CPU."""
    import torch.distributed as dist

    from rlhforge.backend.strict_device import backend_device_type

    if dist.is_available() and dist.is_initialized() and backend_device_type(dist.get_backend()) == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_tensor(tensor: torch.Tensor, op: str, world_size: int,
                      device: torch.device | str | None = None) -> torch.Tensor:
    """All-reduce a copy of ``tensor`` (identity on one process); ``mean`` divides the sum. The copy goes
    to ``device`` (the group's: a strategy's own device; default :func:`collective_device`) for the
    collective, so a host tensor is fine on NCCL, and the result comes back on ``tensor``'s device."""
    import torch.distributed as dist

    from rlhforge.backend.strict_device import place

    if not (world_size > 1 and dist.is_initialized()):
        return tensor.detach().clone()
    out = place(tensor.detach().clone(), device if device is not None else collective_device())
    dist.all_reduce(out, op=reduce_op(op))
    if op == "mean":
        out /= world_size
    return out.to(tensor.device)


def barrier(world_size: int) -> None:
    import torch.distributed as dist

    if world_size > 1 and dist.is_initialized():
        dist.barrier()


def clip_and_step(module: torch.nn.Module, optimizer, scheduler, max_norm: float) -> dict[str, float]:
    """Clip the global grad norm (0: no clipping), step optimizer and scheduler, zero the grads.
    Works for plain and DTensor (FSDP2) parameters. Returns the pre-clip norm, the lr used and
    ``skipped``: 1.0 when the norm is not finite, in which case neither the optimizer nor the
    scheduler steps (:mod:`rlhforge.backend.guards`). The norm is already the same on every rank
    (DDP averages the gradients, FSDP2's is the full tensor's), so every rank decides alike without
    another collective."""
    from rlhforge.backend.guards import all_ranks_finite

    params = [p for p in module.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    lr = scheduler.get_last_lr()[0]
    finite = all_ranks_finite(norm)
    if finite:
        optimizer.step()
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return {"grad_norm": float(norm), "lr": float(lr), "skipped": 0.0 if finite else 1.0}
