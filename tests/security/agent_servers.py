"""A running agent server for the security tests: :class:`~rlhforge.agents.serving.chat.ChatServer` or
:class:`~rlhforge.agents.serving.tokens.TokenServer` over the tiny model's HF engine, bound to an event loop
in a background thread (as the trainer binds it to its rollout loop), so a plain ``httpx.Client`` in the
test thread can drive it. Also used by ``benchmarks/bench_agent_server_isolation.py``."""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager

from rlhforge.agents.batching import BatchingEngine
from rlhforge.agents.serving.routes import AgentServerLimits
from rlhforge.agents.serving.chat import ChatServer
from rlhforge.agents.serving.tokens import TokenServer
from rlhforge.rollout.engine import SamplingParams


@contextmanager
def running_server(model_dir, kind: str = "chat", limits: AgentServerLimits | None = None, sessions: int = 0,
                   budget: int = 64, max_len: int | None = 2048):
    """Yields ``(server, sids)``: the server started and bound, ``sessions`` sessions open (their ids; each may
    hold ``max_len`` tokens, the tiny model's context: a longer prompt gets an empty completion). torch runs
    on one thread meanwhile (restored after): on the shared 2-core test machine, intra-op threads waiting on
    each other make the engine's latency jitter by hundreds of milliseconds."""
    import torch
    from transformers import AutoTokenizer

    from rlhforge.rollout.hf_engine import HFEngine

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = HFEngine.from_pretrained(str(model_dir), tok)
    server = (TokenServer if kind == "tokens" else ChatServer)(tok, "policy", None, limits=limits)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True, name="agent-server-test-loop")
    thread.start()
    server.start()
    batching = asyncio.run_coroutine_threadsafe(_make_batching(engine), loop).result(30)
    server.bind(loop, batching.generate_one)
    sids = [server.open_session(SamplingParams(max_new_tokens=budget, seed=7 + i), budget, max_len).sid
            for i in range(sessions)]
    try:
        yield server, sids
    finally:
        server.stop()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        torch.set_num_threads(threads)


async def _make_batching(engine) -> BatchingEngine:
    return BatchingEngine(engine)
