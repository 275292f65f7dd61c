"""A ``rlhforge serve-tinker`` app in a uvicorn thread on a free 127.0.0.1 port, and the real ``tinker`` SDK
pointed at it the way users do: only ``TINKER_BASE_URL`` and ``TINKER_API_KEY`` set."""

from __future__ import annotations

import os

import pytest

from tests.conftest import require_module

KEY = "tml-rlhforge-test-key"


@pytest.fixture(scope="module")
def tinker():
    require_module("tinker", "pip install tinker==0.38.0 (the dev extra)")
    import tinker

    return tinker


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tinker_ckpt")


@pytest.fixture(scope="module")
def start_server(tiny_model_dir, ckpt_dir, tinker):
    """``start_server()`` -> a running server (``.base_url``, ``.app``, ``.stop()``); stopped at module end.
    Each call is a fresh server instance over the same checkpoint folder (a restart)."""
    from rlhforge.config.serve_tinker import ServeTinkerConfig
    from rlhforge.net.server import start_server_thread
    from rlhforge.tinker_server.app import create_app

    handles = []

    def start(**overrides):
        kwargs = {"checkpoint_dir": str(ckpt_dir), "device": "cpu", "model_map": (f"tiny={tiny_model_dir}",),
                  **overrides}
        cfg = ServeTinkerConfig(**kwargs)
        app = create_app(cfg, (KEY,))
        handle = start_server_thread(app, route="/api/v1/healthz", name="tinker server")
        handle.app = app
        handles.append(handle)
        return handle

    yield start
    for h in handles:
        h.stop()


@pytest.fixture
def service_client(monkeypatch, tinker):
    """``service_client(server)``: a ServiceClient configured by the environment only (closed at the end of
    the test by :func:`close_tinker_clients`)."""

    def make(server):
        monkeypatch.setenv("TINKER_BASE_URL", server.base_url)
        monkeypatch.setenv("TINKER_API_KEY", KEY)
        monkeypatch.setenv("TINKER_TELEMETRY", "0")
        return tinker.ServiceClient()

    return make


@pytest.fixture(autouse=True)
def close_tinker_clients(monkeypatch):
    """Every ``tinker.ServiceClient`` a test creates (itself, or inside the cookbook's recipes, which never
    close theirs) is closed when the test ends. An open one keeps its session heartbeat running on the SDK's
    background thread long after the test, against a server that is gone, until the end of the suite."""
    try:
        import tinker
    except Exception:  # noqa: BLE001 - the tests that need it skip (or fail in CI) through the tinker fixture
        yield []
        return
    created = []
    init = tinker.ServiceClient.__init__

    def recording_init(self, *args, **kwargs):
        created.append((self, kwargs.get("base_url") or os.environ.get("TINKER_BASE_URL")))
        init(self, *args, **kwargs)

    monkeypatch.setattr(tinker.ServiceClient, "__init__", recording_init)
    yield created
    for client, url in created:
        close_service_client(client, url)


def close_service_client(client, url: str | None) -> None:
    """Finish the client's session when its server still answers; otherwise (a test stopped the server, or
    the session never opened) stop the client's own loops only: finishing would retry for minutes."""
    import httpx

    try:
        alive = bool(url) and httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        alive = False
    if alive:
        try:
            client.close("success").result(timeout=30)
            return
        except Exception:  # noqa: BLE001 - e.g. a session refused with a wrong key: close locally below
            pass
    for holder in (getattr(client, "_session_holder", None), getattr(client, "_rest_holder", None)):
        if holder is not None:
            holder.close()  # cancels the heartbeat and config-refresh tasks (tinker 0.38)


def datum(tinker, ids: list[int], weights: list[float] | None = None, **inputs):
    """The SDK's next-token datum: model_input = ids[:-1], target_tokens = ids[1:]."""
    from tinker import types

    n = len(ids) - 1
    loss_inputs = {"target_tokens": ids[1:], **inputs}
    if weights is not None or not inputs:
        loss_inputs["weights"] = weights if weights is not None else [1.0] * n
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=loss_inputs)


def token_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)
