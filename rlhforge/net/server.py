"""Running a service: the one way rlhforge starts uvicorn, and the one API-key check.

:func:`run_server` (the ``rlhforge serve-*`` commands: blocks, SIGTERM/SIGINT finish the requests in flight
and return normally) and :func:`start_server_thread` (tests, in-process use: a daemon thread, returns once the
port accepts connections) both build their uvicorn server with :func:`uvicorn_config`:

- loopback (``127.0.0.1``) unless a host is given;
- uvicorn's h11 protocol with a header deadline (:func:`header_deadline_h11`,
  ``ServerLimits.header_timeout_s``): a connection whose request headers are not complete in time (or that
  sends nothing) gets a 408 and is closed; headers are at most ``max_header_bytes`` (h11's
  ``h11_max_incomplete_event_size``; more is a 400); an idle keep-alive connection is closed after
  ``keep_alive_s`` (uvicorn's ``timeout_keep_alive``).

The body's bounds (size while streaming, read deadline, disconnects) are :class:`~rlhforge.net.guard.RequestGuard`'s,
which the services wrap their apps in.

:func:`match_key` / :func:`key_matches`: a request's ``Authorization: Bearer KEY`` or ``X-API-Key: KEY`` against
the accepted keys, in constant time.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["uvicorn_module", "header_deadline_h11", "ServerLimits", "ServerHandle", "key_matches", "match_key", "uvicorn_config", "run_server",
           "start_server_thread", "LOOPBACK"]

LOOPBACK = ("127.0.0.1", "localhost", "::1")
log = logging.getLogger("rlhforge.net")


def uvicorn_module(sub: str = ""):
    """``uvicorn`` (or its submodule ``sub``), imported here only: the one module of rlhforge that imports it."""
    import importlib

    import uvicorn

    return importlib.import_module(f"uvicorn.{sub}") if sub else uvicorn


@dataclass(frozen=True)
class ServerLimits:
    """Connection-level bounds of every rlhforge service (module docstring)."""

    header_timeout_s: float = 10.0
    """Seconds a client has to send a request's headers (from the connection's opening, or the first byte of a
    further request on it)."""
    keep_alive_s: float = 5.0
    """Seconds an idle keep-alive connection is kept open."""
    max_header_bytes: int = 64 * 1024
    """Largest request line + headers."""

    def __post_init__(self):
        if not self.header_timeout_s > 0 or not self.keep_alive_s > 0 or self.max_header_bytes < 1024:
            raise ValueError(f"ServerLimits: header_timeout_s > 0, keep_alive_s > 0 and max_header_bytes >= 1024 "
                             f"needed (got {self.header_timeout_s}, {self.keep_alive_s}, {self.max_header_bytes})")


def match_key(headers, api_keys: Sequence[str]) -> str | None:
    """The accepted key a request carries (``Authorization: Bearer KEY``, else ``X-API-Key: KEY``), or None.
    Every key is compared in constant time."""
    auth = headers.get("authorization") or ""
    given = auth[7:].strip() if auth.lower().startswith("bearer ") else (headers.get("x-api-key") or "")
    given_bytes = given.encode("utf-8", "surrogateescape")
    found = None
    for key in api_keys:
        if hmac.compare_digest(given_bytes, key.encode()) and found is None:
            found = key
    return found


def key_matches(headers, api_key: str | None) -> bool:
    """Whether a request carries ``api_key`` (:func:`match_key`); no key configured: every request passes."""
    if not api_key:
        return True
    return match_key(headers, (api_key,)) is not None


def uvicorn_config(app, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning",
                   limits: ServerLimits | None = None, **extra):
    """The ``uvicorn.Config`` of every rlhforge service (module docstring); ``extra`` goes to uvicorn."""
    limits = limits or ServerLimits()
    config = uvicorn_module().Config(app, host=host, port=port, log_level=log_level, http=header_deadline_h11(),
                            timeout_keep_alive=limits.keep_alive_s,
                            h11_max_incomplete_event_size=limits.max_header_bytes, **extra)
    config.header_timeout_s = limits.header_timeout_s
    return config


def run_server(app, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "warning",
               limits: ServerLimits | None = None, graceful_shutdown_s: float | None = None) -> str | None:
    """Serve ``app`` until SIGTERM/SIGINT, which finish the requests in flight (up to ``graceful_shutdown_s``)
    and return the signal's name (None: the server stopped by itself)."""
    import signal

    # uvicorn handles SIGTERM/SIGINT (graceful shutdown) and afterwards re-raises the signal to the handler
    # that was installed before it; make that one a recorder, so that a requested stop returns normally.
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        config = uvicorn_config(app, host, port, log_level=log_level, limits=limits,
                                timeout_graceful_shutdown=graceful_shutdown_s)
        uvicorn_module().Server(config).run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return signal.Signals(received[0]).name if received else None


