"""OpenAI-compatible server executor: the real ``openai`` client over localhost drives the policy;
the session is stitched into one token-exact trajectory."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from rlhforge.agents import AgentSettings, OpenAIServerAgentExecutor
from rlhforge.agents.serving.chat import ChatServer
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

AGENT_FILE = '''
async def run_agent(prompt, label, client):
    messages = [{"role": "user", "content": prompt}]
    r1 = await client.chat.completions.create(model="policy", messages=messages, max_tokens=5, logprobs=True)
    messages += [{"role": "assistant", "content": r1.choices[0].message.content},
                 {"role": "user", "content": "Tool says: " + str(label)}]
    r2 = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
    text = r1.choices[0].message.content + r2.choices[0].message.content
    return {"reward": (len(text) % 3) / 2.0, "scores": 1.0, "extra_logs": {"agent_chars": float(len(text))}}
'''


@pytest.fixture(scope="module")
def engine_tok(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return HFEngine.from_pretrained(str(tiny_model_dir), tok), tok


def _run(ex, engine_tok, prompts, budget=40, **settings):
    engine, tok = engine_tok
    ex.configure(tokenizer=tok, settings=AgentSettings(**{"step_timeout": 20.0, "episode_timeout": 60.0, **settings}))
    reqs = [PromptRequest([1], "7", None, i, 0, raw_prompt=p) for i, p in enumerate(prompts)]
    params = [SamplingParams(max_new_tokens=budget, seed=11 + i) for i in range(len(reqs))]
    return asyncio.run(ex.execute_batch(reqs, params, engine))


def test_real_openai_client_two_turns_token_exact(engine_tok, monkeypatch):
    rec = Recorder(monkeypatch)
    _, tok = engine_tok
    seen = {}

    async def run_agent(prompt, label, client):
        models = await client.models.list()
        seen["models"] = [m.id for m in models.data]
        messages = [{"role": "user", "content": prompt}]
        r1 = await client.chat.completions.create(model="policy", messages=messages, max_tokens=5, logprobs=True,
                                                  temperature=1.0)
        seen["r1"] = r1
        messages += [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "tool", "content": f"result {label}"}]
        r2 = await client.chat.completions.create(model="policy", messages=messages, max_tokens=200)
        seen["r2"] = r2
        return 0.25

    ex = OpenAIServerAgentExecutor(run_agent)
    try:
        (t,) = _run(ex, engine_tok, ["What is 3 + 4?"])
        health = httpx.get(f"{ex.server.url}/health").json()
        models = httpx.get(f"{ex.server.url}/v1/models").json()
    finally:
        ex.close()
    assert health == {"status": "ok"} and models["data"][0]["id"] == "policy" and seen["models"] == ["policy"]
    assert t.drop_reason is None, t.error
    assert t.reward == 0.25 and t.score == 0.25 and len(t.action_ranges) == 2
    r1, r2 = seen["r1"], seen["r2"]
    ids1 = r1.model_extra["token_ids"]
    # the first prompt is the chat template's rendering, tokenised once
    rendered = tok.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}], tokenize=False,
                                       add_generation_prompt=True)
    assert t.prompt_ids == ids1["prompt_token_ids"] == tok.encode(rendered, add_special_tokens=False)
    (s1, e1), (s2, e2) = t.action_ranges
    assert t.token_ids[s1:e1] == ids1["completion_token_ids"] and e1 - s1 == 5
    assert r1.choices[0].finish_reason == "length" and len(r1.choices[0].logprobs.content) == 5
    assert [c.logprob for c in r1.choices[0].logprobs.content] == pytest.approx(t.rollout_logprobs[:5])
    # the second call's prompt extends the first exactly; only the new text was tokenised (mask 0)
    ids2 = r2.model_extra["token_ids"]
    assert ids2["prompt_token_ids"][:e1] == t.token_ids[:e1] and ids2["prompt_token_ids"] == t.token_ids[:s2]
    assert t.token_ids[s2:e2] == ids2["completion_token_ids"]
    assert e2 - s2 <= 40 - (s2 - t.prompt_len)  # the session budget caps max_tokens
    assert check_trajectory(t, rec) == s2 - e1 > 0
    assert "result 7" in tok.decode(t.token_ids[e1:s2])


def test_sync_agent_tools_refusal_and_budget(engine_tok):
    def run_agent(prompt, label, client):  # a plain function gets the sync client
        assert isinstance(client, openai.OpenAI)
        with pytest.raises(openai.BadRequestError, match="does not render 'tools'"):
            client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}],
                                           tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
        msgs = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
        r = client.chat.completions.create(model="p", messages=msgs)
        assert r.choices[0].finish_reason == "length"  # the 12-token session budget
        msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "more"}]
        r2 = client.chat.completions.create(model="p", messages=msgs)
        assert r2.choices[0].message.content == "" and r2.choices[0].finish_reason == "length"
        return {"reward": 1.0}

    ex = OpenAIServerAgentExecutor(run_agent)
    try:
        (t,) = _run(ex, engine_tok, ["Hi"], budget=12)
    finally:
        ex.close()
    assert t.drop_reason is None, t.error
    assert t.truncated and len(t.action_ranges) == 1 and t.action_ranges[0][1] - t.action_ranges[0][0] == 12


def _editing_agent(prompt, label, client):
    r = client.chat.completions.create(model="p", messages=[{"role": "user", "content": prompt}], max_tokens=3)
    # the agent rewrites history: the new prompt does not extend the recorded conversation
    client.chat.completions.create(model="p", messages=[{"role": "user", "content": "Something else"}], max_tokens=3)
    return 1.0


def test_prefix_mismatch_is_an_error_or_a_new_segment(engine_tok):
    ex = OpenAIServerAgentExecutor(_editing_agent)
    try:
        (t,) = _run(ex, engine_tok, ["Hello"])
        assert t.drop_reason == "env_error" and "differ at character" in t.error and "prompt 0 sample 0" in t.error
        ex2 = OpenAIServerAgentExecutor(_editing_agent)
        (t2,) = _run(ex2, engine_tok, ["Hello"], prefix_mismatch="new_segment")
    finally:
        ex.close()
        ex2.close()
    assert t2.drop_reason is None and t2.extra["agent_segments_discarded"] == 1.0
    _, tok = engine_tok
    assert "Something else" in tok.decode(t2.prompt_ids) and len(t2.action_ranges) == 1


def test_stop_strings_cut_at_a_token_boundary(engine_tok):
    _, tok = engine_tok
    server = ChatServer(tok)
    ids = tok.encode("the answer is 42. Observation: done", add_special_tokens=False)
    kept, lps, finish = server._apply_stop(ids, [0.0] * len(ids), "length", ["Observation:"])
    assert finish == "stop" and ids[: len(kept)] == kept and len(lps) == len(kept)
    text = tok.decode(kept)
    assert "Observation" not in text and "the answer is 42." .startswith(text.rstrip()[:5])


def test_openai_agent_through_the_cli(tiny_model_dir, tmp_path, monkeypatch):
    rec = Recorder(monkeypatch)
    seen = capture_trajectories(monkeypatch)
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT_FILE)
    data = write_prompts(tmp_path / "p.jsonl", [{"prompt": f"Say {i}.", "label": str(i)} for i in range(4)])
    out = tmp_path / "run"
    assert rl_main(agent_args(tiny_model_dir, out, data, agent, max_new=32)) == 0
    recs = [r for r in metrics(out) if "rollout/reward_mean" in r]
    assert [r["step"] for r in recs] == [1, 2] and "rollout/agent_chars" in recs[0]
    assert recs[0]["rollout/logprob_diff_rollout_vs_train"] < 1e-4
    assert len(seen) == 8
    for t in seen:
        assert len(t.action_ranges) == 2 and check_trajectory(t, rec) > 0
