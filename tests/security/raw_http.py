"""A POST over a raw socket (standard library only: the benchmark's noisy client imports it in a fresh
process): headers, then body chunks until the server answers or closes the connection."""

from __future__ import annotations

import socket
import time

__all__ = ["raw_post"]


def raw_post(port: int, path: str, head_extra: str, chunks, read_timeout: float = 10.0) -> tuple[bytes, int]:
    """POST over a raw socket: the headers, then ``chunks`` until the server answers or closes; returns
    (the answer's first bytes, how many body bytes were sent)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=read_timeout)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{head_extra}\r\n".encode())
    sent = 0
    sock.setblocking(False)
    answer = b""
    try:
        for chunk in chunks:
            try:
                answer += sock.recv(65536)
                if answer:
                    break
            except BlockingIOError:
                pass
            try:
                sock.setblocking(True)
                sock.sendall(chunk)
                sent += len(chunk)
                sock.setblocking(False)
            except (BrokenPipeError, ConnectionResetError):
                break
        sock.setblocking(True)
        sock.settimeout(read_timeout)
        deadline = time.monotonic() + read_timeout
        while b"\r\n\r\n" not in answer and time.monotonic() < deadline:
            try:
                part = sock.recv(65536)
            except ConnectionResetError:
                break
            if not part:
                break
            answer += part
    finally:
        sock.close()
    return answer, sent
