"""The bad-request catalogue of issue 46, sent over one raw keep-alive socket (so that "the next request on the same
connection is still served" is observed, not hidden by a client that reconnects), to any rlhforge service
started in a thread on 127.0.0.1.

``catalogue(service)`` lists ``(name, body, headers)``; :func:`check_catalogue` sends each on one connection and
after each one the service's probe request (a GET that answers 200) on the SAME connection."""

from __future__ import annotations

import select
import socket
import time

__all__ = ["Raw", "common_bad_bodies", "check_catalogue", "send_large", "trickle", "trickle_on", "assert_large_bodies_refused",
           "assert_slow_clients_closed", "disconnect_mid_body", "assert_disconnect_is_one_line"]

DEEP = b"[" * 100_000 + b"]" * 100_000


def common_bad_bodies(wrap) -> list[tuple[str, bytes]]:
    """The JSON-level catalogue; ``wrap(value_bytes)`` puts a raw JSON value where the service reads a field."""
    return [
        ("broken JSON", b"{not json"),
        ("empty", b""),
        ("non-UTF-8", wrap(b'"caf\xe9"')),
        ("NaN", wrap(b"NaN")),
        ("lone surrogate", wrap(b'"x\\ud800y"')),
        ("5000-digit integer", wrap(b"9" * 5000)),
        ("100k-deep nesting", wrap(DEEP)),
    ]


class Raw:
    """One HTTP/1.1 connection driven byte by byte."""

    def __init__(self, port: int, timeout: float = 20.0):
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buf = b""

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> tuple:
        head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
            if v is not None:
                head += f"{k}: {v}\r\n"
        self.send(head.encode() + b"\r\n" + body)
        return self.response()

    def response(self) -> tuple[int, dict[str, str], bytes] | None:
        """``(status, headers, body)`` of the next answer, or None when the server closed the connection."""
        while b"\r\n\r\n" not in self.buf:
            chunk = self._recv()
            if not chunk:
                return None
            self.buf += chunk
        head, _, rest = self.buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        n = int(headers.get("content-length", "0"))
        while len(rest) < n:
            chunk = self._recv()
            if not chunk:
                break
            rest += chunk
        self.buf = rest[n:]
        return status, headers, rest[:n]

    def _recv(self) -> bytes:
        try:
            return self.sock.recv(1 << 16)
        except (ConnectionResetError, socket.timeout):
            return b""

    def readable(self) -> bool:
        return bool(select.select([self.sock], [], [], 0)[0])


def check_catalogue(port: int, cases, probe: tuple[str, str], base_headers: dict[str, str] | None = None) -> dict:
    """Sends every ``(name, method, path, body, headers)`` of ``cases`` on ONE connection, each followed by
    ``probe`` (method, path) on the same connection. Returns ``{name: (status, reason)}``; asserts every
    answer is a 4xx and every probe a 200."""
    conn = Raw(port)
    seen = {}
    try:
        for name, method, path, body, headers in cases:
            answer = conn.request(method, path, body, {**(base_headers or {}), **(headers or {})})
            assert answer is not None, f"{name}: the server closed the connection without an answer"
            status, head, text = answer
            assert 400 <= status < 500, (name, status, text[:300])
            assert head.get("connection", "").lower() != "close", (name, "closed the connection", text[:200])
            seen[name] = (status, text.decode("utf-8", "replace"))
            after = conn.request(probe[0], probe[1], b"", base_headers)
            assert after is not None and after[0] == 200, (name, "probe on the same connection", after)
    finally:
        conn.close()
    return seen


