"""serve-rm under the bad-request catalogue of issue 46 (over one raw keep-alive socket on 127.0.0.1): every bad
body a 4xx with the connection still serving the next request; 50 MB bodies refused at the limit; a client that
leaves mid-body one log line and no 500 in /health; slow clients answered 408 and closed."""

from __future__ import annotations


import httpx
import pytest

from rlhforge.config.serve_rm import ServeRewardConfig, ServeRMConfig
from rlhforge.net.server import ServerLimits
from rlhforge.rewards.server import RewardScorer, create_app, start_server_thread
from tests.model_helpers import tiny_reward_model
from tests.security.http_catalogue import (assert_large_bodies_refused, assert_slow_clients_closed, check_catalogue,
                                           common_bad_bodies, assert_disconnect_is_one_line)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

KEY = "rm-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 1 << 20


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    rm_dir = tiny_reward_model(tiny_model_dir, tmp_path_factory.mktemp("sec_rm") / "rm")
    scorer = RewardScorer.from_config(ServeRMConfig(reward=ServeRewardConfig(str(rm_dir))))
    app = create_app(scorer, api_key=KEY, max_request_bytes=LIMIT, body_timeout_s=1.0)
    with start_server_thread(app, limits=ServerLimits(header_timeout_s=1.0)) as handle:
        yield handle


def test_bad_request_catalogue_4xx_and_connection_kept(server):
    cases = [(name, "POST", "/get_reward", body, {"Content-Type": "application/json"})
             for name, body in common_bad_bodies(lambda v: b'{"query": [' + v + b"]}")]
    cases += [("wrong type", "POST", "/get_reward", b'{"query": 5}', None),
              ("wrong key", "POST", "/get_reward", b'{"query": ["x"]}', {"Authorization": "Bearer nope"})]
    seen = check_catalogue(server.port, cases, ("GET", "/health"), AUTH)
    assert {name: status for name, (status, _) in seen.items()} == {
        "broken JSON": 400, "empty": 400, "non-UTF-8": 400, "NaN": 400, "lone surrogate": 400,
        "5000-digit integer": 400, "100k-deep nesting": 400, "wrong type": 400, "wrong key": 401}
    assert "Exceeds the limit (4300 digits)" in seen["5000-digit integer"][1]
    assert "nested too deeply" in seen["100k-deep nesting"][1]
    assert "got float" in seen["NaN"][1]  # NaN passes the parser in serve-rm (labels may hold it), not the query
    assert httpx.get(f"{server.base_url}/health").json()["errors"]["500"] == 0


def test_50_mb_bodies_refused_at_the_limit(server):
    out = assert_large_bodies_refused(server.port, "/get_reward", ("GET", "/health"), LIMIT, AUTH)
    assert out["content-length"][0] == 413 and out["content-length"][2] < 2.0  # from its Content-Length, at once
    assert out["chunked"][0] == 413


def test_disconnect_mid_body_is_one_line_and_no_500(server, caplog):
    before = httpx.get(f"{server.base_url}/health").json()["errors"]
    assert_disconnect_is_one_line(server.port, "/get_reward", AUTH, caplog)
    after = httpx.get(f"{server.base_url}/health").json()["errors"]
    assert after["500"] == before["500"] == 0


def test_slow_clients_get_408_and_others_are_served(server):
    assert_slow_clients_closed(server.port, "/get_reward", ("GET", "/health"), 1.0, 1.0, AUTH)
