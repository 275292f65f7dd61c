"""A ``rlhforge serve-tinker`` app in a uvicorn thread on a free 127.0.0.1 port, and the real ``tinker`` SDK
pointed at it the way users do: only ``TINKER_BASE_URL`` and ``TINKER_API_KEY`` set."""

from __future__ import annotations

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
    from rlhforge.rewards.http_service import start_server_thread
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
    """``service_client(server)``: a ServiceClient configured by the environment only."""
    clients = []

    def make(server):
        monkeypatch.setenv("TINKER_BASE_URL", server.base_url)
        monkeypatch.setenv("TINKER_API_KEY", KEY)
        monkeypatch.setenv("TINKER_TELEMETRY", "0")
        client = tinker.ServiceClient()
        clients.append((client, server))
        return client

    yield make
    for client, server in clients:
        if server.thread.is_alive():  # finishing a session on a stopped server would retry for minutes
            client.close("success").result(timeout=30)


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
