"""HTTP service over :class:`~rlhforge.agents.sandbox.Sandbox` (``rlhforge serve-sandbox``): the
code-execution server of tool-integrated rollouts, run on machines other than the trainer's.

``POST /run`` with JSON ``{"code": "print(1)", "limits": {"timeout_s": 5, "memory_bytes": 268435456}}``
(``limits`` optional, any of :data:`~rlhforge.agents.sandbox.config.PER_CALL_LIMITS`; a top-level
``timeout_s`` is accepted too) runs the code in a fresh sandboxed process and answers::

    {"result": {"stdout": "1\\n", "stderr": "", "exit_code": 0, "timed_out": false, ...},
     "limits": {"timeout_s": 5.0, ...}}

``result`` holds every :class:`SandboxResult` field; ``limits`` the limits the call ran under. The
server's own limits are maxima: a call may lower them, never raise them (a request for more gets
the server's value, visible in ``limits`` and ``result.time_limit_s``).

``GET /health`` (no key needed): ``{"status": "ok", "isolation", "running", "queued", "concurrency",
"max_queue", "limits", "calls", "rejected", "cancelled", "failed"}``.

Load: at most ``concurrency`` calls run at once; up to ``max_queue`` more wait for a slot; beyond
that the answer is ``503 {"error": "busy ..."}`` with ``Retry-After``. A client that disconnects
(its timeout expired) has its call stopped, queued or running, and the code's processes killed.

Errors: a body that is not JSON (any kind of broken: :func:`rlhforge.net.payload.parse_json`), has no
``code`` string or bad ``limits`` gets 400; a body over the size bound (4 x ``max_code_bytes`` + 64 KiB)
413, counted while it streams; a body not complete within ``body_timeout_s`` 408; a client that leaves
mid-body one log line (:mod:`rlhforge.net.guard`); a missing or wrong key (``--api_key``: ``Authorization: Bearer KEY`` or
``X-API-Key: KEY``) 401; a sandbox that cannot run here 500 (the client then tries another server).
What the code itself does (crash, hang, memory hog) is a normal 200 result, as with the local sandbox.
"""

# No ``from __future__ import annotations``: FastAPI must see the real ``Request`` annotation of the
# route functions, which are defined inside ``create_app`` (fastapi is imported lazily).
import asyncio
import contextlib
import logging
from typing import Any

from rlhforge.net.errors import BadRequest
from rlhforge.net.guard import BodyLimits, RequestGuard
from rlhforge.net.payload import parse_json
from rlhforge.net.server import key_matches, start_server_thread

from .config import PER_CALL_LIMITS, SandboxConfig, SandboxUnavailableError, clamp_limits, result_to_dict
from .runner import Sandbox

__all__ = ["create_app", "start_service_thread", "parse_run_request"]

logger = logging.getLogger("rlhforge.agents.sandbox.server")


_BadRequest = BadRequest


def parse_run_request(body: bytes, ceiling: SandboxConfig) -> tuple[str, dict]:
    """``(code, limits)`` of a ``/run`` body; ``limits`` already lowered to ``ceiling``'s values."""
    payload = parse_json(body)  # every kind of broken JSON a 400 with its reason (rlhforge.net.payload)
    if not isinstance(payload, dict):
        raise _BadRequest(f"expected a JSON object with a 'code' string, got {type(payload).__name__}")
    code = payload.get("code")
    if not isinstance(code, str):
        raise _BadRequest("missing 'code' (a string)" if code is None
                          else f"'code' must be a string, got {type(code).__name__}")
    limits = payload.get("limits") or {}
    if not isinstance(limits, dict):
        raise _BadRequest(f"'limits' must be an object, got {type(limits).__name__}")
    if payload.get("timeout_s") is not None:
        limits = {**limits, "timeout_s": payload["timeout_s"]}
    try:
        return code, clamp_limits(limits, ceiling)
    except ValueError as err:
        raise _BadRequest(str(err)) from None


class _Gate:
    """``concurrency`` calls at once, ``max_queue`` waiting; the rest is turned away. Used from the
    server's one event loop only; admission is synchronous, so the bound is exact."""

    def __init__(self, concurrency: int, max_queue: int):
        self.concurrency, self.max_queue = concurrency, max_queue
        self.running = self.waiting = 0
        self._sem: asyncio.Semaphore | None = None

    def admit(self) -> dict | None:
        """A ticket (counted as waiting) or None when running + waiting is at the bound."""
        if self.running + self.waiting >= self.concurrency + self.max_queue:
            return None
        self.waiting += 1
        return {"queued": True}

    async def acquire(self, ticket: dict) -> None:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.concurrency)
        await self._sem.acquire()
        ticket["queued"] = False
        self.waiting -= 1
        self.running += 1

    def release(self) -> None:
        self.running -= 1
        self._sem.release()

    def leave(self, ticket: dict) -> None:
        """The request is over: uncount it if it never got a slot."""
        if ticket["queued"]:
            ticket["queued"] = False
            self.waiting -= 1


