"""Issue 46, item 7: the agent servers answer every malformed request with a 400 that names the field
(not a 500), and the next request on the same connection is served.

On ``89172c3`` ``max_tokens: "x"``, ``temperature: "hot"``, ``stop: 7``, an int ``content``, a lone
surrogate, ``seed: "x"`` and ``stop_token_ids: ["a"]`` were 500s; ``temperature: NaN`` a 500 with a wrong
reason; ``temperature: -1``, ``top_p: 5`` and ``top_k: 0`` went through unchecked."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.security.agent_servers import running_server

GOOD_CHAT = {"model": "policy", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2}
GOOD_TOKENS = {"model": "policy", "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2, "seed": 1}}

# (case id, raw body or a dict merged into the good body, words the 400's message must hold)
CHAT_CASES = [
    ("max_tokens_string", {"max_tokens": "x"}, ["'max_tokens'", "integer"]),
    ("max_tokens_zero", {"max_tokens": 0}, ["'max_tokens'"]),
    ("max_completion_tokens_float", {"max_completion_tokens": 2.5}, ["'max_completion_tokens'"]),
    ("temperature_string", {"temperature": "hot"}, ["'temperature'", "number"]),
    ("temperature_nan", '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', ["'temperature'", "nan"]),
    ("temperature_infinity", '{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}',
     ["'temperature'"]),
    ("temperature_negative", {"temperature": -1}, ["'temperature'", ">= 0"]),
    ("temperature_bool", {"temperature": True}, ["'temperature'"]),
    ("top_p_five", {"top_p": 5}, ["'top_p'", "(0, 1]"]),
    ("top_p_zero", {"top_p": 0}, ["'top_p'"]),
    ("top_k_zero", {"top_k": 0}, ["'top_k'"]),
    ("stop_int", {"stop": 7}, ["'stop'", "string"]),
    ("stop_list_of_ints", {"stop": ["a", 3]}, ["'stop'"]),
    ("seed_string", {"seed": "x"}, ["'seed'", "integer"]),
    ("seed_negative", {"seed": -4}, ["'seed'"]),
    ("stop_token_ids_strings", {"stop_token_ids": ["a"]}, ["'stop_token_ids'"]),
    ("n_two", {"n": 2}, ["'n'"]),
    ("logprobs_string", {"logprobs": "yes"}, ["'logprobs'"]),
    ("stream_string", {"stream": "yes"}, ["stream"]),
    ("content_int", {"messages": [{"role": "user", "content": 7}]}, ["messages[0].content"]),
    ("content_part_text_int", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     ["messages[0].content[0].text"]),
    ("content_image_part", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     ["messages[0].content[0]", "image_url"]),
    ("role_int", {"messages": [{"role": 5, "content": "x"}]}, ["messages[0]", "role"]),
    ("message_not_object", {"messages": ["hi"]}, ["messages[0]"]),
    ("messages_string", {"messages": "hi"}, ["'messages'"]),
    ("messages_empty", {"messages": []}, ["'messages'"]),
    ("tools_string", {"tools": "x"}, ["'tools'"]),
    ("lone_surrogate", '{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}',
     ["'messages'[0].content", "not valid unicode"]),
    ("huge_integer", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": ' + "9" * 5000 + "}",
     ["malformed json"]),
    ("deep_nesting", '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", ["nested too deeply"]),
    ("broken_json", '{"messages": [', ["malformed json"]),
    ("empty_body", "", ["empty"]),
    ("not_utf8", b'{"messages": "\xff\xfe"}', ["malformed json"]),
    ("not_an_object", "[1, 2]", ["json object"]),
]

TOKEN_CASES = [
    ("max_tokens_string", {"sampling_params": {"max_tokens": "x"}}, ["'sampling_params.max_tokens'"]),
    ("temperature_string", {"sampling_params": {"temperature": "hot"}}, ["'sampling_params.temperature'"]),
    ("temperature_nan", '{"token_ids": [5, 6], "sampling_params": {"temperature": NaN}}',
     ["'sampling_params.temperature'", "nan"]),
    ("temperature_negative", {"sampling_params": {"temperature": -1}}, ["'sampling_params.temperature'"]),
    ("top_p_five", {"sampling_params": {"top_p": 5}}, ["'sampling_params.top_p'"]),
    ("top_k_zero", {"sampling_params": {"top_k": 0}}, ["'sampling_params.top_k'"]),
    ("top_k_float", {"sampling_params": {"top_k": 2.5}}, ["'sampling_params.top_k'"]),
    ("seed_string", {"sampling_params": {"seed": "x"}}, ["'sampling_params.seed'"]),
    ("stop_token_ids_strings", {"sampling_params": {"stop_token_ids": ["a"]}}, ["'sampling_params.stop_token_ids'"]),
    ("stop_token_ids_negative", {"sampling_params": {"stop_token_ids": [-1]}}, ["'sampling_params.stop_token_ids'"]),
    ("stop_int", {"sampling_params": {"stop": 7}}, ["'sampling_params.stop'"]),
    ("n_two", {"sampling_params": {"n": 2}}, ["'sampling_params.n'"]),
    ("sampling_params_string", {"sampling_params": "x"}, ["'sampling_params'"]),
    ("token_ids_strings", {"token_ids": ["a"]}, ["'token_ids'"]),
    ("token_ids_bools", {"token_ids": [True, False]}, ["'token_ids'"]),
    ("token_ids_beyond_vocab", {"token_ids": [10**6]}, ["beyond the tokenizer"]),
    ("lone_surrogate", '{"token_ids": [5], "request_id": "\\udc00"}', ["'request_id'", "not valid unicode"]),
    ("huge_integer", '{"token_ids": [' + "7" * 5000 + "]}", ["malformed json"]),
    ("deep_nesting", '{"token_ids": ' + "[" * 100_000 + "]" * 100_000 + "}", ["nested too deeply"]),
    ("broken_json", "{", ["malformed json"]),
]


def _body(base: dict, case) -> bytes:
    if isinstance(case, bytes):
        return case
    if isinstance(case, str):
        return case.encode("utf-8")
    return json.dumps({**base, **case}).encode()


def _check(http: httpx.Client, path: str, body: bytes, words: list[str]) -> httpx.Response:
    r = http.post(path, content=body, headers={"content-type": "application/json"})
    message = r.json()["error"]["message"]
    assert r.status_code == 400, (r.status_code, message)
    for word in words:
        assert word.lower() in message.lower(), (word, message)
    assert r.headers.get("connection") != "close", "a 400 must keep the connection"
    return r


@pytest.fixture(scope="module")
def chat_server(tiny_model_dir):
    with running_server(tiny_model_dir, "chat", sessions=len(CHAT_CASES) + 1) as served:
        yield served


@pytest.fixture(scope="module")
def token_server(tiny_model_dir):
    with running_server(tiny_model_dir, "tokens") as served:
        yield served


def test_chat_route_refuses_each_bad_field_with_400_and_serves_the_next(chat_server):
    server, sids = chat_server
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for (name, case, words), sid in zip(CHAT_CASES, sids):
            path = f"/sessions/{sid}/v1/chat/completions"
            _check(http, path, _body(GOOD_CHAT, case), words)
            ok = http.post(path, json=GOOD_CHAT)  # the same connection, the same session
            assert ok.status_code == 200, (name, ok.text)
            assert ok.json()["usage"]["completion_tokens"] <= 2


def test_chat_route_session_id_must_be_a_string(chat_server):
    server, sids = chat_server
    with httpx.Client(base_url=server.url, timeout=60) as http:
        _check(http, "/v1/chat/completions", json.dumps({**GOOD_CHAT, "session_id": [1]}).encode(), ["'session_id'"])
        ok = http.post("/v1/chat/completions", json={**GOOD_CHAT, "session_id": sids[-1]})
        assert ok.status_code == 200, ok.text


def test_token_route_refuses_each_bad_field_with_400_and_serves_the_next(token_server):
    server, _ = token_server
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for name, case, words in TOKEN_CASES:
            _check(http, "/inference/v1/generate", _body(GOOD_TOKENS, case), words)
            ok = http.post("/inference/v1/generate", json=GOOD_TOKENS)
            assert ok.status_code == 200, (name, ok.text)
            assert len(ok.json()["choices"][0]["token_ids"]) <= 2


def test_valid_sampling_values_reach_the_engine(token_server):
    """The checked values are the ones used: greedy (temperature 0) gives the same tokens twice, whatever
    the seed; top_k 1 is greedy too."""
    server, _ = token_server
    with httpx.Client(base_url=server.url, timeout=60) as http:
        outs = [http.post("/inference/v1/generate", json={"token_ids": [5, 6, 7], "sampling_params": sp}).json()
                for sp in ({"max_tokens": 4, "temperature": 0, "seed": 1}, {"max_tokens": 4, "temperature": 0, "seed": 2},
                           {"max_tokens": 4, "top_k": 1, "seed": 3, "top_p": 1.0})]
    ids = [o["choices"][0]["token_ids"] for o in outs]
    assert ids[0] == ids[1] == ids[2] and len(ids[0]) >= 1, ids
