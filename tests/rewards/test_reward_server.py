"""Reward server and client over real HTTP on localhost: rewards equal the model's own forward,
concurrent requests are pooled into batches, bad requests get 400 with a reason, the API key is
enforced, several URLs are sharded in order, transient failures are retried, and a server that
dies makes the client fail with a message naming its URL."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from rlhforge.config.parsing import ConfigError, parse_args
from rlhforge.config.serve_rm import ServeRewardConfig, ServeRMConfig
from rlhforge.rewards.client import RemoteRewardClient, RewardServerError, post_json, shard_bounds
from rlhforge.rewards.server import RewardScorer, create_app, start_server_thread
from tests.model_helpers import tiny_reward_model

MEAN, STD = 0.25, 2.0
TEXTS = ["Q: What is 1 + 2?\nA: 3", "Q: What is 1 + 2?\nA: I am not sure, maybe 7.", "hello",
         "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>", "a b c d e f g h"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def rm_dir(tiny_model_dir, tmp_path_factory):
    """A tiny reward model (random one-label head) with stored reward statistics."""
    return tiny_reward_model(tiny_model_dir, tmp_path_factory.mktemp("served") / "rm", reward_mean=MEAN, reward_std=STD)


@pytest.fixture(scope="module")
def expected(rm_dir):
    """Rewards from the model's own HF forward, one unpadded sequence at a time."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    tok = AutoTokenizer.from_pretrained(rm_dir)
    out = {}
    with torch.no_grad():
        for text in TEXTS:
            ids = tok(text).input_ids  # this tokenizer adds no BOS
            if ids[-1] != tok.eos_token_id:  # a scored text ends with EOS (added unless already there)
                ids.append(tok.eos_token_id)
            out[text] = model(torch.tensor([ids])).logits[0, 0].item()
    return out


@pytest.fixture(scope="module")
def scorer(rm_dir):
    return RewardScorer.from_config(ServeRMConfig(reward=ServeRewardConfig(str(rm_dir)), batch_size=4))


@pytest.fixture(scope="module")
def server(scorer):
    with start_server_thread(create_app(scorer, max_batch=64, max_wait_ms=20)) as handle:
        yield handle


def test_rewards_equal_the_models_direct_forward(server, expected):
    response = httpx.post(server.url, json={"query": TEXTS, "prompts": ["p"] * len(TEXTS), "labels": ["l"] * len(TEXTS)})
    assert response.status_code == 200
    body = response.json()
    want = [expected[t] for t in TEXTS]
    assert body["rewards"] == pytest.approx(want, abs=1e-5)
    assert body["scores"] == body["rewards"] and body["extra_logs"]["raw_reward"] == body["rewards"]
    assert httpx.post(server.url, json={"query": []}).json() == {"rewards": [], "scores": [], "extra_logs": {"raw_reward": []}}


def test_packed_scoring_and_normalisation(rm_dir, expected):
    cfg = parse_args(ServeRMConfig, ["--reward.model_name_or_path", str(rm_dir), "--reward.normalize_enable",
                                     "--ds.packing_samples", "--batch_size", "2"])
    rewards, raw = RewardScorer.from_config(cfg).score(TEXTS)
    assert raw == pytest.approx([expected[t] for t in TEXTS], abs=1e-5)
    assert rewards == pytest.approx([(expected[t] - MEAN) / STD for t in TEXTS], abs=1e-5)


def test_concurrent_requests_are_answered_correctly_and_batched(server, expected):
    async def many():
        async with httpx.AsyncClient(timeout=60) as http:
            requests = [http.post(server.url, json={"query": [TEXTS[i % 5], TEXTS[(i + 2) % 5]]}) for i in range(16)]
            return await asyncio.gather(*requests)

    before = httpx.get(f"{server.base_url}/health").json()
    responses = asyncio.run(many())
    for i, response in enumerate(responses):
        assert response.json()["rewards"] == pytest.approx([expected[TEXTS[i % 5]], expected[TEXTS[(i + 2) % 5]]], abs=1e-5)
    after = httpx.get(f"{server.base_url}/health").json()
    assert after["status"] == "ok" and after["requests"] - before["requests"] == 16
    assert after["batches"] - before["batches"] < 16  # requests were pooled into shared forward passes


