"""Small pieces both HTTP services share (``rlhforge serve-rm`` and ``rlhforge serve-sandbox``): the
API-key check and a uvicorn server in a background thread (tests, in-process use)."""

from __future__ import annotations

import hmac
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["key_matches", "ServerHandle", "start_server_thread"]


def key_matches(headers, api_key: str | None) -> bool:
    """Whether a request's ``Authorization: Bearer KEY`` (or ``X-API-Key: KEY``) matches ``api_key``
    (constant-time; no key configured: every request passes). Shared by serve-rm and serve-sandbox."""
    if not api_key:
        return True
    given = headers.get("x-api-key") or ""
    auth = headers.get("authorization") or ""
    if auth.lower().startswith("bearer "):
        given = auth[7:].strip()
    return hmac.compare_digest(given.encode(), api_key.encode())


@dataclass
class ServerHandle:
    """An HTTP service running in a background thread: ``base_url``, ``url`` (of its main route:
    ``/get_reward`` for the reward server), ``stop()``. Also used by ``rlhforge serve-sandbox``."""

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
                        log_level: str = "warning", *, route: str = "/get_reward",
                        name: str = "reward server") -> ServerHandle:
    """Run ``app`` with uvicorn in a daemon thread; returns once it accepts connections. ``port=0``
    picks a free port. Raises RuntimeError naming ``name`` if it does not start."""
    import socket

    import uvicorn

    if port == 0:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on"))
    thread = threading.Thread(target=server.run, name=f"{name.replace(' ', '-')}-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"{name} on {host}:{port} did not start")
        time.sleep(0.02)
    return ServerHandle(server, thread, host, port, route)
