"""``rlhforge rl`` against a real ``serve-rm`` server that requires an API key, on 127.0.0.1: with
``--reward.api_key`` (or ``RLHFORGE_REWARD_API_KEY``) the run gets rewards; without it, or with a
wrong key, it stops at start-up (exit 2, before any model is loaded) with a message that says what
to pass. The key never appears in output, config.yaml or metrics."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from rlhforge.cli.train_ppo_ray import check_reward_servers, parse_rl_args
from rlhforge.cli.train_ppo_ray import main as rl_main
from rlhforge.config.parsing import ConfigError
from rlhforge.config.serve_rm import ServeRewardConfig, ServeRMConfig
from rlhforge.rewards import client
from rlhforge.rewards.client import RemoteRewardClient, post_json
from rlhforge.rewards.sources import RemoteReward
from rlhforge.rewards.base import RewardBatch
from rlhforge.rewards.server import RewardScorer, create_app, start_server_thread
from tests.flag_tables import refused_line
from tests.model_helpers import tiny_reward_model
from tests.rl.helpers import metrics, rl_args

KEY = "s3cret-Key-7f3a9"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def clean_key(monkeypatch):
    monkeypatch.delenv(client.API_KEY_ENV, raising=False)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    rm = tiny_reward_model(tiny_model_dir, tmp_path_factory.mktemp("keyed") / "rm", head_std=None)
    scorer = RewardScorer.from_config(ServeRMConfig(reward=ServeRewardConfig(str(rm)), batch_size=8))
    with start_server_thread(create_app(scorer, api_key=KEY)) as handle:
        yield handle


def _queries(server) -> int:
    return httpx.get(f"{server.base_url}/health").json()["queries"]


def test_rl_run_with_the_key_gets_rewards_and_never_shows_it(server, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    before = _queries(server)
    assert rl_main(rl_args(tiny_model_dir, out, "--reward.remote_url", server.url, "--reward.api_key", KEY,
                           steps=1)) == 0
    assert _queries(server) - before == 8  # 4 prompts x 2 samples scored by the server
    recs = [r for r in metrics(out) if "rollout/reward_mean" in r]
    assert len(recs) == 1 and recs[0]["rollout/reward_std"] > 0  # the reward model's scores, not zeros
    printed = capsys.readouterr()
    for text in (printed.out, printed.err, *(p.read_text() for p in out.rglob("*") if p.suffix in
                                               (".yaml", ".jsonl", ".json", ".md", ".txt"))):
        assert KEY not in text
    assert "api_key: null" in (out / "config.yaml").read_text()
    assert client.default_api_key() is None  # the key is this run's only


def test_without_a_key_the_run_stops_at_start_up(server, capsys):
    argv = ["--actor.model_name_or_path", "/nonexistent/model", "--data.prompt_dataset", "builtin:arithmetic",
            "--rollout.batch_size", "8", "--train.batch_size", "8", "--reward.remote_url", server.url]
    line = refused_line(rl_main, argv, capsys)
    assert server.url in line and "HTTP 401" in line and "no API key was sent" in line
    assert "--reward.api_key" in line and "RLHFORGE_REWARD_API_KEY" in line
    line = refused_line(rl_main, [*argv, "--reward.api_key", "wrong"], capsys)
    assert "the API key sent was refused" in line and "wrong" not in line


def test_the_environment_variable_is_used_when_the_flag_is_unset(server, monkeypatch, capsys):
    cfg = parse_rl_args(["--actor.model_name_or_path", "m", "--data.prompt_dataset", "builtin:arithmetic",
                         "--rollout.batch_size", "8", "--train.batch_size", "8", "--reward.remote_url", server.url])
    with pytest.raises(ConfigError, match="HTTP 401"):
        check_reward_servers(cfg)
    monkeypatch.setenv(client.API_KEY_ENV, KEY)
    check_reward_servers(cfg)  # the probe passes with the key from the environment
    # the RL reward path (RemoteReward -> post_json) sends it too
    assert asyncio.run(post_json(server.url, {"query": ["a b"]}, 30.0))["rewards"]
    assert KEY not in capsys.readouterr().out


def test_client_key_sources(server):
    with pytest.raises(client.RewardServerError, match="HTTP 401"):
        RemoteRewardClient(server.url, max_attempts=1).get_rewards_sync(["x"])
    assert len(RemoteRewardClient(server.url, api_key=KEY).get_rewards_sync(["x", "y"]).rewards) == 2
    assert client.auth_headers(KEY) == {"Authorization": f"Bearer {KEY}"}
    assert client.auth_headers("") == {}  # an explicit empty key sends none
    assert client.auth_headers() == {}  # no key in the environment
    # the RL trainer's reward source carries the run's key explicitly (nothing process-wide)
    batch = RewardBatch(queries=["a b", "c"], prompts=["a", "c"], responses=["b", ""], labels=[None, None],
                        datasources=[None, None])
    assert len(asyncio.run(RemoteReward([server.url], api_key=KEY)(batch))["rewards"]) == 2
    with pytest.raises(client.RewardServerError, match="HTTP 401"):
        asyncio.run(RemoteReward([server.url], timeout=5.0)(batch))
    assert KEY not in repr(parse_rl_args(["--actor.model_name_or_path", "m", "--data.prompt_dataset", "x",
                                          "--reward.remote_url", server.url, "--reward.api_key", KEY,
                                          "--rollout.batch_size", "8", "--train.batch_size", "8"]))
