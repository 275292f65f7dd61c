"""Fault-test helpers: a frozen server (accepts connections, never answers), a tiny reward model
folder, and small HTTP reward apps with known answers. Everything binds 127.0.0.1."""

from __future__ import annotations

import socket
import threading


class FrozenServer:
    """Accepts TCP connections on 127.0.0.1 and never reads or answers (a hung reward server).
    ``accepted`` counts the connections; ``close()`` drops them all."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.05)
        self._stop = threading.Event()
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/get_reward"
        self.conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, name="frozen-server", daemon=True)
        self._thread.start()

    @property
    def accepted(self) -> int:
        with self._lock:
            return len(self.conns)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.conns.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        with self._lock:
            for conn in self.conns:
                conn.close()

    def __enter__(self) -> "FrozenServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def length_reward_app(calls: list | None = None, *, status: int = 200, wrong_length: bool = False):
    """A FastAPI reward app: reward of a query = its length in characters / 10 (so answers are
    checkable), ``scores`` = reward / 2. ``calls`` collects every payload received. ``status`` != 200:
    always answer that status; ``wrong_length``: answer one reward too few."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()

    @app.post("/get_reward")
    async def get_reward(payload: dict):
        if calls is not None:
            calls.append(payload)
        if status != 200:
            return JSONResponse({"error": f"always {status}"}, status_code=status)
        rewards = [len(q) / 10 for q in payload["query"]]
        if wrong_length and rewards:
            rewards = rewards[:-1]
        return {"rewards": rewards, "scores": [r / 2 for r in rewards], "extra_logs": {"chars": [len(q) for q in
                                                                                                  payload["query"]]}}

    return app
