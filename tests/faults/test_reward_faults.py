"""Reward clients that cannot hang (issue #16, item 1), over real sockets on 127.0.0.1.

A frozen server (accepts connections, never answers) costs exactly ``retries + 1`` bounded
attempts, each reported on one line; several URLs fail over to each other (a shard whose server
fails goes to the next live one, and later calls skip the failed one); when every server fails the
error names each URL with its cause, and ``rlhforge rl`` stops with exit 3. Every test is bounded
(pytest-timeout) and uses a handful of requests."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from rlhforge.rewards.base import RewardBatch, RewardError
from rlhforge.rewards.client import (
    RemoteRewardClient,
    RetryPolicy,
    RewardServerError,
    ServerHealth,
    post_with_failover,
)
from rlhforge.rewards.server import start_server_thread
from rlhforge.rewards.sources import RemoteReward
from tests.faults.reward_helpers import FrozenServer, length_reward_app

QUERIES = ["a", "bb", "ccc", "dddd", "eeeee"]
FAST = RetryPolicy(timeout=0.5, retries=1, backoff_s=0.05)


@pytest.fixture
def frozen():
    with FrozenServer() as server:
        yield server


@pytest.fixture
def healthy():
    calls: list = []
    with start_server_thread(length_reward_app(calls)) as handle:
        handle.calls = calls
        yield handle


def _batch(queries=QUERIES) -> RewardBatch:
    n = len(queries)
    return RewardBatch(queries=list(queries), prompts=["p"] * n, responses=list(queries), labels=list(range(n)),
                       datasources=[None] * n)


@pytest.mark.timeout(60)
def test_a_frozen_server_costs_exactly_the_configured_attempts_each_logged(frozen):
    lines: list[str] = []
    client = RemoteRewardClient(frozen.url, policy=FAST, log=lines.append)
    with pytest.raises(RewardServerError) as err:
        client.get_rewards_sync(QUERIES)
    assert str(err.value) == (f"reward server {frozen.url} failed after 2 attempts; last error: no answer within "
                              "0.5 s")
    assert err.value.url == frozen.url and list(err.value.causes) == [frozen.url]
    assert isinstance(err.value, RewardError)  # so the RL run maps it to exit 3
    assert frozen.accepted == 2  # one connection per attempt, no more
    assert len(lines) == 2
    assert lines[0].startswith(f"[rlhforge] reward server {frozen.url}: attempt 1/2 failed: no answer within 0.5 s; "
                               "retrying in ")
    assert lines[1] == f"[rlhforge] reward server {frozen.url}: attempt 2/2 failed: no answer within 0.5 s; giving up"


@pytest.mark.timeout(60)
def test_a_shard_fails_over_to_the_live_server_and_later_calls_skip_the_dead_one(frozen, healthy):
    lines: list[str] = []
    client = RemoteRewardClient([frozen.url, healthy.url], policy=FAST, log=lines.append,
                                health=ServerHealth(cooldown_s=600))
    result = client.get_rewards_sync(QUERIES, labels=list(range(5)))
    assert result.rewards == pytest.approx([len(q) / 10 for q in QUERIES])  # order kept across the failover
    assert result.scores == pytest.approx([len(q) / 20 for q in QUERIES])
    assert result.extra_logs["chars"] == [1, 2, 3, 4, 5]
    # the first shard (3 queries) was meant for the frozen server; it went to the healthy one after 2 attempts
    assert sorted(len(c["query"]) for c in healthy.calls) == [2, 3]
    assert frozen.accepted == 2
    assert lines[-1] == (f"[rlhforge] reward server {frozen.url}: attempt 2/2 failed: no answer within 0.5 s; "
                         f"sending its 3 queries to {healthy.url}")
    # the next call sends everything to the live server at once: no attempt on the frozen one
    lines.clear()
    again = client.get_rewards_sync(QUERIES)
    assert again.rewards == result.rewards and frozen.accepted == 2 and lines == []
    assert len(healthy.calls[-1]["query"]) == 5


@pytest.mark.timeout(60)
def test_all_servers_failing_names_each_url_and_cause(frozen):
    with start_server_thread(length_reward_app(status=500)) as broken:
        lines: list[str] = []
        client = RemoteRewardClient(f"{frozen.url},{broken.url}", policy=FAST, log=lines.append)
        with pytest.raises(RewardServerError) as err:
            client.get_rewards_sync(QUERIES)
    msg = str(err.value)
    assert msg.startswith("all 2 reward servers failed: ")
    assert f"{frozen.url} failed after 2 attempts; last error: no answer within 0.5 s" in msg
    assert f"{broken.url} failed after 2 attempts; last error: HTTP 500: always 500" in msg
    assert set(err.value.causes) == {frozen.url, broken.url}
    # each server was tried by one shard only: the broken server's shard waited for the outcome of the
    # frozen server's attempts instead of piling onto it (2 + 2 attempts in all)
    assert frozen.accepted == 2 and len(lines) == 4
    assert any(x.endswith(f"HTTP 500: always 500; sending its 2 queries to {frozen.url}") for x in lines)
    assert lines[-1].endswith("no answer within 0.5 s; no other reward server left")


@pytest.mark.timeout(60)
def test_client_errors_and_broken_answers_fail_over_without_retrying_the_same_server(healthy):
    rejected: list = []
    short: list = []
    with start_server_thread(length_reward_app(rejected, status=400)) as bad, \
            start_server_thread(length_reward_app(short, wrong_length=True)) as liar:
        lines: list[str] = []
        client = RemoteRewardClient([bad.url, liar.url, healthy.url], policy=RetryPolicy(timeout=5, retries=3),
                                    log=lines.append)
        assert client.get_rewards_sync(QUERIES).rewards == pytest.approx([len(q) / 10 for q in QUERIES])
    assert len(rejected) == 1 and len(short) == 1  # no retry of a 400 or a wrong-length answer
    assert any(f"{bad.url}: attempt 1/4 failed: rejected the request: HTTP 400: always 400" in x for x in lines)
    assert any(f"{liar.url}: attempt 1/4 failed: answered with 1 rewards for 2 queries" in x for x in lines)


@pytest.mark.timeout(60)
def test_retry_after_is_honoured_and_a_recovering_server_is_used():
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app, calls = FastAPI(), []

    @app.post("/get_reward")
    async def busy_then_ok(payload: dict):
        calls.append(payload)
        if len(calls) == 1:
            return JSONResponse({"error": "busy"}, status_code=503, headers={"Retry-After": "0.3"})
        return {"rewards": [1.0] * len(payload["query"])}

    with start_server_thread(app) as handle:
        lines: list[str] = []
        policy = RetryPolicy(timeout=5, retries=2, backoff_s=0.01)
        result = RemoteRewardClient(handle.url, policy=policy, log=lines.append).get_rewards_sync(["x"])
    assert result.rewards == [1.0] and len(calls) == 2
    assert len(lines) == 1 and "attempt 1/3 failed: HTTP 503: busy; retrying in 0.3 s" in lines[0]
    assert policy.delay(1, retry_after=1000) == policy.max_backoff_s  # capped


@pytest.mark.timeout(60)
def test_post_with_failover_returns_the_server_that_answered(frozen, healthy):
    async def go():
        async with httpx.AsyncClient() as http:
            return await post_with_failover(http, [frozen.url, healthy.url], {"query": ["abcd"]}, FAST,
                                            log=lambda _m: None)

    url, data = asyncio.run(go())
    assert url == healthy.url and data["rewards"] == [0.4]


@pytest.mark.timeout(60)
def test_rl_reward_source_interleaves_shards_and_fails_over(frozen, healthy):
    lines: list[str] = []
    source = RemoteReward([healthy.url, frozen.url], policy=FAST, log=lines.append)
    out = asyncio.run(source(_batch()))
    assert out["rewards"] == pytest.approx([len(q) / 10 for q in QUERIES])
    assert out["scores"] == pytest.approx([len(q) / 20 for q in QUERIES])
    assert out["extra_logs"]["chars"] == [1, 2, 3, 4, 5]
    assert sorted(c["query"] for c in healthy.calls) == [["a", "ccc", "eeeee"], ["bb", "dddd"]]
    assert sorted(c["labels"] for c in healthy.calls) == [[0, 2, 4], [1, 3]]  # prompts/labels travel with the shard
    assert frozen.accepted == 2 and f"sending its 2 queries to {healthy.url}" in lines[-1]


@pytest.mark.timeout(60)
def test_rl_reward_source_takes_its_policy_from_the_reward_flags(frozen):
    from rlhforge.config.rl import RewardConfig

    cfg = RewardConfig(remote_url=frozen.url, timeout=0.5, retries=0, retry_backoff_s=0.0)
    source = RemoteReward.from_config(cfg, [frozen.url])
    assert source.policy == RetryPolicy(timeout=0.5, retries=0, backoff_s=0.0)
    with pytest.raises(RewardServerError, match=r"failed after 1 attempt; last error: no answer within 0.5 s"):
        asyncio.run(source(_batch()))
    assert frozen.accepted == 1


def test_policy_and_flag_validation():
    from rlhforge.cli.train_ppo_ray import parse_rl_args
    from rlhforge.config.parsing import ConfigError

    base = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "builtin:arithmetic",
            "--rollout.batch_size", "8", "--train.batch_size", "8", "--reward.remote_url", "http://127.0.0.1:1/x"]
    cfg = parse_rl_args([*base, "--reward.timeout", "2.5", "--reward.retries", "4", "--reward.retry_backoff_s", "0.2"])
    assert (cfg.reward.timeout, cfg.reward.retries, cfg.reward.retry_backoff_s) == (2.5, 4, 0.2)
    assert RemoteReward.from_config(cfg.reward, ["http://127.0.0.1:1/x"]).policy.attempts == 5
    for flag, value, rule in (("--reward.timeout", "0", "must be a number of seconds > 0"),
                              ("--reward.retries", "-1", "must be >= 0"),
                              ("--reward.retry_backoff_s", "-0.5", "must be >= 0")):
        with pytest.raises(ConfigError, match=f"{flag} {rule}"):
            parse_rl_args([*base, flag, value])
    with pytest.raises(ValueError, match="retries must be >= 0"):
        RetryPolicy(retries=-1)
    assert [RetryPolicy(backoff_s=1.0, max_backoff_s=3.0).delay(k) <= 3.3 for k in (1, 2, 3, 4)] == [True] * 4
    assert 0.9 <= RetryPolicy(backoff_s=1.0).delay(1) <= 1.1 and 1.8 <= RetryPolicy(backoff_s=1.0).delay(2) <= 2.2


# --------------------------------------------------------------------------------------------- rlhforge rl


@pytest.mark.timeout(300)
def test_rl_run_against_a_frozen_server_stops_with_exit_3_naming_it(frozen, tiny_model_dir, tmp_path, capsys,
                                                                     one_torch_thread):
    from rlhforge.cli.train_ppo_ray import main as rl_main
    from tests.rl.helpers import rl_args

    with pytest.raises(SystemExit) as exc:
        rl_main(rl_args(tiny_model_dir, tmp_path / "run", "--reward.remote_url", frozen.url,
                        "--reward.timeout", "1", "--reward.retries", "1", "--reward.retry_backoff_s", "0.1", steps=1))
    out = capsys.readouterr()
    assert exc.value.code == 3
    last = out.err.strip().splitlines()[-1]
    assert last == (f"python -m rlhforge.cli.train_ppo_ray: error: reward servers failed during the run: reward "
                    f"server {frozen.url} failed after 2 attempts; last error: no answer within 1 s")
    assert f"[rlhforge] reward server {frozen.url}: attempt 1/2 failed: no answer within 1 s; retrying in" in out.err
    # the start-up probe saw a server that takes connections and says nothing: one warning, then the run started
    assert f"warning: reward server {frozen.url} accepted the connection but sent no answer" in out.out
    assert frozen.accepted == 3  # the probe + 2 attempts


@pytest.mark.timeout(300)
def test_rl_run_fails_over_to_a_second_url_and_finishes(frozen, healthy, tiny_model_dir, tmp_path, capsys,
                                                        one_torch_thread):
    from rlhforge.cli.train_ppo_ray import main as rl_main
    from tests.rl.helpers import metrics, rl_args

    out_dir = tmp_path / "run"
    assert rl_main(rl_args(tiny_model_dir, out_dir, "--reward.remote_url", f"{frozen.url},{healthy.url}",
                           "--reward.timeout", "1", "--reward.retries", "1", "--reward.retry_backoff_s", "0.1",
                           steps=2)) == 0
    err = capsys.readouterr().err
    assert f"[rlhforge] reward server {frozen.url}: attempt 2/2 failed: no answer within 1 s; sending its 4 queries " \
           f"to {healthy.url}" in err
    scored = [q for c in healthy.calls for q in c["query"]]
    assert len(scored) == 16  # 2 steps x 4 prompts x 2 samples, all answered by the healthy server
    recs = [r for r in metrics(out_dir) if "rollout/reward_mean" in r]
    assert len(recs) == 2
    # the rewards the run logged are the healthy server's (characters / 10): step 1 came in two shards
    # (its own, then the frozen server's after the failover), step 2 in one (the frozen server is skipped)
    assert [len(c["query"]) for c in healthy.calls] == [0, 4, 4, 8]  # 0: the start-up probe
    for rec, queries in zip(recs, (scored[:8], scored[8:])):
        assert rec["rollout/reward_mean"] == pytest.approx(sum(len(q) / 10 for q in queries) / 8, rel=1e-5)
