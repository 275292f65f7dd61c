"""Where the RL loop gets its next rollout batch: generated on demand (sync) or ahead (async).

Weights *version* ``v`` = the number of RL steps whose update has been synced into the engines.
The batch trained at step ``k`` was generated with version ``v_k``; its **staleness** is
``k - v_k``.

- :class:`SyncRollouts`: batch ``k`` is generated when step ``k`` asks for it, with version ``k``
  (staleness 0).
- :class:`AsyncRollouts` (``--train.async_enable``): a generator thread produces batches ahead of
  the trainer. It may *start* batch ``k`` once version ``k - queue_size`` is in the engines, so
  generation of the next batches overlaps training of this one and the staleness of every batch
  is at most ``async_queue_size`` (checked when the batch is taken; a violation is a bug and
  raises). While it generates a batch it holds the engine lock, so a weight sync waits for the
  batch to finish; with ``--train.partial_rollout_enable`` it does not, and a sync pauses the
  in-flight generation between two decoding steps, loads the new weights, and generation resumes
  with them (tokens of one response may then come from two versions; each batch reports the
  version it started and ended with, and rollout-vs-trainer IS correction,
  ``--algo.advantage.is_correction_level``, is the usual remedy).

``produce() -> (trajs, metrics, stream_position[, carry])`` is the trainer's own rollout function;
``carry`` (optional) is the stream positions of prompt groups generated but kept for later steps
(oversampling, :class:`~rlhforge.trainers.rl.prompts.GroupBuffer`), recorded per batch so that a
checkpoint taken after batch ``k`` names exactly the groups still buffered after it (the async
generator may already be further on).
An exception in the generator thread is raised again from :meth:`AsyncRollouts.next`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["RolloutBatch", "SyncRollouts", "AsyncRollouts"]


@dataclass
class RolloutBatch:
    index: int
    """Which RL step this batch is for (0-based)."""
    trajs: list
    metrics: dict[str, float]
    stream_position: int
    """Prompt-stream position after this batch (what a checkpoint taken after it records)."""
    version_start: int
    version_end: int
    generation_s: float
    extra: dict[str, Any] = field(default_factory=dict)
    carry: list[int] = field(default_factory=list)
    """Stream positions of the prompt groups still buffered after this batch (oversampling)."""


Produce = Callable[[], tuple]


def _unpack(out: tuple) -> tuple[list, dict, int, list[int]]:
    trajs, metrics, pos, *rest = out
    return trajs, metrics, pos, list(rest[0]) if rest else []


class SyncRollouts:
    def __init__(self, produce: Produce):
        self.produce = produce
        self.version = 0

    def start(self, first_index: int, version: int) -> None:
        self.version = version

    def synced(self, version: int) -> None:
        self.version = version

    def next(self, index: int) -> RolloutBatch:
        t = time.perf_counter()
        trajs, metrics, pos, carry = _unpack(self.produce())
        return RolloutBatch(index, trajs, metrics, pos, self.version, self.version, time.perf_counter() - t,
                            carry=carry)

    def close(self) -> None:
        pass


class AsyncRollouts:
    def __init__(self, produce: Produce, *, queue_size: int, total: int, engine_lock: threading.Lock,
                 partial: bool = False):
        if queue_size < 1:
            raise ValueError(f"async queue size must be >= 1 (got {queue_size})")
        self.produce, self.queue_size, self.total = produce, queue_size, total
        self.engine_lock, self.partial = engine_lock, partial
        self._cond = threading.Condition()
        self._ready: dict[int, RolloutBatch] = {}
        self._version = 0
        self._next_index = 0
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None

    # -- trainer side -----------------------------------------------------------------------------
    def start(self, first_index: int, version: int) -> None:
        self._next_index, self._version = first_index, version
        self._thread = threading.Thread(target=self._generate_loop, name="rlhforge-rollout", daemon=True)
        self._thread.start()

    def synced(self, version: int) -> None:
        with self._cond:
            self._version = version
            self._cond.notify_all()

    def next(self, index: int) -> RolloutBatch:
        t = time.perf_counter()
        with self._cond:
            while index not in self._ready and self._error is None:
                self._cond.wait(timeout=1.0)
            if self._error is not None and index not in self._ready:
                raise self._error
            batch = self._ready.pop(index)
            self._cond.notify_all()
        staleness = index - batch.version_start
        if staleness > self.queue_size or staleness < 0:
            raise RuntimeError(f"async rollout batch {index} was generated with weights version {batch.version_start}: "
                               f"staleness {staleness} outside [0, {self.queue_size}]")
        batch.extra["wait_s"] = time.perf_counter() - t
        return batch

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=600)

    # -- generator thread -------------------------------------------------------------------------
    def _generate_loop(self) -> None:
        try:
            while True:
                with self._cond:
                    k = self._next_index
                    while not self._stop and k < self.total and self._version < k - self.queue_size:
                        self._cond.wait(timeout=1.0)
                    if self._stop or k >= self.total:
                        return
                t = time.perf_counter()
                if self.partial:
                    v0 = self._version
                    trajs, metrics, pos, carry = _unpack(self.produce())
                    v1 = self._version
                else:
                    with self.engine_lock:
                        v0 = self._version
                        trajs, metrics, pos, carry = _unpack(self.produce())
                        v1 = self._version
                batch = RolloutBatch(k, trajs, metrics, pos, v0, v1, time.perf_counter() - t, carry=carry)
                with self._cond:
                    self._ready[k] = batch
                    self._next_index = k + 1
                    self._cond.notify_all()
        except BaseException as err:  # noqa: BLE001 - handed to the trainer thread
            with self._cond:
                self._error = err
                self._cond.notify_all()
