"""What the routers of ``rlhforge serve-tinker`` share (:class:`Context`)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from fastapi import Request

from rlhforge.net.payload import decompress_zstd
from rlhforge.tinker_server.state import ServerState

__all__ = ["Context", "PROTO", "OPEN_PATHS"]

PROTO = "application/x-protobuf"
OPEN_PATHS = ("/api/v1/healthz",)


@dataclass
class Context:
    """What every router shares: the configuration, the server state and the request helpers."""

    cfg: object
    state: ServerState

    async def body_of(self, request: Request) -> bytes:
        """The request body (size and read time bounded by RequestGuard), zstd decompressed with its output
        bounded while it is produced (the frame's declared size only refuses early)."""
        body = await request.body()
        if request.headers.get("content-encoding", "").lower() == "zstd":
            body = decompress_zstd(body, self.cfg.max_request_bytes, max_ratio=self.cfg.max_zstd_ratio)
        return body

    @staticmethod
    def tenant(request: Request) -> str:
        return request.state.tenant

    @staticmethod
    def digest(request: Request, body: bytes) -> str:
        """Identifies a request (route + body) for the seq_id de-duplication."""
        return hashlib.sha256(request.url.path.encode() + b"\0" + body).hexdigest()

    @staticmethod
    def future(rec, **extra) -> dict:
        return {"request_id": rec.request_id, **extra}
