"""serve-tinker routes of the service itself: health, capabilities, client configuration, sessions."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

import rlhforge.tinker_server.schemas as S
from rlhforge.tinker_server.state import folder_config

__all__ = ["router"]


def router(ctx) -> APIRouter:
    cfg, state = ctx.cfg, ctx.state
    api = APIRouter()

    @api.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok"}

    @api.get("/api/v1/get_server_capabilities")
    async def capabilities():
        models = []
        for name, folder in sorted(cfg.model_table.items()):
            models.append({"model_name": name, "trainable": True, "sampleable": True,
                           "max_context_length": folder_config(folder).get("max_position_embeddings")})
        return {"supported_models": models}

    @api.post("/api/v1/client/config")
    async def client_config():
        return {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "proto_compress_fwdbwd": True,
                "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": True, "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False, "sample_join_sampling_session": False}

    @api.post("/api/v1/client/dynamic_config")
    async def client_dynamic_config():
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @api.post("/api/v1/create_session")
    async def create_session(request: Request):
        S.parse(S.CreateSession, await ctx.body_of(request))
        session_id = uuid.uuid4().hex
        state.new_session(ctx.tenant(request), session_id)
        return {"type": "create_session", "session_id": session_id}

    @api.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        req = S.parse(S.SessionRef, await ctx.body_of(request))
        state.session(req.session_id, ctx.tenant(request))["heartbeat"] = time.time()
        return {"type": "session_heartbeat"}

    @api.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request):
        sess = state.sessions.get(state.key_of(ctx.tenant(request), session_id))
        if sess is not None:  # finishing an unknown (or another tenant's) session changes nothing
            sess["finished"] = True
        return {}

    @api.post("/api/v1/telemetry")
    async def telemetry():
        return {"status": "accepted"}

    return api
