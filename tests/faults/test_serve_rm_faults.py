"""``serve-rm`` stays correct under bad input and load (issue #16, item 2), over real HTTP on 127.0.0.1.

Every request is checked on its own before it joins a batch: one bad request among concurrent good
ones gets its own 400 and the good ones get exactly the rewards they get alone; every malformed body
is a 400 (never a 500); an oversize body is a 413; a full queue is a 503 with Retry-After; a
keep-alive connection stays usable after an error; a model failure on one request does not fail its
neighbours; long queries are cut to max_len tokens without tokenising the whole text; SIGTERM to
``rlhforge serve-rm`` answers the requests in flight and exits 0."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from rlhforge.config.serve_rm import ServeDataConfig, ServeRewardConfig, ServeRMConfig
from rlhforge.rewards.server import RewardScorer, create_app, start_server_thread
from tests.model_helpers import tiny_reward_model

GOOD = ["Q: What is 1 + 2?\nA: 3", "hello world", "a b c d e f g h", "What is 7 * 8? The answer is 56.",
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>"]

DEEP = b'{"query": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
MALFORMED = [
    (b"{not json", "malformed JSON"),
    (b"", "malformed JSON"),
    (b'{"query": ["caf\xe9"]}', "not UTF-8/16/32 text"),  # latin-1 byte in a UTF-8 body
    (b'{"query": ["ok", "\\ud800"]}', "'query'[1] is not valid Unicode: surrogates not allowed (U+D800"),
    (b'{"query": ["x\\udfff y"]}', "'query'[0] is not valid Unicode"),
    (DEEP, "nested too deeply"),
    (b'{"query": ["a"], "labels": [' + b"7" * 5000 + b"]}", "Exceeds the limit (4300 digits)"),
    (b'{"query": ' + b"9" * 5000 + b"}", "Exceeds the limit (4300 digits)"),
    (b"[1, 2]", "expected a JSON object"),
    (b'"just a string"', "expected a JSON object"),
    (b'{"queries": ["x"]}', "missing 'query'"),
    (b'{"query": null}', "'query' must be a list of strings, got NoneType"),
    (b'{"query": "x"}', "got a single string"),
    (b'{"query": 5}', "'query' must be a list of strings, got int"),
    (b'{"query": ["x", 3]}', "'query'[1] must be a string, got int"),
    (b'{"query": [["nested"]]}', "'query'[0] must be a string, got list"),
    (b'{"query": ["x"], "prompts": "p"}', "'prompts' must be a list, got str"),
    (b'{"query": ["x"], "labels": {"a": 1}}', "'labels' must be a list, got dict"),
    (b'{"query": ["x"], "labels": ["a", "b"]}', "'labels' has 2 entries but 'query' has 1"),
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    return tiny_reward_model(tiny_model_dir, tmp_path_factory.mktemp("faults") / "rm")


@pytest.fixture(scope="module")
def scorer(rm_dir):
    return RewardScorer.from_config(ServeRMConfig(reward=ServeRewardConfig(str(rm_dir)), batch_size=64))


@pytest.fixture(scope="module")
def server(scorer):
    with start_server_thread(create_app(scorer, max_batch=64, max_wait_ms=100, max_request_bytes=1 << 20)) as handle:
        yield handle


@pytest.fixture(scope="module")
def alone(server):
    """Each good text's reward when sent alone, one request at a time."""
    return {t: httpx.post(server.url, json={"query": [t]}, timeout=60).json()["rewards"][0] for t in GOOD}


def _health(server) -> dict:
    return httpx.get(f"{server.base_url}/health", timeout=30).json()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bad", [MALFORMED[3][0], DEEP, MALFORMED[6][0], MALFORMED[14][0]],
                         ids=["lone-surrogate", "deep-nesting", "huge-int", "wrong-type"])
def test_one_bad_request_among_16_good_ones_gets_its_own_400(server, alone, bad):
    async def burst():
        async with httpx.AsyncClient(timeout=60) as http:
            good = [http.post(server.url, json={"query": [GOOD[i % 5], GOOD[(i + 1) % 5]]}) for i in range(16)]
            bad_one = http.post(server.url, content=bad, headers={"content-type": "application/json"})
            return await asyncio.gather(*good[:8], bad_one, *good[8:])

    before = _health(server)
    responses = asyncio.run(burst())
    after = _health(server)
    bad_response = responses.pop(8)
    assert bad_response.status_code == 400 and bad_response.json()["error"]
    for i, response in enumerate(responses):
        assert response.status_code == 200, response.text
        assert response.json()["rewards"] == pytest.approx([alone[GOOD[i % 5]], alone[GOOD[(i + 1) % 5]]], abs=1e-5)
    assert after["requests"] - before["requests"] == 16
    assert after["batches"] - before["batches"] < 16  # the good ones were batched together
    assert after["errors"]["400"] - before["errors"]["400"] == 1 and after["errors"]["500"] == 0


