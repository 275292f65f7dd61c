"""A serve-tinker app with two tenants on 127.0.0.1 for the security tests, and the small steps the tests take
(sessions, models, checkpoints, futures) over plain HTTP, as the SDK sends them."""

from __future__ import annotations

import struct
import time

import httpx

KEY_A = "tml-tenant-a-key"
KEY_B = "tml-tenant-b-key"


def zstd_bomb(total: int = 1 << 30, declared: bool = True) -> bytes:
    """A ~32 KB zstd frame that expands to ``total`` zero bytes: RLE blocks of 128 KiB, 4 bytes each; the
    frame declares its size (``declared``) or not."""
    head = struct.pack("<I", 0xFD2FB528)
    head += bytes([0xC0, 0x38]) + struct.pack("<Q", total) if declared else bytes([0x00, 0x38])
    n = total // 131072

    def block(last: int) -> bytes:
        return struct.pack("<I", last | (1 << 1) | (131072 << 3))[:3] + b"\x00"

    return head + block(0) * (n - 1) + block(1)


def client(server, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.base_url, headers={"X-API-Key": key}, timeout=60)


def session(http) -> str:
    r = http.post("/api/v1/create_session", json={"tags": [], "sdk_version": "test"})
    assert r.status_code == 200, r.text
    return r.json()["session_id"]


def result(http, request_id: str, limit_s: float = 60.0) -> dict:
    deadline = time.monotonic() + limit_s
    while True:
        r = http.post("/api/v1/retrieve_future", json={"request_id": request_id})
        assert r.status_code == 200, r.text
        body = r.json()
        if body.get("type") != "try_again" or time.monotonic() > deadline:
            return body


def model(http, session_id: str, seq: int = 0) -> str:
    r = http.post("/api/v1/create_model", json={"session_id": session_id, "model_seq_id": seq, "base_model": "tiny",
                                                "lora_config": {"rank": 2}})
    assert r.status_code == 200, r.text
    assert "error" not in result(http, r.json()["request_id"])
    return r.json()["model_id"]


def save(http, model_id: str, seq_id: int, name: str) -> str:
    r = http.post("/api/v1/save_weights", json={"model_id": model_id, "seq_id": seq_id, "path": name})
    assert r.status_code == 200, r.text
    out = result(http, r.json()["request_id"])
    assert "path" in out, out
    return out["path"]


def optim(http, model_id: str, seq_id: int, lr: float = 0.0):
    return http.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": seq_id,
                                                 "adam_params": {"learning_rate": lr}})
