"""Tinker clients do not outlive their test (issue 47, item 10): a ServiceClient left open keeps its session
heartbeat running on the SDK's background thread; once its server is gone, that loop logs a warning every
10 s after 2 minutes, which at the end of the suite (streams closed) printed "--- Logging error ---"
tracebacks. tests/tinker/conftest.py closes every client a test creates."""

from __future__ import annotations

import time

from tests.tinker.conftest import KEY, close_service_client


def _wait_done(task, limit_s: float = 10.0) -> bool:
    deadline = time.monotonic() + limit_s
    while not task.done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_every_client_a_test_creates_is_recorded(tinker, start_server, monkeypatch, close_tinker_clients):
    server = start_server()
    monkeypatch.setenv("TINKER_BASE_URL", server.base_url)
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    client = tinker.ServiceClient()  # as the cookbook's recipes make theirs
    assert close_tinker_clients == [(client, server.base_url)]


def test_a_client_whose_server_is_gone_stops_its_heartbeat(tinker, start_server, service_client):
    server = start_server()
    client = service_client(server)
    client.create_lora_training_client(base_model="tiny", rank=2, seed=0).result(timeout=60)
    heartbeat = client._session_holder._session_heartbeat_task
    assert heartbeat is not None and not heartbeat.done()
    server.stop()  # a restart test's first server: finishing its session would retry for minutes
    started = time.monotonic()
    close_service_client(client, server.base_url)
    assert time.monotonic() - started < 10
    assert _wait_done(heartbeat), "the session heartbeat still runs after the client was closed"
