"""The HTTP app of ``rlhforge serve-tinker`` (FastAPI): the endpoints the ``tinker`` SDK 0.38 calls, one router per
resource (:mod:`.routes_service` sessions and client config, :mod:`.routes_training` models and their ordered
requests, :mod:`.routes_weights` checkpoints, :mod:`.routes_sampling` samplers and futures).

Every refusal is a 4xx whose ``detail`` names the field (``data[0].loss_fn_inputs.weights: missing ...``);
a wrong or missing key is 401. Long work answers with a future (:mod:`rlhforge.tinker_server.state`).

Requests pass :class:`rlhforge.net.guard.RequestGuard` first (body size counted while it streams, body read
deadline, mid-body disconnects), then the key check, which also names the request's tenant: the keys of
``--api_key`` share the default tenant, each key of ``--api_keys_file`` is a tenant of its own
(:mod:`rlhforge.tinker_server.state`, "Owners"; docs/security.md).
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rlhforge.net.guard import BodyLimits, RequestGuard
from rlhforge.net.server import match_key
from rlhforge.tinker_server import routes_sampling, routes_service, routes_training, routes_weights
from rlhforge.tinker_server.codec import PayloadError
from rlhforge.tinker_server.context import OPEN_PATHS, Context
from rlhforge.tinker_server.state import ServerState

__all__ = ["create_app"]


class KeyGuard:
    """ASGI middleware: 401 without an accepted key (``/api/v1/healthz`` excepted); else the request's tenant
    in ``request.state.tenant``. (Plain ASGI: no task group between the routes and the body reads.)"""

    def __init__(self, app, tenant_of: dict[str, str]):
        self.app, self.tenant_of, self.keys = app, tenant_of, tuple(tenant_of)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        key = match_key(request.headers, self.keys)
        if key is None and scope["path"] not in OPEN_PATHS:
            response = JSONResponse({"detail": "X-API-Key: missing or not an accepted key"}, status_code=401)
            return await response(scope, receive, send)
        scope.setdefault("state", {})["tenant"] = self.tenant_of.get(key, "")
        await self.app(scope, receive, send)


def create_app(cfg, api_keys: tuple[str, ...], tenants: dict[str, str] | None = None):
    """``api_keys``: the keys of the default tenant; ``tenants``: key -> tenant name (``--api_keys_file``)."""
    tenants = dict(tenants or {})
    tenant_of = {**{k: "" for k in api_keys}, **tenants}
    state = ServerState(cfg)
    ctx = Context(cfg, state)

    @asynccontextmanager
    async def lifespan(_app):
        import asyncio

        state.loop = asyncio.get_running_loop()
        yield
        state.shutdown()

    app = FastAPI(title="rlhforge serve-tinker", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.tinker = state

    app.add_middleware(KeyGuard, tenant_of=tenant_of)
    # outermost: body size counted while it streams, read deadline, mid-body disconnects (rlhforge.net.guard)
    app.add_middleware(RequestGuard, limits=BodyLimits(cfg.max_request_bytes, cfg.body_timeout_s), error_key="detail")

    @app.exception_handler(PayloadError)
    async def payload_error(_request, err: PayloadError):
        return JSONResponse({"detail": str(err)}, status_code=err.status)

    for module in (routes_service, routes_training, routes_weights, routes_sampling):
        app.include_router(module.router(ctx))
    return app
