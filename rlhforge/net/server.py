"""Running a service: the one way rlhforge starts uvicorn, and the one API-key check.

:func:`run_server` (the ``rlhforge serve-*`` commands: blocks, SIGTERM/SIGINT finish the requests in flight
and return normally) and :func:`start_server_thread` (tests, in-process use: a daemon thread, returns once the
port accepts connections) both build their uvicorn server with :func:`uvicorn_config`:

- loopback (``127.0.0.1``) unless a host is given;
- uvicorn's h11 protocol with a header deadline (:class:`~rlhforge.net.protocol.HeaderDeadlineH11`,
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

import hmac
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["ServerLimits", "ServerHandle", "key_matches", "match_key", "uvicorn_config", "run_server",
           "start_server_thread", "LOOPBACK"]

LOOPBACK = ("127.0.0.1", "localhost", "::1")


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
    import uvicorn

    from rlhforge.net.protocol import HeaderDeadlineH11

    limits = limits or ServerLimits()
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, http=HeaderDeadlineH11,
                            timeout_keep_alive=limits.keep_alive_s,
                            h11_max_incomplete_event_size=limits.max_header_bytes, **extra)
    config.header_timeout_s = limits.header_timeout_s
    return config


def run_server(app, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "warning",
               limits: ServerLimits | None = None, graceful_shutdown_s: float | None = None) -> str | None:
    """Serve ``app`` until SIGTERM/SIGINT, which finish the requests in flight (up to ``graceful_shutdown_s``)
    and return the signal's name (None: the server stopped by itself)."""
    import signal

    import uvicorn

    # uvicorn handles SIGTERM/SIGINT (graceful shutdown) and afterwards re-raises the signal to the handler
    # that was installed before it; make that one a recorder, so that a requested stop returns normally.
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, _frame: received.append(signum))
                for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        config = uvicorn_config(app, host, port, log_level=log_level, limits=limits,
                                timeout_graceful_shutdown=graceful_shutdown_s)
        uvicorn.Server(config).run()
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
                        limits: ServerLimits | None = None, **extra) -> ServerHandle:
    """Run ``app`` with uvicorn in a daemon thread; returns once it accepts connections. ``port=0`` picks a free
    port. Raises RuntimeError naming ``name`` if it does not start."""
    import uvicorn

    if port == 0:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
    extra.setdefault("lifespan", "on")
    server = uvicorn.Server(uvicorn_config(app, host, port, log_level=log_level, limits=limits, **extra))
    thread = threading.Thread(target=server.run, name=f"{name.replace(' ', '-')}-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"{name} on {host}:{port} did not start")
        time.sleep(0.02)
    return ServerHandle(server, thread, host, port, route)
