"""The ``WorkerGroup`` seam and the in-process group; length-balanced sharding.

A worker group holds the data-parallel ranks of one model (actor, critic or reference). The RL
loop only ever talks to a group::

    group.call("save_state", path)              # same arguments on every rank -> [result per rank]
    group.map_gather("logprobs", samples, ...)  # shard samples over ranks, results in input order
    group.map_train("train_step", samples, ...) # shard one optimizer step's samples -> [metrics per rank]

:class:`InProcessGroup` is one worker in this process (the laptop / single-device path);
:class:`~rlhforge.distributed.ray_group.RayWorkerGroup` is N Ray actors with a process group
between them. Both shard with :func:`balanced_shards`: every rank gets the same number of samples
(ZeRO-3 needs every rank to run the same number of forward passes) and about the same number of
tokens. Where the samples do not divide evenly, shards are topped up with padding copies: for
inference their results are dropped, for training they carry a zero loss mask (so they add nothing
to the loss or to the global token count).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["InProcessGroup", "GroupCheckpoint", "balanced_shards", "zero_weight_copy", "WorkerError"]


class WorkerError(RuntimeError):
    """A worker of a group failed (its process died, or its method raised)."""


def balanced_shards(lengths: Sequence[int], world: int) -> list[list[int]]:
    """Indices of ``lengths`` split into ``world`` shards of equal size (+-1) and balanced tokens.

    Longest first, dealt in snake order (0, 1, ..., w-1, w-1, ..., 0); each shard keeps its indices
    in input order. Deterministic. ``world == 1`` returns everything in order."""
    if world < 1:
        raise ValueError(f"world must be >= 1 (got {world})")
    if world == 1:
        return [list(range(len(lengths)))]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    shards: list[list[int]] = [[] for _ in range(world)]
    for pos, idx in enumerate(order):
        rnd, k = divmod(pos, world)
        shards[k if rnd % 2 == 0 else world - 1 - k].append(idx)
    return [sorted(s) for s in shards]


def zero_weight_copy(sample):
    """A padding copy of an experience sample that contributes nothing to a training step."""
    pad = copy.copy(sample)
    pad.loss_mask = [0] * len(sample.loss_mask)
    pad.tensors = dict(sample.tensors)
    return pad


def pad_shards(items: Sequence, shards: list[list[int]], pad: Callable[[Any], Any] | None
               ) -> tuple[list[list], list[int]]:
    """Shards of items, each topped up to the largest size; returns them and each one's real count."""
    size = max(len(s) for s in shards)
    out, real = [], []
    for s in shards:
        chunk = [items[i] for i in s]
        real.append(len(chunk))
        filler = items[s[-1]] if s else items[0]
        while len(chunk) < size:
            chunk.append(pad(filler) if pad is not None else filler)
        out.append(chunk)
    return out, real


def lengths_of(items: Sequence) -> list[int]:
    return [len(x) if hasattr(x, "__len__") else 1 for x in items]


class InProcessGroup:
    """A worker group of one worker living in this process."""

    def __init__(self, worker, name: str = "worker"):
        self.workers = [worker]
        self.name = name
        self.world_size = 1

    def call(self, method: str, *args, **kwargs) -> list[Any]:
        return [getattr(w, method)(*args, **kwargs) for w in self.workers]

    def map_gather(self, method: str, items: Sequence, *args, **kwargs) -> list[Any]:
        return list(getattr(self.workers[0], method)(list(items), *args, **kwargs))

    def map_train(self, method: str, items: Sequence, *args, **kwargs) -> list[Any]:
        return [getattr(self.workers[0], method)(list(items), *args, **kwargs)]

    def gather_weights(self) -> dict:
        """The full state dict of the model (for the engines)."""
        return self.call("engine_state_dict")[0]

    @property
    def local(self):
        """The worker living in this process."""
        return self.workers[0]

    def close(self) -> None:
        pass


class GroupCheckpoint:
    """Adapter so ``backend.checkpoint`` saves an actor group's (and a critic group's) state into one
    step folder. The trainer is the single controller: every rank of each group saves its shard
    through the group, so the driver acts as rank 0 and needs no barrier (group calls return when
    all ranks are done)."""

    rank, is_rank0 = 0, True

    def __init__(self, actor, critic=None):
        self.actor, self.critic = actor, critic

    def barrier(self):
        pass

    def save_state(self, directory: Path) -> None:
        self.actor.call("save_state", directory)
        if self.critic is not None:
            self.critic.call("save_state", Path(directory) / "critic")

    def load_state(self, directory: Path) -> None:
        self.actor.call("load_state", directory)
        if self.critic is not None:
            self.critic.call("load_state", Path(directory) / "critic")
