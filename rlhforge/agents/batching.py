"""The batching front of the generation engine shared by the episodes of one ``execute_batch``.

:class:`BatchingEngine` collects single generation requests from concurrent episodes and sends them
to the engine as batches: requests that arrive while a batch is decoding form the next batch. HF/vLLM
generation that runs synchronously (``generate_sync``) runs in a pool of its own
(:func:`_generation_pool`), never in the event loop's default executor nor in the environments'
threads, so environments cannot starve generation.

**Images.** A request may carry the images of its token sequence (``vision=``, a
:class:`rlhforge.data.images.VisionInput`: a multi-turn episode sends the prompt's and every feedback's
images so far). The engine gets ``vision=[VisionInput | None per request]`` only when some request of
the batch has images, so text-only engines keep their two-argument signature.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from rlhforge.rollout.engine import GenerationOutput, SamplingParams

__all__ = ["BatchingEngine"]


class BatchingEngine:
    """Collects single generation requests from concurrent episodes and sends them to the engine
    as batches (module docstring). The HF engine decodes in a worker thread so environment
    coroutines keep running meanwhile."""

    def __init__(self, engine, window_s: float = 0.002):
        self.engine, self.window_s = engine, window_s
        self._pending: list[tuple[list[int], SamplingParams, Any, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None
        self.batches: list[int] = []
        """Size of every batch sent (for metrics and benchmarks)."""

    async def generate_one(self, ids: Sequence[int], sp: SamplingParams, vision=None) -> GenerationOutput:
        """Generate from ``ids`` (whose image tokens stand for ``vision``'s images, if any)."""
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((list(ids), sp, vision, fut))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.ensure_future(self._drain())
        return await fut

    async def _drain(self) -> None:
        while self._pending:
            for _ in range(3):  # let every episode that is ready enqueue its request
                await asyncio.sleep(0)
            if self.window_s:
                await asyncio.sleep(self.window_s)
            batch, self._pending = self._pending, []
            self.batches.append(len(batch))
            visions = [b[2] for b in batch]
            try:
                outs = await self._generate([b[0] for b in batch], [b[1] for b in batch],
                                            visions if any(v is not None for v in visions) else None)
            except Exception as err:  # noqa: BLE001 - every waiting episode sees the engine error
                for *_, fut in batch:
                    if not fut.done():
                        fut.set_exception(err)
                continue
            for (*_, fut), out in zip(batch, outs):
                if not fut.done():
                    fut.set_result(out)

    async def _generate(self, prompts, params, visions=None) -> list[GenerationOutput]:
        kwargs = {} if visions is None else {"vision": visions}
        sync = getattr(self.engine, "generate_sync", None)
        if sync is None:
            return await self.engine.generate(prompts, params, **kwargs)
        import torch

        n_threads = torch.get_num_threads()

        def run():
            torch.set_num_threads(n_threads)  # the thread pool size is per thread
            return sync(prompts, params, **kwargs)

        return await asyncio.get_running_loop().run_in_executor(_generation_pool(), run)


_GENERATION_POOL: ThreadPoolExecutor | None = None
_GENERATION_POOL_LOCK = threading.Lock()


def _generation_pool() -> ThreadPoolExecutor:
    """Threads that only decode (never environment code, never the loop's default executor)."""
    global _GENERATION_POOL
    with _GENERATION_POOL_LOCK:
        if _GENERATION_POOL is None:
            _GENERATION_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rlhforge-generate")
        return _GENERATION_POOL
