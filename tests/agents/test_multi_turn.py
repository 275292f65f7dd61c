"""Multi-turn environments (OpenRLHF's agent API): token-exact trajectories, rewards, truncation,
failures, concurrency, and an end-to-end run through the CLI."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from safetensors.torch import load_file

from rlhforge.agents import AgentError, AgentInstanceBase, AgentSettings, MultiTurnAgentExecutor
from rlhforge.agents.episode import drop_failed_groups
from rlhforge.agents.loader import load_agent_executor
from rlhforge.agents.single_turn import PromptRequest
from rlhforge.cli.train_ppo_ray import main as rl_main
from rlhforge.rollout.engine import SamplingParams
from rlhforge.rollout.hf_engine import HFEngine
from tests.agents.agent_helpers import (
    Recorder,
    agent_args,
    capture_trajectories,
    check_trajectory,
    metrics,
    write_prompts,
)

# An environment file as OpenRLHF users write it; only the import line names rlhforge.
ENV_FILE = '''
import torch
from rlhforge.agents import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    async def __init__(self, *args, **kwargs):
        self.turn = 0

    async def reset(self, states, **kwargs):
        self.stop_after = int(states["label"])
        return {"observation": states["observation"], "sampling_params": {"max_tokens": 4}}

    async def step(self, states, **kwargs):
        if states["label"] == "0":
            raise ValueError("environment exploded")
        self.turn += 1
        done = self.turn >= self.stop_after
        return {
            "rewards": torch.tensor((len(states["action_text"]) % 3) / 2.0),
            "scores": torch.tensor(0.5),
            "environment_feedback": "" if done else f"\\n[obs {self.turn}]\\n",
            "done": done,
            "sampling_params": states["sampling_params"],
            "extra_logs": {"env_turn": torch.tensor(float(self.turn))},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


@pytest.fixture(scope="module")
def engine_tok(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return HFEngine.from_pretrained(str(tiny_model_dir), tok), tok


def _requests(tok, labels, n=1):
    text = tok.apply_chat_template([{"role": "user", "content": "Guess a number."}], add_generation_prompt=True,
                                   tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    reqs = [PromptRequest(ids, lab, None, i, j) for i, lab in enumerate(labels) for j in range(n)]
    params = [SamplingParams(max_new_tokens=24, seed=100 + k) for k in range(len(reqs))]
    return reqs, params


def _run(executor, engine_tok, labels, n=1, **settings):
    engine, tok = engine_tok
    executor.configure(tokenizer=tok, settings=AgentSettings(**{"step_timeout": 5.0, **settings}))
    reqs, params = _requests(tok, labels, n)
    return asyncio.run(executor.execute_batch(reqs, params, engine))


def test_cli_end_to_end_token_exact(tiny_model_dir, tmp_path, monkeypatch):
    """Through the CLI: several turns, feedback masked, actions = the engine's tokens and log-probs,
    a failing environment's group dropped and counted, parameters trained."""
    rec = Recorder(monkeypatch)
    seen = capture_trajectories(monkeypatch)
    env = tmp_path / "env.py"
    env.write_text(ENV_FILE)
    data = write_prompts(tmp_path / "p.jsonl", [{"prompt": f"Guess {i}.", "label": lab}
                                                 for i, lab in enumerate(["1", "2", "9", "0"])])
    out = tmp_path / "run"
    assert rl_main(agent_args(tiny_model_dir, out, data, env, "--reward.stop_properly_penalty_coef", "0.5")) == 0
    recs = [r for r in metrics(out) if "rollout/reward_mean" in r]
    assert [r["step"] for r in recs] == [1, 2]
    assert sum(r.get("rollout/agent_dropped_groups", 0) for r in recs) == 1  # the label "0" prompt
    assert sum(r.get("rollout/agent_failed_samples", 0) for r in recs) == 2
    assert recs[0]["rollout/logprob_diff_rollout_vs_train"] < 1e-4  # same weights: log-probs line up
    assert all("rollout/env_turn" in r and "rollout/agent_turns" in r for r in recs)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(seen) == 6
    by_label = {}
    for t in seen:
        env_tokens = check_trajectory(t, rec)
        by_label.setdefault(t.label, []).append((t, env_tokens))
        turns = len(t.action_ranges)
        # feedback between actions is exactly the environment's text, tokenised once
        for k, ((_, e), (s2, _)) in enumerate(zip(t.action_ranges, t.action_ranges[1:])):
            assert t.token_ids[e:s2] == tok.encode(f"\n[obs {k + 1}]\n", add_special_tokens=False)
        assert t.score == 0.5
        assert all(e - s <= 4 for s, e in t.action_ranges)  # sampling_params from reset applied
        if t.label == "1":
            assert turns == 1 and not t.truncated and env_tokens == 0
        if t.label == "2":
            assert turns == 2 and not t.truncated and env_tokens > 0
        if t.label == "9":  # never done: ends when the 24-token budget is spent
            assert t.truncated and len(t.token_ids) - t.prompt_len == 24 and turns >= 2
    assert "0" not in by_label
    before, after = load_file(tiny_model_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_openrlhf_file_loads_and_rewards_sum(engine_tok, tmp_path):
    env = tmp_path / "env.py"
    env.write_text(ENV_FILE)
    ex = load_agent_executor(str(env))
    assert isinstance(ex, MultiTurnAgentExecutor)
    trajs = _run(ex, engine_tok, ["2"])
    (t,) = trajs
    assert len(t.action_ranges) == 2 and t.extra["agent_turns"] == 2.0 and t.extra["env_turn"] == 2.0
    assert not t.truncated
    actions = [engine_tok[1].decode(t.token_ids[s:e], skip_special_tokens=True) for s, e in t.action_ranges]
    assert t.reward == pytest.approx(sum((len(a) % 3) / 2.0 for a in actions))


class _Scripted(AgentInstanceBase):
    """Rewards 1 per step, episode_reward override at the end, optional failure modes by label."""

    active = 0
    peak = 0

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"], "sampling_params": {"max_tokens": 4}}

    async def step(self, states, **kwargs):
        label = states["label"]
        if label == "hang":
            await asyncio.sleep(30)
        if label == "bad":
            return {"rewards": float("nan"), "done": True}
        if label == "sync-error":
            raise KeyError("missing")
        cls = type(self)
        cls.active += 1
        cls.peak = max(cls.peak, cls.active)
        await asyncio.sleep(0.05)
        cls.active -= 1
        out = {"rewards": 1.0, "environment_feedback": " more", "done": label == "override"}
        if label == "override":
            out["episode_reward"] = -2.0
        return out


def test_rewards_truncation_and_override(engine_tok):
    ex = MultiTurnAgentExecutor(_Scripted)
    t_budget, t_override = _run(ex, engine_tok, ["budget", "override"])
    assert t_budget.truncated and t_budget.finish_reason == "length"
    assert len(t_budget.token_ids) - t_budget.prompt_len == 24
    assert t_budget.reward == float(len(t_budget.action_ranges)) and t_budget.score == t_budget.reward
    assert t_override.reward == -2.0 and not t_override.truncated and len(t_override.action_ranges) == 1


def test_failures_are_dropped_with_the_sample_id(engine_tok, capsys):
    ex = MultiTurnAgentExecutor(_Scripted)
    t0 = time.perf_counter()
    trajs = _run(ex, engine_tok, ["ok", "hang", "bad", "sync-error"], n=2, step_timeout=0.5)
    assert time.perf_counter() - t0 < 10
    reasons = [t.drop_reason for t in trajs]
    assert reasons[:2] == [None, None] and all(r == "env_error" for r in reasons[2:])
    assert "prompt 1 sample 0" in trajs[2].error and "did not return within 0.5 s" in trajs[2].error
    assert "not finite" in trajs[4].error and "KeyError" in trajs[6].error
    kept, counts = drop_failed_groups(trajs, 2)
    assert kept == trajs[:2]
    assert counts == {"agent_dropped_groups": 3.0, "agent_failed_samples": 6.0, "env_error_groups": 3.0}
    assert "prompt 3 sample 1" in capsys.readouterr().out
    with pytest.raises(AgentError, match=r"prompt 1 sample \d.*did not return"):
        _run(ex, engine_tok, ["ok", "hang"], step_timeout=0.5, fail_fast=True)


def test_env_concurrency_limit_and_batched_generation(engine_tok):
    _Scripted.active = _Scripted.peak = 0
    ex = MultiTurnAgentExecutor(_Scripted)
    trajs = _run(ex, engine_tok, ["a"] * 6, env_concurrency=2)
    assert all(t.drop_reason is None for t in trajs)
    assert _Scripted.peak == 2
    assert max(ex.last_batch_sizes) > 1  # concurrent episodes share engine calls


def test_fail_fast_through_the_cli(tiny_model_dir, tmp_path, capsys):
    env = tmp_path / "env.py"
    env.write_text(ENV_FILE)
    data = write_prompts(tmp_path / "p.jsonl", [{"prompt": "Guess.", "label": "0"}] * 2)
    with pytest.raises(SystemExit) as exc:
        rl_main(agent_args(tiny_model_dir, tmp_path / "run", data, env, "--train.agent_fail_fast", steps=1))
    assert exc.value.code == 3
    err = capsys.readouterr().err
    assert "agent failed" in err and "sample" in err and "environment exploded" in err
