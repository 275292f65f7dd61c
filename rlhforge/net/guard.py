"""The ASGI middleware every rlhforge service runs its routes under (:class:`RequestGuard`).

It wraps the request's ``receive`` so that whatever way a route reads the body (``request.body()``,
``request.stream()``, ``request.json()``), the same rules hold:

- **size**: a ``Content-Length`` over ``max_body_bytes`` is refused (413) at the first read, before any of
  the body is taken; a body without one (chunked) is counted as it arrives and refused the moment it passes
  the limit, so at most ``max_body_bytes`` (+ one chunk) is ever held;
- **time**: the whole body must arrive within ``body_timeout_s`` of the first read, else 408 (a client that
  trickles its body a byte at a time cannot hold a connection and a request slot forever);
- **disconnect**: a client that closes the connection before its body is complete ends the request with
  one WARNING line (``rlhforge.net`` logger, no traceback) and :class:`~rlhforge.net.errors.ClientGone`, never a
  traceback and never a 500;
- **errors**: an :class:`~rlhforge.net.errors.HTTPError` a route lets through is answered as
  ``{error_key: message}`` with its status (``error_key`` ``"error"``, or ``"detail"`` for serve-tinker);
- **connection reuse**: an answer sent before the body was read whole closes the connection when more than
  ``drain_bytes`` (or an unknown amount) of body is still to come (``Connection: close``); a smaller rest is
  read and discarded by the server, so the next request on that connection is served.

Header time (slow loris before the body) is bounded by the protocol of :mod:`rlhforge.net.server`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

from rlhforge.net.errors import BodyTimeout, BodyTooLarge, ClientGone, HTTPError

__all__ = ["BodyLimits", "RequestGuard"]

log = logging.getLogger("rlhforge.net")


@dataclass(frozen=True)
class BodyLimits:
    """Per-request bounds of :class:`RequestGuard` (``flag``: the option that sets ``max_body_bytes``,
    named in the 413's message)."""

    max_body_bytes: int
    body_timeout_s: float = 60.0
    flag: str = "--max_request_bytes"
    drain_bytes: int = 1 << 20

    def __post_init__(self):
        if self.max_body_bytes < 1 or not self.body_timeout_s > 0 or self.drain_bytes < 0:
            raise ValueError(f"BodyLimits: max_body_bytes >= 1, body_timeout_s > 0 and drain_bytes >= 0 needed "
                             f"(got {self.max_body_bytes}, {self.body_timeout_s}, {self.drain_bytes})")


class _Body:
    """One request's body as the guard has seen it."""

    def __init__(self, scope, limits: BodyLimits):
        self.limits = limits
        self.declared: int | None = None
        self.bad_length: str | None = None
        chunked = False
        for name, value in scope.get("headers") or ():
            if name == b"content-length":
                try:
                    self.declared = int(value)
                except ValueError:
                    self.bad_length = value.decode("latin-1")[:40]
            elif name == b"transfer-encoding":
                chunked = True
        if self.declared is None and not chunked and self.bad_length is None:
            self.declared = 0  # HTTP/1.1: no length and not chunked is an empty body
        self.received = 0
        self.complete = self.declared == 0
        self.deadline: float | None = None

    def still_to_come(self) -> int | None:
        """Bytes of body not yet read (None: unknown, a chunked body)."""
        if self.complete:
            return 0
        return None if self.declared is None else self.declared - self.received


class RequestGuard:
    """ASGI middleware applying :class:`BodyLimits` to every HTTP request (module docstring)."""

    def __init__(self, app, limits: BodyLimits, *, error_key: str = "error"):
        self.app, self.limits, self.error_key = app, limits, error_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        body = _Body(scope, self.limits)
        started, close = False, False

        async def guarded_receive():
            if body.complete:
                return await receive()
            limits = self.limits
            loop = asyncio.get_running_loop()
            if body.deadline is None:
                body.deadline = loop.time() + limits.body_timeout_s
                if body.bad_length is not None:
                    raise HTTPError(400, f"invalid Content-Length {body.bad_length!r}", {"Connection": "close"})
                if body.declared is not None and body.declared > limits.max_body_bytes:
                    raise BodyTooLarge(f"request body of {body.declared} bytes is over this server's limit of "
                                       f"{limits.max_body_bytes} bytes ({limits.flag})",
                                       close=body.declared > limits.drain_bytes)
            try:
                message = await asyncio.wait_for(receive(), max(0.0, body.deadline - loop.time()))
            except asyncio.TimeoutError:
                raise BodyTimeout(f"request body not complete within {limits.body_timeout_s:g} s "
                                  f"({body.received} bytes received; --body_timeout_s)") from None
            if message["type"] == "http.disconnect":
                client = scope.get("client") or ("?", 0)
                log.warning("%s %s: client %s:%s went away after %d of %s body bytes", scope.get("method"),
                         scope.get("path"), client[0], client[1], body.received,
                         body.declared if body.declared is not None else "?")
                raise ClientGone(f"client went away after {body.received} body bytes")
            body.received += len(message.get("body", b""))
            if body.received > limits.max_body_bytes:
                raise BodyTooLarge(f"request body is over this server's limit of {limits.max_body_bytes} bytes "
                                   f"({limits.flag})")
            if not message.get("more_body", False):
                body.complete = True
            return message

        async def guarded_send(message):
            nonlocal started, close
            if message["type"] == "http.response.start":
                started = True
                rest = body.still_to_come()
                if close or (rest is None or rest > self.limits.drain_bytes) and rest != 0:
                    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                    message = {**message, "headers": headers + [(b"connection", b"close")]}
            await send(message)

        try:
            try:
                await self.app(scope, guarded_receive, guarded_send)
            except BaseExceptionGroup as group:  # a task group between here and the read (e.g. BaseHTTPMiddleware)
                raise _single(group) from None
        except ClientGone:
            return  # logged once above; uvicorn sends nothing to a closed connection
        except HTTPError as err:
            if started:
                raise
            close = err.headers.get("Connection", "").lower() == "close"
            payload = json.dumps({self.error_key: str(err)}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
            headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in err.headers.items()
                        if k.lower() != "connection"]
            await guarded_send({"type": "http.response.start", "status": err.status, "headers": headers})
            await send({"type": "http.response.body", "body": payload})


def _single(group: BaseExceptionGroup) -> BaseException:
    """The one ClientGone / HTTPError a task group wrapped, else the group itself."""
    found = group
    while isinstance(found, BaseExceptionGroup) and len(found.exceptions) == 1:
        found = found.exceptions[0]
    return found if isinstance(found, (ClientGone, HTTPError)) else group