@pytest.mark.timeout(120)
def test_every_malformed_body_is_a_400_and_the_connection_stays_usable(server, alone):
    with httpx.Client(timeout=60) as http:
        first = http.post(server.url, json={"query": [GOOD[0]]})
        port = first.extensions["network_stream"].get_extra_info("client_addr")[1]
        for body, reason in MALFORMED:
            response = http.post(server.url, content=body, headers={"content-type": "application/json"})
            assert response.status_code == 400, (body[:60], response.status_code, response.text[:200])
            assert reason in response.json()["error"], (body[:60], response.json())
            # the same keep-alive connection answers the next request correctly
            ok = http.post(server.url, json={"query": [GOOD[1]]})
            assert ok.status_code == 200 and ok.json()["rewards"] == pytest.approx([alone[GOOD[1]]], abs=1e-5)
            assert ok.extensions["network_stream"].get_extra_info("client_addr")[1] == port
    assert _health(server)["errors"]["500"] == 0


@pytest.mark.timeout(120)
def test_oversize_bodies_get_413_without_being_parsed(scorer):
    limit = 4096
    with start_server_thread(create_app(scorer, max_request_bytes=limit)) as handle, httpx.Client(timeout=60) as http:
        just = {"query": ["x" * (limit - 20)]}
        assert len(httpx.Request("POST", handle.url, json=just).content) <= limit
        assert http.post(handle.url, json=just).status_code == 200  # at the limit: fine
        over = http.post(handle.url, content=b'{"query": ["' + b"y" * limit + b'"]}')
        assert over.status_code == 413 and f"limit of {limit} bytes (--max_request_bytes)" in over.json()["error"]
        port = over.extensions["network_stream"].get_extra_info("client_addr")[1]
        again = http.post(handle.url, json={"query": ["z"]})  # a body up to 4x the limit is drained: same connection
        assert again.status_code == 200 and again.extensions["network_stream"].get_extra_info("client_addr")[1] == port
        # far over the limit (16 MB, not JSON at all: it is never parsed), and a chunked body of unknown length
        huge = http.post(handle.url, content=b"{" * (16 << 20))
        assert huge.status_code == 413 and huge.headers["connection"] == "close"
        chunked = http.post(handle.url, content=iter([b'{"query": ["', b"w" * limit, b'"]}']))
        assert chunked.status_code == 413 and chunked.headers["connection"] == "close"
        assert http.post(handle.url, json={"query": ["z"]}).status_code == 200  # a new connection, same client
        assert _health(handle)["errors"] == {"400": 0, "401": 0, "413": 3, "500": 0, "503": 0}


class _GatedScorer:
    """A scorer whose forward passes wait for ``gate`` (to hold requests in flight), and that fails on
    any batch containing ``poison`` ids."""

    def __init__(self, scorer: RewardScorer, poison: str | None = None):
        self.inner, self.gate = scorer, threading.Event()
        self.max_len, self.normalize = scorer.max_len, scorer.normalize
        self.poison = scorer.encode(poison) if poison else None

    def encode(self, text):
        return self.inner.encode(text)

    def score_ids(self, ids):
        assert self.gate.wait(60)
        if self.poison is not None and self.poison in ids:
            raise RuntimeError("CUDA error: device-side assert triggered")
        return self.inner.score_ids(ids)


