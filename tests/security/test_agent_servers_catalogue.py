"""Issue 46's bad-request catalogue (tests/security/http_catalogue.py, the same for every server) sent to both
agent servers over ONE raw keep-alive connection: every answer a 4xx naming the reason, and the next request on
that connection served; 50 MB bodies with and without Content-Length refused; a client that leaves mid-body is
one log line; clients trickling headers or body get a 408 and are closed while others are served; with a key,
the catalogue still gets its 4xx once the key is right, and 401 without it."""

from __future__ import annotations

import json

import pytest

from rlhforge.agents.serving.routes import AgentServerLimits
from tests.security.agent_servers import running_server
from tests.security.http_catalogue import (assert_disconnect_is_one_line, assert_large_bodies_refused,
                                           assert_slow_clients_closed, check_catalogue, common_bad_bodies)

JSON = {"Content-Type": "application/json"}
LIMITS = AgentServerLimits(max_body_bytes=1 << 20, body_timeout_s=1.0, header_timeout_s=1.0)
PROBE = ("GET", "/v1/models")  # needs the key when there is one (/health never does)


def _chat_cases(path: str) -> list:
    def wrap(value: bytes) -> bytes:
        return b'{"messages": [{"role": "user", "content": ' + value + b'}], "max_tokens": 2}'

    def field(name, value) -> bytes:
        return json.dumps({"messages": [{"role": "user", "content": "hi"}], name: value}).encode()

    cases = common_bad_bodies(wrap) + [
        ("max_tokens 'x'", field("max_tokens", "x")), ("temperature 'hot'", field("temperature", "hot")),
        ("temperature -1", field("temperature", -1)), ("top_p 5", field("top_p", 5)), ("top_k 0", field("top_k", 0)),
        ("stop 7", field("stop", 7)), ("seed 'x'", field("seed", "x")), ("int content", wrap(b"7")),
        ("temperature NaN", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
        ("message over the limit", wrap(json.dumps("a" * 300_000).encode())),
    ]
    return [(name, "POST", path, body, JSON) for name, body in cases]


def _token_cases() -> list:
    def wrap(value: bytes) -> bytes:
        return b'{"token_ids": [5, 6], "sampling_params": {"max_tokens": ' + value + b'}}'

    def sp(name, value) -> bytes:
        return json.dumps({"token_ids": [5, 6], "sampling_params": {name: value}}).encode()

    cases = common_bad_bodies(wrap) + [
        ("stop_token_ids ['a']", sp("stop_token_ids", ["a"])), ("seed 'x'", sp("seed", "x")),
        ("temperature 'hot'", sp("temperature", "hot")), ("top_k 0", sp("top_k", 0)),
        ("token_ids ['a']", json.dumps({"token_ids": ["a"]}).encode()),
    ]
    return [(name, "POST", "/inference/v1/generate", body, JSON) for name, body in cases]


@pytest.fixture(scope="module")
def chat(tiny_model_dir):
    with running_server(tiny_model_dir, "chat", limits=LIMITS, sessions=1) as served:
        yield served


def test_chat_catalogue_on_one_connection(chat):
    server, sids = chat
    seen = check_catalogue(server.port, _chat_cases(f"/sessions/{sids[0]}/v1/chat/completions"), PROBE)
    reasons = {name: text for name, (status, text) in seen.items()}
    assert seen["message over the limit"][0] == 413 and "messages[0].content has 300000" in reasons["message over the limit"]
    assert "'temperature'" in reasons["temperature NaN"] and "'top_k'" in reasons["top_k 0"]
    assert "nested too deeply" in reasons["100k-deep nesting"] and "not valid Unicode" in reasons["lone surrogate"]
    assert all(status == 400 for name, (status, _) in seen.items() if name != "message over the limit"), seen


def test_chat_large_bodies_disconnects_and_slow_clients(chat, caplog):
    server, sids = chat
    path = f"/sessions/{sids[0]}/v1/chat/completions"
    sizes = assert_large_bodies_refused(server.port, path, PROBE, LIMITS.max_body_bytes)
    assert all(status == 413 and seconds < 1.0 for status, _, seconds in sizes.values()), sizes  # at once
    assert_disconnect_is_one_line(server.port, path, None, caplog)
    assert_slow_clients_closed(server.port, path, PROBE, LIMITS.header_timeout_s, LIMITS.body_timeout_s)


def test_token_route_catalogue_with_a_key(tiny_model_dir):
    key = {"Authorization": "Bearer k-9"}
    limits = AgentServerLimits(max_body_bytes=1 << 20, api_key="k-9")
    with running_server(tiny_model_dir, "tokens", limits=limits) as (server, _):
        seen = check_catalogue(server.port, _token_cases(), PROBE, key)
        assert all(status == 400 for status, _ in seen.values()), seen
        assert "'sampling_params.stop_token_ids'" in seen["stop_token_ids ['a']"][1]
        unkeyed = check_catalogue(server.port, [("no key", "POST", "/inference/v1/generate", b"{}", JSON)],
                                  ("GET", "/health"))
        assert unkeyed["no key"][0] == 401
        sizes = assert_large_bodies_refused(server.port, "/inference/v1/generate", PROBE, limits.max_body_bytes, key)
        assert all(status == 413 for status, _, _ in sizes.values()), sizes