async def _disconnected(request) -> None:
    """Returns when the client has gone (after the body was read, the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(sandbox: Sandbox, *, api_key: str | None = None, concurrency: int = 4, max_queue: int = 16,
               retry_after_s: int = 1, max_body_bytes: int | None = None, body_timeout_s: float = 60.0):
    """The FastAPI application (routes, limits and load shedding as in the module docstring).
    ``sandbox.config`` holds the maxima a call may ask for."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    if concurrency < 1 or max_queue < 0:
        raise ValueError(f"concurrency must be >= 1 and max_queue >= 0 (got {concurrency}, {max_queue})")
    ceiling = sandbox.config
    body_cap = max_body_bytes or 4 * ceiling.max_code_bytes + 65536  # JSON escapes can quadruple the code
    gate = _Gate(concurrency, max_queue)
    counters = {"calls": 0, "rejected": 0, "cancelled": 0, "failed": 0}

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        mode = await sandbox.start()  # probe the isolation before accepting calls (fails the start-up)
        logger.info("sandbox service: isolation %s (%s)", mode, sandbox.layers)
        yield

    app = FastAPI(title="rlhforge sandbox service", lifespan=lifespan)
    app.state.gate, app.state.counters = gate, counters
    # body size counted while it streams, read deadline, mid-body disconnects: rlhforge.net.guard
    app.add_middleware(RequestGuard, limits=BodyLimits(body_cap, body_timeout_s, "--max_code_bytes"))

    def authorised(request: Request) -> bool:
        return key_matches(request.headers, api_key)

    def ceiling_limits() -> dict[str, Any]:
        return {k: getattr(ceiling, k) for k in PER_CALL_LIMITS}

    @app.get("/health")
    async def health():
        return {"status": "ok", "isolation": sandbox.isolation, "running": gate.running, "queued": gate.waiting,
                "concurrency": gate.concurrency, "max_queue": gate.max_queue, "limits": ceiling_limits(), **counters}

    @app.post("/run")
    async def run(request: Request):
        if not authorised(request):
            return JSONResponse({"error": "missing or invalid API key (send 'Authorization: Bearer KEY')"},
                                status_code=401)
        chunks = [chunk async for chunk in request.stream()]  # bounded by RequestGuard (413 / 408 / ClientGone)
        try:
            code, limits = parse_run_request(b"".join(chunks), ceiling)
        except _BadRequest as err:
            return JSONResponse({"error": str(err)}, status_code=400)
        ticket = gate.admit()
        if ticket is None:
            counters["rejected"] += 1
            return JSONResponse({"error": f"busy: {gate.running} calls running, {gate.waiting} queued "
                                          f"(--concurrency {gate.concurrency}, --max_queue {gate.max_queue})"},
                                status_code=503, headers={"Retry-After": str(retry_after_s)})

        async def call():
            await gate.acquire(ticket)
            try:
                return await sandbox.run(code, limits=limits)
            finally:
                gate.release()

        work = asyncio.ensure_future(call())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():  # the client left (or the server is stopping): stop the code
                work.cancel()
                counters["cancelled"] += 1
                await asyncio.gather(work, return_exceptions=True)
            gate.leave(ticket)
        if work.cancelled():
            return Response(status_code=499)
        try:
            result = work.result()
        except (SandboxUnavailableError, ValueError) as err:
            counters["failed"] += 1
            status = 400 if isinstance(err, ValueError) else 500
            return JSONResponse({"error": f"{type(err).__name__}: {err}"}, status_code=status)
        counters["calls"] += 1
        applied = {**ceiling_limits(), **limits}
        applied["timeout_s"] = result.time_limit_s if result.time_limit_s is not None else applied["timeout_s"]
        return {"result": result_to_dict(result), "limits": applied}

    return app


def start_service_thread(app, host: str = "127.0.0.1", port: int = 0, timeout: float = 60.0,
                         log_level: str = "warning"):
    """Run ``app`` with uvicorn in a daemon thread; returns once it accepts connections (``port=0``:
    a free port); a :class:`~rlhforge.net.server.ServerHandle` (``base_url``, ``url`` of ``/run``,
    ``stop()``). Raises RuntimeError if it does not start (e.g. the sandbox cannot run here)."""
    return start_server_thread(app, host, port, timeout, log_level, route="/run", name="sandbox service")
