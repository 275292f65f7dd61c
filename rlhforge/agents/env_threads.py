"""Threads for synchronous environment code (``def step()``, ``def reset()``, sync constructors, task
rewards, ``run_agent``), apart from generation and from the event loop's default executor.

A call that outlives its timeout *abandons* its thread (Python cannot kill a thread): the thread is
left behind, counted, and replaced, so other samples keep their concurrency; one that returns later
rejoins the pool. Past ``--train.agent_max_stuck_threads`` stuck threads the run stops with
:class:`EnvironmentStuckError`. :class:`~rlhforge.agents.episode.EpisodeContext` is the user.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
from typing import Any, Callable

from rlhforge.agents.types import AgentError

__all__ = ["EnvThreadPool", "EnvironmentStuckError"]


class EnvironmentStuckError(AgentError):
    """More synchronous environment calls hung (threads abandoned) than ``--train.agent_max_stuck_threads``
    allows: the run stops (it is never turned into a dropped sample)."""


class _Worker:
    __slots__ = ("inbox", "abandoned", "name")

    def __init__(self, name: str):
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.abandoned = False
        self.name = name


class _Job:
    __slots__ = ("fn", "args", "kwargs", "what", "loop", "future", "finished", "worker")

    def __init__(self, fn, args, kwargs, what, loop, future):
        self.fn, self.args, self.kwargs, self.what = fn, args, kwargs, what
        self.loop, self.future = loop, future
        self.finished = False
        self.worker: _Worker | None = None


class EnvThreadPool:
    """Daemon threads for synchronous environment code, apart from generation and the loop's default
    executor.

    At most ``max_threads`` threads serve calls (more calls wait for one). A call whose timeout
    passes (or whose episode is cancelled) while its function still runs *abandons* its thread: the
    thread is left to finish (Python cannot kill it), counted in :attr:`stuck`, and no longer counts
    against ``max_threads``, so a fresh thread takes its place. A stuck thread that returns rejoins
    the pool. When a timeout leaves more than ``max_stuck`` threads stuck, that call raises
    :class:`EnvironmentStuckError` naming ``env_name`` and the count. Daemon threads never block
    interpreter exit.
    """

    def __init__(self, max_threads: int = 64, max_stuck: int = 16, env_name: str = "environment"):
        self.max_threads, self.max_stuck, self.env_name = max(1, int(max_threads)), int(max_stuck), env_name
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._serving = 0
        """Threads that are not abandoned (idle, or running a call someone waits for)."""
        self._stuck: dict[_Worker, str] = {}
        self._queue: collections.deque[_Job] = collections.deque()
        self._closed = False
        self.abandoned_total = 0
        """Calls abandoned over the pool's life (stuck now, or returned since)."""
        self.threads_started = 0

    @property
    def stuck(self) -> int:
        """Threads abandoned in a call that has not returned yet."""
        with self._lock:
            return len(self._stuck)

    def stuck_calls(self) -> dict[str, int]:
        """What the stuck threads are running (``"step 1"`` -> count)."""
        with self._lock:
            return dict(collections.Counter(self._stuck.values()))

    def configure(self, *, max_threads: int | None = None, max_stuck: int | None = None,
                  env_name: str | None = None) -> None:
        with self._lock:
            if max_threads is not None:
                self.max_threads = max(1, int(max_threads))
            if max_stuck is not None:
                self.max_stuck = int(max_stuck)
            if env_name is not None:
                self.env_name = env_name

    async def run(self, fn: Callable, args: tuple = (), kwargs: dict | None = None, *, timeout: float,
                  what: str = "call") -> Any:
        """``fn(*args, **kwargs)`` in a pool thread: its result, or its exception re-raised. After
        ``timeout`` s raises ``asyncio.TimeoutError`` (the thread is abandoned), or
        :class:`EnvironmentStuckError` when that leaves more than ``max_stuck`` threads stuck."""
        loop = asyncio.get_running_loop()
        job = _Job(fn, args, kwargs or {}, what, loop, loop.create_future())
        self._submit(job)
        try:
            return await asyncio.wait_for(asyncio.shield(job.future), timeout)
        except asyncio.TimeoutError:
            if self._abandon(job) > self.max_stuck:
                raise self._stuck_error() from None
            raise
        except asyncio.CancelledError:
            self._abandon(job)
            raise

    def _stuck_error(self) -> EnvironmentStuckError:
        calls = ", ".join(f"{what}: {n}" for what, n in sorted(self.stuck_calls().items()))
        n = self.stuck
        return EnvironmentStuckError(
            f"{n} thread{'s are' if n != 1 else ' is'} stuck in synchronous calls of {self.env_name} that never "
            f"returned ({calls}); "
            f"that is more than --train.agent_max_stuck_threads={self.max_stuck}, so the run stops. A timed-out sync "
            "call leaves its thread behind (Python cannot kill it): make the environment's reset/step async (and "
            "await with a timeout), fix what blocks, or raise the cap")

    def _submit(self, job: _Job) -> None:
        with self._lock:
            if self._closed:
                raise AgentError(f"{self.env_name}: the environment thread pool is closed")
            if self._idle:
                worker = self._idle.pop()
            elif self._serving < self.max_threads:
                worker = self._start_worker()
            else:  # every serving thread is busy: the next one that frees up takes it
                self._queue.append(job)
                return
            job.worker = worker
        worker.inbox.put(job)

    def _start_worker(self) -> _Worker:  # under the lock
        self.threads_started += 1
        worker = _Worker(f"rlhforge-env-{self.threads_started}")
        self._serving += 1
        threading.Thread(target=self._work, args=(worker,), daemon=True, name=worker.name).start()
        return worker

    def _abandon(self, job: _Job) -> int:
        """The caller stopped waiting for ``job``; returns the number of stuck threads."""
        handoff = None
        with self._lock:
            if job.worker is None:  # still queued: it never runs
                if job in self._queue:
                    self._queue.remove(job)
                job.finished = True
            elif not job.finished and not job.worker.abandoned:
                job.worker.abandoned = True
                self._stuck[job.worker] = job.what
                self._serving -= 1
                self.abandoned_total += 1
                if self._queue and not self._closed:  # a waiting call gets a fresh thread
                    handoff = self._queue.popleft()
                    handoff.worker = self._start_worker()
            n = len(self._stuck)
        if handoff is not None:
            handoff.worker.inbox.put(handoff)
        return n

    def _work(self, worker: _Worker) -> None:
        job = worker.inbox.get()
        while job is not None:
            try:
                outcome = (True, job.fn(*job.args, **job.kwargs))
            except BaseException as err:  # noqa: BLE001 - handed to the caller
                outcome = (False, err)
            with self._lock:
                job.finished = True
                if worker.abandoned:  # it came back after all: serve again
                    worker.abandoned = False
                    self._stuck.pop(worker, None)
                    self._serving += 1
                nxt, leave = None, False
                if self._queue and not self._closed:
                    nxt = self._queue.popleft()
                    nxt.worker = worker
                elif self._closed or self._serving > self.max_threads:
                    self._serving -= 1
                    leave = True
                else:
                    self._idle.append(worker)
            self._deliver(job, outcome)
            if leave:
                return
            job = nxt if nxt is not None else worker.inbox.get()

    @staticmethod
    def _deliver(job: _Job, outcome) -> None:
        ok, value = outcome

        def settle():
            if not job.future.done():
                if ok:
                    job.future.set_result(value)
                else:
                    job.future.set_exception(value)

        try:
            job.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the caller's loop is closed: nobody is waiting
            pass

    def close(self) -> None:
        """Let idle threads exit (stuck ones are daemons and are left to themselves)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._serving -= len(idle)
            for job in self._queue:
                job.finished = True
            self._queue.clear()
        for worker in idle:
            worker.inbox.put(None)