def send_large(port: int, path: str, total: int, *, chunked: bool, headers: dict[str, str] | None = None,
               chunk: int = 1 << 20) -> tuple[tuple | None, int, float]:
    """Posts ``total`` bytes of ``x`` (with Content-Length, or chunked without one), stopping as soon as the
    server answers. Returns (answer, bytes sent, seconds until the answer)."""
    conn = Raw(port)
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += "Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {total}\r\n"
    for k, v in (headers or {}).items():
        head += f"{k}: {v}\r\n"
    started = time.monotonic()
    conn.send(head.encode() + b"\r\n")
    sent, block = 0, b"x" * chunk
    try:
        while sent < total and not conn.readable():
            n = min(chunk, total - sent)
            conn.send(b"%x\r\n" % n + block[:n] + b"\r\n" if chunked else block[:n])
            sent += n
        if chunked and sent >= total and not conn.readable():
            conn.send(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass
    answer = conn.response()
    elapsed = time.monotonic() - started
    conn.close()
    return answer, sent, elapsed


def trickle(port: int, data: bytes, every_s: float, limit_s: float) -> tuple[tuple | None, float]:
    """Sends ``data`` one byte every ``every_s`` on a new connection until the server answers or closes (or
    ``limit_s``)."""
    return trickle_on(Raw(port, timeout=limit_s), data, every_s, limit_s)


def assert_large_bodies_refused(port: int, path: str, probe: tuple[str, str], limit: int,
                                headers: dict[str, str] | None = None) -> dict:
    """50 MB with Content-Length and 50 MB chunked: a 4xx each; over ``limit`` the 413 comes before the body is
    sent (Content-Length) or once ``limit`` bytes have streamed (chunked), and a new connection is served."""
    total = 50 * 2**20
    out = {}
    for chunked in (False, True):
        answer, sent, elapsed = send_large(port, path, total, chunked=chunked, headers=headers)
        assert answer is not None and 400 <= answer[0] < 500, (chunked, answer and answer[:2])
        if total > limit:
            assert answer[0] == 413, (chunked, answer[:2], answer[2][:200])
            assert sent <= limit + 8 * 2**20, (chunked, sent, limit)  # stopped near the limit, not at 50 MB
        out["chunked" if chunked else "content-length"] = (answer[0], sent, elapsed)
        again = Raw(port).request(probe[0], probe[1], b"", headers)
        assert again is not None and again[0] == 200
    return out


def assert_slow_clients_closed(port: int, path: str, probe: tuple[str, str], header_s: float, body_s: float,
                               headers: dict[str, str] | None = None) -> dict:
    """A client trickling its headers, and one trickling its body, get a 408 within their deadline (+1 s) and
    are closed, while a normal request on another connection is served meanwhile."""
    import threading

    results = {}

    def run(name, data, every):
        results[name] = trickle(port, data, every, limit_s=header_s + body_s + 10)

    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    slow_head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}Content-Length: 10\r\n\r\n{{}}".encode()
    threads = [threading.Thread(target=run, args=("headers", slow_head, 0.2))]
    conn = Raw(port)
    conn.send(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}Content-Length: 1000\r\n\r\n".encode())
    threads.append(threading.Thread(target=lambda: results.__setitem__(
        "body", trickle_on(conn, b"x" * 1000, 0.2, header_s + body_s + 10))))
    for t in threads:
        t.start()
    time.sleep(0.3)
    started = time.monotonic()
    served = Raw(port).request(probe[0], probe[1], b"", headers)
    probe_s = time.monotonic() - started
    for t in threads:
        t.join(header_s + body_s + 20)
    assert served is not None and served[0] == 200 and probe_s < 2.0, (served, probe_s)
    (head_answer, head_s), (body_answer, body_elapsed) = results["headers"], results["body"]
    assert head_answer is not None and head_answer[0] == 408 and head_s < header_s + 1.5, (head_answer, head_s)
    assert body_answer is not None and body_answer[0] == 408 and body_elapsed < body_s + 1.5, (body_answer,
                                                                                               body_elapsed)
    assert head_answer[1].get("connection") == "close" and body_answer[1].get("connection") == "close"
    return {"headers_s": head_s, "body_s": body_elapsed, "probe_s": probe_s}


def trickle_on(conn: Raw, data: bytes, every_s: float, limit_s: float) -> tuple[tuple | None, float]:
    """:func:`trickle` on an open connection (which it closes)."""
    started = time.monotonic()
    try:
        for byte in data:
            if conn.readable() or time.monotonic() - started > limit_s:
                break
            conn.send(bytes([byte]))
            time.sleep(every_s)
    except (BrokenPipeError, ConnectionResetError):
        pass
    answer = conn.response()
    conn.close()
    return answer, time.monotonic() - started


def assert_disconnect_is_one_line(port: int, path: str, headers: dict[str, str] | None, caplog) -> None:
    """A client that leaves mid-body leaves one WARNING line on ``rlhforge.net`` and no ERROR record."""
    import logging

    caplog.set_level(logging.INFO, logger="rlhforge.net")
    disconnect_mid_body(port, path, headers)
    time.sleep(0.5)
    gone = [r for r in caplog.records if "went away" in r.getMessage()]
    assert len(gone) == 1 and gone[0].levelno == logging.WARNING, [r.getMessage() for r in caplog.records]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]


def disconnect_mid_body(port: int, path: str, headers: dict[str, str] | None = None) -> None:
    """Announces 100000 body bytes, sends 10, and closes the connection."""
    conn = Raw(port)
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    conn.send(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{extra}Content-Length: 100000\r\n\r\n".encode()
              + b'{"query": ')
    time.sleep(0.3)
    conn.close()
