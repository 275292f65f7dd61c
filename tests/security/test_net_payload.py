"""rlhforge.net's pure pieces, value by value: the JSON parser's refusals and results, zstd bounded in its output,
the key check, and the shims that keep the old import paths (rewards.endpoints, rewards.client, rewards.http_service)
pointing at the same objects."""

from __future__ import annotations

import pytest
import zstandard

from rlhforge.net.errors import BadRequest, BodyTooLarge
from rlhforge.net.payload import decompress_zstd, parse_json
from rlhforge.net.server import key_matches, match_key
from tests.security.tinker_helpers import zstd_bomb


@pytest.mark.parametrize("body, reason", [
    (b"", "the body is empty"),
    (b"  \n", "the body is empty"),
    (b"{", "Expecting property name"),
    (b'{"a": "caf\xe9"}', "not UTF-8/16/32 text"),
    (b'{"a": NaN}', "NaN is not a JSON number"),
    (b'[Infinity]', "Infinity is not a JSON number"),
    (b'{"a": ["ok", "x\\ud800"]}', "'a'[1] is not valid Unicode: surrogates not allowed (U+D800 at character 1)"),
    (b'{"\\udfff": 1}', "a key of the body is not valid Unicode"),
    (b"9" * 5000, "Exceeds the limit (4300 digits)"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
])
def test_parse_json_refuses_with_the_reason(body, reason):
    with pytest.raises(BadRequest) as info:
        parse_json(body)
    assert info.value.status == 400 and reason in str(info.value), str(info.value)


def test_parse_json_values():
    assert parse_json(b'{"a": [1, 2.5, "\\ud83d\\ude00"]}') == {"a": [1, 2.5, "\U0001F600"]}  # a valid pair
    assert parse_json(b"", empty={}) == {}
    assert parse_json(b"9" * 4300) == int("9" * 4300)
    nan = parse_json(b'{"labels": [NaN]}', allow_nan=True)["labels"][0]
    assert nan != nan


def test_zstd_output_is_bounded_and_exact():
    data = bytes(range(256)) * 400  # 102400 bytes
    frame = zstandard.ZstdCompressor().compress(data)
    assert decompress_zstd(frame, len(data)) == data
    with pytest.raises(BodyTooLarge, match="declares 102400 bytes"):  # refused from the declared size
        decompress_zstd(frame, len(data) - 1)
    streamed = zstandard.ZstdCompressor(write_content_size=False).compress(data)
    with pytest.raises(BodyTooLarge, match="more than 102399 bytes"):  # counted while produced
        decompress_zstd(streamed, len(data) - 1)
    with pytest.raises(BodyTooLarge, match="--max_zstd_ratio"):  # 1 GiB from 32 KB: over 1000x
        decompress_zstd(zstd_bomb(declared=False), 2**31, max_ratio=1000)
    with pytest.raises(BadRequest, match="not a zstd frame"):
        decompress_zstd(b"plain", 1 << 20)


def test_key_check():
    assert match_key({"authorization": "Bearer k2"}, ("k1", "k2")) == "k2"
    assert match_key({"x-api-key": "k1"}, ("k1", "k2")) == "k1"
    assert match_key({"x-api-key": "k3"}, ("k1", "k2")) is None
    assert match_key({"authorization": "Basic k1", "x-api-key": "k1"}, ("k1",)) == "k1"
    assert key_matches({}, None) and not key_matches({}, "k1")


def test_old_import_paths_are_the_same_objects():
    import rlhforge.net.client as net_client
    import rlhforge.net.endpoints as net_endpoints
    import rlhforge.net.server as net_server
    import rlhforge.rewards.client as old_client
    import rlhforge.rewards.endpoints as old_endpoints
    import rlhforge.rewards.http_service as old_http

    for name in ("EndpointsFile", "EndpointsFileError", "EndpointSelector", "StaticEndpoints", "parse_endpoints"):
        assert getattr(old_endpoints, name) is getattr(net_endpoints, name)
    for name in ("RetryPolicy", "ServerHealth", "FailoverCall", "response_reason"):
        assert getattr(old_client, name) is getattr(net_client, name)
    for name in ("ServerHandle", "key_matches", "start_server_thread"):
        assert getattr(old_http, name) is getattr(net_server, name)
    assert issubclass(old_client.RewardServerError, net_client.ServiceError)
