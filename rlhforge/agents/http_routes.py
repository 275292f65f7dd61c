"""The HTTP side shared by rlhforge's rollout servers: one helper registers a generation route
(JSON body in, JSON out, errors as OpenAI-style error objects) for the OpenAI-compatible chat route
(:mod:`rlhforge.agents.openai_server`) and vLLM's token route (:mod:`rlhforge.agents.token_server`).
"""

# no `from __future__ import annotations`: FastAPI resolves the handlers' `Request` annotations at runtime
from typing import Callable

__all__ = ["add_generation_route"]


class _HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def add_generation_route(app, path: str, handle: Callable, error_type: str | None = None) -> None:
    """Register a generation route on ``app``: ``POST path`` and ``POST /sessions/{sid}path``.

    The body must be a JSON object; ``await handle(body, sid, request)`` answers it (``sid`` None on
    the plain path). An :class:`_HTTPError` is answered with its status and message, any other
    exception with 500 and its reason (the caller sees why), as ``{"error": {"message", "type",
    "code"}}`` (``type`` only when ``error_type`` is given)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    def err(status: int, message: str):
        error = {"message": message, "type": error_type, "code": status} if error_type else \
            {"message": message, "code": status}
        return JSONResponse(status_code=status, content={"error": error})

    async def answer(request: Request, sid: str | None = None):
        try:
            body = await request.json()
        except Exception:  # noqa: BLE001
            return err(400, "the body must be JSON")
        if not isinstance(body, dict):
            return err(400, "the body must be a JSON object")
        try:
            return await handle(body, sid, request)
        except _HTTPError as e:
            return err(e.status, e.message)
        except Exception as e:  # noqa: BLE001 - the caller sees a 500 with the reason
            return err(500, f"{type(e).__name__}: {e}")

    @app.post(path)
    async def plain(request: Request):
        return await answer(request)

    @app.post("/sessions/{sid}" + path)
    async def in_session(sid: str, request: Request):
        return await answer(request, sid)
