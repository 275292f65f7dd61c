"""The agent servers' tokenizer work, off their event loop (:class:`TokenizerThreads`).

A chat request's template rendering, tokenisation and decoding run in a few worker threads of the server's
own, each with a private copy of the tokenizer: the server's event loop keeps answering other sessions while
one request makes the tokenizer work, the trainer's tokenizer lock is not held meanwhile, and the threads do
not wait for each other (the tokenizers library releases the GIL while it encodes). Called from any other
thread, the same methods use the shared tokenizer under the shared lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

__all__ = ["TokenizerThreads"]


class TokenizerThreads:
    """``threads`` worker threads with one tokenizer copy each (started by :meth:`start`, all copies made
    before it returns) and the three tokenizer calls the servers make."""

    def __init__(self, tokenizer, lock: Any, threads: int = 4):
        self.tokenizer, self.lock, self.threads = tokenizer, lock, threads
        self._local = threading.local()
        self._pool: ThreadPoolExecutor | None = None

    def start(self) -> None:
        if self._pool is not None:
            return
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="rlhforge-agent-tokenizer",
                                  initializer=self._init_thread)
        barrier = threading.Barrier(self.threads)  # every thread started, so every copy made, before a request
        for f in [pool.submit(barrier.wait, 60) for _ in range(self.threads)]:
            f.result()
        self._pool = pool

    def stop(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _init_thread(self) -> None:
        with self.lock:
            self._local.tok = copy.deepcopy(self.tokenizer)

    async def run(self, fn: Callable, *args):
        """``fn(*args)`` in one of the threads (started on first use when :meth:`start` was not called)."""
        if self._pool is None:
            await asyncio.to_thread(self.start)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _tok(self):
        tok = getattr(self._local, "tok", None)
        return (tok, contextlib.nullcontext()) if tok is not None else (self.tokenizer, self.lock)

    def render(self, messages, tools) -> str:
        kwargs = {"tools": tools} if tools else {}
        tok, lock = self._tok()
        with lock:
            return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)

    def encode(self, text: str) -> list[int]:
        tok, lock = self._tok()
        with lock:
            return list(tok.encode(text, add_special_tokens=False))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        tok, lock = self._tok()
        with lock:
            return tok.decode(list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