@pytest.mark.timeout(120)
def test_a_full_queue_answers_503_with_retry_after(scorer, alone):
    gated = _GatedScorer(scorer)
    with start_server_thread(create_app(gated, max_queue=2, max_wait_ms=0)) as handle:
        results: dict[int, httpx.Response] = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(
            i, httpx.post(handle.url, json={"query": [GOOD[i]]}, timeout=60))) for i in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while _health(handle)["in_flight"] < 2:  # both admitted, held by the gate
            assert time.monotonic() < deadline, "requests never reached the server"
            time.sleep(0.02)
        full = httpx.post(handle.url, json={"query": [GOOD[2]]}, timeout=60)
        assert full.status_code == 503
        assert "--max_queue 2" in full.json()["error"] and int(full.headers["retry-after"]) >= 1
        gated.gate.set()
        for t in threads:
            t.join(60)
        assert [results[i].status_code for i in range(2)] == [200, 200]
        assert [results[i].json()["rewards"][0] for i in range(2)] == pytest.approx([alone[GOOD[0]], alone[GOOD[1]]],
                                                                                     abs=1e-5)
        later = httpx.post(handle.url, json={"query": [GOOD[2]]}, timeout=60)  # room again
        assert later.status_code == 200 and later.json()["rewards"] == pytest.approx([alone[GOOD[2]]], abs=1e-5)


@pytest.mark.timeout(120)
def test_a_model_failure_on_one_request_does_not_fail_its_neighbours(scorer, alone):
    gated = _GatedScorer(scorer, poison="POISON")
    with start_server_thread(create_app(gated, max_batch=64, max_wait_ms=50)) as handle:
        async def burst():
            async with httpx.AsyncClient(timeout=60) as http:
                tasks = [asyncio.create_task(http.post(handle.url, json={"query": [GOOD[i % 5]]})) for i in range(6)]
                tasks.insert(3, asyncio.create_task(http.post(handle.url, json={"query": ["POISON"]})))
                deadline = time.monotonic() + 30
                while (await http.get(f"{handle.base_url}/health")).json()["in_flight"] < 7:
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.02)
                gated.gate.set()  # all 7 are queued: they form one batch, which fails, then go one by one
                return await asyncio.gather(*tasks)

        responses = asyncio.run(burst())
        poisoned = responses.pop(3)
        assert poisoned.status_code == 500 and "device-side assert" in poisoned.json()["error"]
        assert [r.status_code for r in responses] == [200] * 6
        assert [r.json()["rewards"][0] for r in responses] == pytest.approx([alone[GOOD[i % 5]] for i in range(6)],
                                                                            abs=1e-5)


def test_long_queries_are_cut_to_max_len_tokens_before_tokenising(rm_dir):
    from rlhforge.models.reward import encode_reward_text

    cfg = ServeRMConfig(reward=ServeRewardConfig(str(rm_dir)), data=ServeDataConfig(max_len=16))
    short = RewardScorer.from_config(cfg)
    texts = ["What is 7 * 8? " * 20_000, "x" * 300_000, " " * 50_000 + "hello world " * 10,
             "<|im_start|>user\n" + "9" * 100_000, "short text"]
    for text in texts:
        assert short.encode(text) == encode_reward_text(short.tokenizer, text, 16), text[:40]
    assert all(len(short.encode(t)) <= 16 for t in texts)
    rewards, _raw = short.score(texts[:1])
    assert rewards == pytest.approx(short.score_ids([encode_reward_text(short.tokenizer, texts[0], 16)])[0], abs=1e-6)


# --------------------------------------------------------------------------------------------- the CLI


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(240)
def test_sigterm_answers_the_requests_in_flight_and_exits_0(rm_dir, alone, tmp_path):
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    # --max_wait_ms 3000: requests wait in the batcher for 3 s, so they are in flight when SIGTERM comes
    cmd = [sys.executable, "-m", "rlhforge", "serve-rm", "--reward.model_name_or_path", str(rm_dir), "--port",
           str(port), "--max_wait_ms", "3000", "--log_level", "warning"]
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2], env=env)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "serve-rm did not start"
            time.sleep(0.2)
        results: dict[int, httpx.Response] = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(
            i, httpx.post(f"{base}/get_reward", json={"query": [GOOD[i]]}, timeout=60))) for i in range(4)]
        for t in threads:
            t.start()
        while httpx.get(f"{base}/health", timeout=5).json()["in_flight"] < 4:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        for t in threads:
            t.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
    out = (tmp_path / "serve.log").read_text()
    assert code == 0, out
    assert [results[i].status_code for i in range(4)] == [200] * 4
    assert [results[i].json()["rewards"][0] for i in range(4)] == pytest.approx([alone[t] for t in GOOD[:4]], abs=1e-5)
    assert "stopped (SIGTERM) after finishing the requests in flight" in out
    with pytest.raises(httpx.ConnectError):  # and it is gone
        httpx.get(f"{base}/health", timeout=5)