@pytest.mark.parametrize("body, reason", [
    (b"{not json", "malformed JSON"),
    (b"[1, 2]", "expected a JSON object"),
    (b'{"queries": ["x"]}', "missing 'query'"),
    (b'{"query": "x"}', "got a single string"),
    (b'{"query": ["x", 3]}', "'query'[1] must be a string"),
    (b'{"query": ["x"], "labels": ["a", "b"]}', "'labels' has 2 entries but 'query' has 1"),
])
def test_bad_requests_get_400_with_a_reason(server, body, reason):
    response = httpx.post(server.url, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert reason in response.json()["error"]


def test_api_key_is_required_when_set(scorer, expected):
    with start_server_thread(create_app(scorer, api_key="s3cret")) as handle:
        assert httpx.post(handle.url, json={"query": TEXTS[:1]}).status_code == 401
        assert httpx.post(handle.url, json={"query": TEXTS[:1]}, headers={"X-API-Key": "wrong"}).status_code == 401
        assert httpx.get(f"{handle.base_url}/health").status_code == 200  # liveness needs no key
        result = RemoteRewardClient(handle.url, api_key="s3cret").get_rewards_sync(TEXTS[:1])
        assert result.rewards == pytest.approx([expected[TEXTS[0]]], abs=1e-5)
        with pytest.raises(RewardServerError, match=rf"{handle.url} rejected the request: HTTP 401"):
            RemoteRewardClient(handle.url, max_attempts=3).get_rewards_sync(TEXTS[:1])  # 4xx: no retry


def test_client_shards_contiguously_over_several_urls(scorer, server, expected):
    with start_server_thread(create_app(scorer)) as second:
        queries = [TEXTS[i % 5] for i in range(7)]
        before = [httpx.get(f"{h.base_url}/health").json()["queries"] for h in (server, second)]
        result = RemoteRewardClient(f"{server.url},{second.url}").get_rewards_sync(queries, labels=list(range(7)))
        after = [httpx.get(f"{h.base_url}/health").json()["queries"] for h in (server, second)]
    assert result.rewards == pytest.approx([expected[q] for q in queries], abs=1e-5)
    assert result.scores == result.rewards and len(result.extra_logs["raw_reward"]) == 7
    assert [a - b for a, b in zip(after, before)] == [4, 3]
    assert shard_bounds(7, 2) == [(0, 4), (4, 7)] and shard_bounds(1, 3) == [(0, 1), (1, 1), (1, 1)]


def test_transient_server_errors_are_retried():
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app, calls = FastAPI(), []

    @app.post("/get_reward")
    async def flaky(payload: dict):
        calls.append(payload)
        if len(calls) < 3:
            return JSONResponse({"error": "warming up"}, status_code=503)
        return {"rewards": [1.0] * len(payload["query"])}  # no scores: the client falls back to rewards

    with start_server_thread(app) as handle:
        result = RemoteRewardClient(handle.url, max_attempts=4, backoff_s=0.01).get_rewards_sync(["a", "b"])
        assert len(calls) == 3 and result.rewards == result.scores == [1.0, 1.0]
        # the same policy for one payload (used by the RL trainer's RemoteReward)
        assert asyncio.run(post_json(handle.url, {"query": ["c"]}, 5.0, backoff_s=0.01)) == {"rewards": [1.0]}
        calls.clear()
        with pytest.raises(RewardServerError, match="failed after 2 attempts; last error: HTTP 503: warming up"):
            asyncio.run(post_json(handle.url, {"query": ["c"]}, 5.0, max_attempts=2, backoff_s=0.01))


def test_a_server_that_dies_mid_run_fails_with_its_url(scorer, expected):
    handle = start_server_thread(create_app(scorer))
    client = RemoteRewardClient(handle.url, max_attempts=3, backoff_s=0.02, timeout=5)
    assert client.get_rewards_sync(TEXTS[:2]).rewards == pytest.approx([expected[t] for t in TEXTS[:2]], abs=1e-5)
    handle.stop()
    with pytest.raises(RewardServerError, match=rf"reward server {handle.url} failed after 3 attempts; last error: Connect") as err:
        client.get_rewards_sync(TEXTS[:2])
    assert err.value.url == handle.url


def test_serve_rm_flags(rm_dir):
    from rlhforge.cli.serve_rm import SERVE_RM_LEGACY_ALIASES

    cfg = parse_args(ServeRMConfig, ["--reward.model_name_or_path", "m", "--reward.normalize_enable",
                                     "--ds.value_head_prefix", "score", "--data.max_len", "128", "--port", "5001",
                                     "--batch_size", "8", "--ds.param_dtype", "bf16", "--ds.packing_samples",
                                     "--data.disable_fast_tokenizer", "--ds.attn_implementation", "eager"])
    assert (cfg.reward.normalize_enable, cfg.data.max_len, cfg.port, cfg.batch_size, cfg.ds.param_dtype) == \
           (True, 128, 5001, 8, "bf16")
    assert cfg.host == "127.0.0.1" and ServeRMConfig().port == 5000  # loopback by default (OpenRLHF: 0.0.0.0)
    legacy = parse_args(ServeRMConfig, ["--reward_pretrain", "m", "--normalize_reward", "--max_len", "64"],
                        legacy=SERVE_RM_LEGACY_ALIASES)
    assert (legacy.reward.model_name_or_path, legacy.reward.normalize_enable, legacy.data.max_len) == ("m", True, 64)
    with pytest.raises(ConfigError, match="--use_ms"):
        parse_args(ServeRMConfig, ["--reward.model_name_or_path", "m", "--use_ms"])
    with pytest.raises(ConfigError, match="reward.model_name_or_path is required"):
        parse_args(ServeRMConfig, [])
    # normalisation needs stored statistics
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(rm_dir)
    assert (config.reward_mean, config.reward_std) == (MEAN, STD)
    bare = rm_dir.parent / "bare"
    if not bare.exists():
        import shutil

        shutil.copytree(rm_dir, bare)
        text = (bare / "config.json").read_text().replace('"reward_mean"', '"x_mean"').replace('"reward_std"', '"x_std"')
        (bare / "config.json").write_text(text)
    with pytest.raises(ConfigError, match="has no reward statistics"):
        RewardScorer.from_config(ServeRMConfig(reward=ServeRewardConfig(str(bare), normalize_enable=True)))


def test_every_openrlhf_serve_rm_flag_is_accepted():
    from tests.flag_tables import openrlhf_flag_rows

    rows = openrlhf_flag_rows("serve_rm")
    assert len(rows) == 14
    base = ["--reward.model_name_or_path", "m"]
    for flag, kind, _default, choices, _nargs in rows:
        if flag in base:
            continue
        vals = [choices.strip("[]").split(",")[0].strip().strip("'")] if choices else \
            [] if kind == "store_true" else {"int": ["2"], "str": ["x"]}[kind]
        try:
            parse_args(ServeRMConfig, base + [flag, *vals])
        except ConfigError as err:
            assert flag.split(".")[-1].lstrip("-") in str(err), (flag, err)
        except SystemExit as err:
            raise AssertionError(f"{flag} {vals} was rejected by the parser") from err