@dataclass
class ServerHandle:
    """A service running in a background thread: ``base_url``, ``url`` (of its main ``route``), ``stop()``."""

    server: Any
    thread: threading.Thread
    host: str
    port: int
    route: str = "/get_reward"

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.base_url}{self.route}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server_thread(app, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0,
                        log_level: str = "warning", *, route: str = "/get_reward", name: str = "reward server",
                        limits: ServerLimits | None = None, sock: socket.socket | None = None,
                        **extra) -> ServerHandle:
    """Run ``app`` with uvicorn in a daemon thread; returns once it accepts connections. ``port=0`` picks a free
    port; ``sock``: a socket already bound (and listening) to serve on instead, so no other process can take
    the port in between. Raises RuntimeError naming ``name`` if it does not start."""
    if sock is not None:
        host, port = sock.getsockname()[:2]
    elif port == 0:
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
    extra.setdefault("lifespan", "on")
    server = uvicorn_module().Server(uvicorn_config(app, host, port, log_level=log_level, limits=limits, **extra))
    thread = threading.Thread(target=server.run, name=f"{name.replace(' ', '-')}-{port}", daemon=True,
                              kwargs={"sockets": [sock]} if sock is not None else {})
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"{name} on {host}:{port} did not start")
        time.sleep(0.02)
    return ServerHandle(server, thread, host, port, route)


_BODY = b'{"error": "request headers not complete in time (--header_timeout_s)"}'
_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
             b"content-length: " + str(len(_BODY)).encode() + b"\r\n\r\n" + _BODY)


@functools.cache
def header_deadline_h11() -> type:
    """uvicorn's h11 protocol with a header deadline, built on first use (module docstring). uvicorn bounds the
    idle time between two requests of a keep-alive connection but not the time a client takes to send a
    request's headers, nor a connection that never sends a byte (50 clients trickling a header byte every 0.5 s
    were held forever): this one starts a timer when a connection opens and at the first byte of each further
    request, and closes the connection with a 408 when the headers are not complete within
    ``config.header_timeout_s``."""
    import h11

    H11Protocol = uvicorn_module("protocols.http.h11_impl").H11Protocol

    class HeaderDeadlineH11(H11Protocol):
        """:class:`H11Protocol` closing connections whose request headers take over ``config.header_timeout_s``."""

        header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self.header_timer is None:
                seconds = getattr(self.config, "header_timeout_s", None)
                if seconds:
                    self.header_timer = self.loop.call_later(seconds, self._headers_late, seconds)

        def _disarm(self) -> None:
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()  # a connection that never sends a byte is a slow client too

        def data_received(self, data: bytes) -> None:
            if self.conn.their_state is h11.IDLE:
                self._arm()
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
                self._arm()  # a pipelined next request already started

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _headers_late(self, seconds: float) -> None:
            self.header_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            client = self.client or ("?", 0)
            log.warning("closed the connection of %s:%s: no complete request headers within %g s", client[0], client[1],
                     seconds)
            if self.conn.our_state is h11.IDLE:
                self.transport.write(_RESPONSE)
            self.transport.close()

    return HeaderDeadlineH11
