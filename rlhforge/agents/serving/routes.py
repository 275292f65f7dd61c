"""The HTTP side shared by rlhforge's agent servers: one helper registers a generation route (JSON body
in, JSON out, errors as OpenAI-style error objects) for the OpenAI-compatible chat route
(:mod:`rlhforge.agents.serving.chat`) and vLLM's token route (:mod:`rlhforge.agents.serving.tokens`), and
:func:`install_guards` puts both under the limits every rlhforge service has (:mod:`rlhforge.net`):

- the body limit (``--train.agent_server_max_body_mb``), counted while the body streams: a
  ``Content-Length`` over it is refused (413) before any of the body is read, a chunked body the moment it
  passes it; the body must arrive within ``body_timeout_s``; a client that leaves mid-body is one log line;
- the optional API key (``--train.agent_server_api_key`` or ``RLHFORGE_AGENT_API_KEY``):
  ``Authorization: Bearer KEY`` (what the ``openai`` client sends) or ``X-API-Key: KEY`` on every route but
  ``/health``, else 401;
- a body that is not JSON (broken, empty, not UTF-8, a lone surrogate, a 5000-digit integer, nesting
  deeper than the interpreter allows) is a 400 with the reason (:func:`rlhforge.net.parse_json`).
"""

# no `from __future__ import annotations`: FastAPI resolves the handlers' `Request` annotations at runtime
import json
import os
from dataclasses import dataclass
from typing import Callable

from rlhforge.net import BodyLimits, HTTPError, RequestGuard, key_matches, parse_json

__all__ = ["add_generation_route", "AgentServerLimits", "install_guards", "API_KEY_ENV"]

#: The agent servers' key when ``--train.agent_server_api_key`` is not given.
API_KEY_ENV = "RLHFORGE_AGENT_API_KEY"


class _HTTPError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True)
class AgentServerLimits:
    """The bounds of one agent server (docs/security.md, "Agent servers")."""

    max_body_bytes: int = 8 * 2**20
    """Largest request body (``--train.agent_server_max_body_mb``); more is a 413 before the body is read."""
    max_message_chars: int = 262_144
    """Longest text of one message, and longest new text one request adds to its session: the most one
    request can make the shared tokenizer work on (``--train.agent_server_max_message_chars``)."""
    api_key: str | None = None
    """Key every request but ``/health`` must carry (None: none)."""
    body_timeout_s: float = 60.0
    """Seconds a request's body may take to arrive (a client trickling its body is refused with 408)."""
    header_timeout_s: float = 10.0
    """Seconds a connection has to send a request's headers (else 408 and closed; rlhforge.net.server)."""

    def __post_init__(self):
        if self.max_body_bytes < 1 or self.max_message_chars < 1 or not self.body_timeout_s > 0 \
                or not self.header_timeout_s > 0:
            raise ValueError(f"AgentServerLimits: max_body_bytes, max_message_chars >= 1, body_timeout_s and "
                             f"header_timeout_s > 0 needed (got {self.max_body_bytes}, {self.max_message_chars}, "
                             f"{self.body_timeout_s}, {self.header_timeout_s})")

    @classmethod
    def from_settings(cls, settings) -> "AgentServerLimits":
        """From :class:`~rlhforge.agents.episode.AgentSettings` (``--train.agent_server_*``; the key falls back
        to ``$RLHFORGE_AGENT_API_KEY``)."""
        return cls(max_body_bytes=int(settings.server_max_body_mb * 2**20),
                   max_message_chars=settings.server_max_message_chars,
                   api_key=settings.server_api_key or os.environ.get(API_KEY_ENV) or None)


def _error_body(status: int, message: str, error_type: str | None = "invalid_request_error") -> dict:
    error = {"message": message, "type": error_type, "code": status} if error_type else {"message": message, "code": status}
    return {"error": error}


class _KeyCheck:
    """ASGI middleware: every HTTP request but ``/health`` carries ``api_key``, else 401."""

    def __init__(self, app, api_key: str):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path") != "/health":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or ()}
            if not key_matches(headers, self.api_key):
                payload = json.dumps(_error_body(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                                 "authentication_error")).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(payload)).encode())]})
                await send({"type": "http.response.body", "body": payload})
                return
        await self.app(scope, receive, send)


def install_guards(app, limits: AgentServerLimits) -> None:
    """Put ``app``'s routes under :class:`rlhforge.net.RequestGuard` (body limit while streaming, body
    deadline, disconnects) and, with a key, the key check (module docstring)."""
    app.add_middleware(RequestGuard, limits=BodyLimits(limits.max_body_bytes, body_timeout_s=limits.body_timeout_s,
                                                       flag="--train.agent_server_max_body_mb"))
    if limits.api_key:
        app.add_middleware(_KeyCheck, api_key=limits.api_key)  # added last: runs first


def add_generation_route(app, path: str, handle: Callable, error_type: str | None = None) -> None:
    """Register a generation route on ``app``: ``POST path`` and ``POST /sessions/{sid}path``.

    The body must be a JSON object; ``await handle(body, sid, request)`` answers it (``sid`` None on
    the plain path). An :class:`_HTTPError` is answered with its status and message, any other
    exception with 500 and its reason (the caller sees why), as ``{"error": {"message", "type",
    "code"}}`` (``type`` only when ``error_type`` is given). ``NaN`` is parsed (the field check then
    names the field it is in)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    def err(status: int, message: str, headers: dict | None = None):
        return JSONResponse(status_code=status, content=_error_body(status, message, error_type), headers=headers)

    async def answer(request: Request, sid: str | None = None):
        try:
            body = parse_json(await request.body(), allow_nan=True)  # ClientGone goes on to RequestGuard
        except HTTPError as e:  # 400 (not JSON), 413 (too large), 408 (too slow)
            return err(e.status, str(e), e.headers)
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
