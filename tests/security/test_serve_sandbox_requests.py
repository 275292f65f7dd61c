"""serve-sandbox under the bad-request catalogue of issue 46 (one raw keep-alive socket on 127.0.0.1): every bad
body a 4xx (5000-digit integers and 100k-deep nesting were a 500 and a dropped connection), the connection still
serving; 50 MB bodies refused at the size bound; a mid-body disconnect one log line; slow clients 408."""

from __future__ import annotations


import pytest

from rlhforge.agents.sandbox import Sandbox, SandboxConfig
from rlhforge.agents.sandbox.server import create_app
from rlhforge.net.server import ServerLimits, start_server_thread
from tests.security.http_catalogue import (assert_large_bodies_refused, assert_slow_clients_closed, check_catalogue,
                                           common_bad_bodies, assert_disconnect_is_one_line)

KEY = "sandbox-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    sandbox = Sandbox(SandboxConfig(timeout_s=2.0, memory_bytes=256 << 20, max_code_bytes=64 * 1024, concurrency=1))
    app = create_app(sandbox, api_key=KEY, concurrency=1, max_queue=2, body_timeout_s=1.0)
    with start_server_thread(app, route="/run", name="sandbox service", timeout=60,
                             limits=ServerLimits(header_timeout_s=1.0)) as handle:
        yield handle


def test_bad_request_catalogue_4xx_and_connection_kept(server):
    cases = [(name, "POST", "/run", body, {"Content-Type": "application/json"})
             for name, body in common_bad_bodies(lambda v: b'{"code": "print(1)", "limits": {"timeout_s": ' + v + b"}}")]
    cases += [("wrong type", "POST", "/run", b'{"code": 5}', None),
              ("wrong limit type", "POST", "/run", b'{"code": "print(1)", "limits": {"timeout_s": "slow"}}', None),
              ("lone surrogate in code", "POST", "/run", b'{"code": "print(\'\\udc80\')"}', None),
              ("wrong key", "POST", "/run", b'{"code": "print(1)"}', {"Authorization": "Bearer nope"})]
    seen = check_catalogue(server.port, cases, ("GET", "/health"), AUTH)
    assert {name: status for name, (status, _) in seen.items()} == {
        **{name: 400 for name, _ in common_bad_bodies(lambda v: v)}, "wrong type": 400, "wrong limit type": 400,
        "lone surrogate in code": 400, "wrong key": 401}
    assert "Exceeds the limit (4300 digits)" in seen["5000-digit integer"][1]
    assert "nested too deeply" in seen["100k-deep nesting"][1]
    assert "NaN is not a JSON number" in seen["NaN"][1]
    assert "not valid Unicode" in seen["lone surrogate in code"][1]


def test_50_mb_bodies_refused_at_the_limit(server):
    cap = 4 * 64 * 1024 + 65536  # the service's bound: 4 x max_code_bytes + 64 KiB
    out = assert_large_bodies_refused(server.port, "/run", ("GET", "/health"), cap, AUTH)
    assert out["content-length"][0] == 413 and out["chunked"][0] == 413
    assert out["content-length"][2] < 2.0  # refused from its Content-Length, before the 50 MB were sent


def test_disconnect_mid_body_is_one_line(server, caplog):
    assert_disconnect_is_one_line(server.port, "/run", AUTH, caplog)


def test_slow_clients_get_408_and_others_are_served(server):
    assert_slow_clients_closed(server.port, "/run", ("GET", "/health"), 1.0, 1.0, AUTH)
