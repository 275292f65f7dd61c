"""Task/env registry: routing by label, reward + filter functions, the built-in math and math_tir."""

from __future__ import annotations

import asyncio
import json

import pytest

from rlhforge.agents import AgentSettings, RegistryExecutor, register_env, register_task
from rlhforge.agents import registry
from rlhforge.agents.episode import drop_failed_groups
from rlhforge.agents.single_turn import PromptRequest
from rlhforge.cli.train_ppo_ray import main as rl_main
from rlhforge.rollout.engine import GenerationOutput, SamplingParams
from tests.agents.agent_helpers import agent_args, capture_trajectories, metrics, write_prompts


class ScriptedEngine:
    """Test double for unit tests only: answers each request with the next scripted text."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.calls = tok, list(texts), []

    async def generate(self, prompts, params):
        outs = []
        for p, sp in zip(prompts, params):
            ids = self.tok.encode(self.texts.pop(0), add_special_tokens=False) + [self.tok.eos_token_id]
            ids = ids[: sp.max_new_tokens]
            self.calls.append((list(p), ids))
            outs.append(GenerationOutput(ids, [-0.5] * len(ids), "stop" if ids[-1] == self.tok.eos_token_id else "length"))
        return outs


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _reqs(tok, labels, n=1, datasource=None):
    text = tok.apply_chat_template([{"role": "user", "content": "Compute 6 * 7."}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    reqs = [PromptRequest(ids, lab, datasource, i, j) for i, lab in enumerate(labels) for j in range(n)]
    return reqs, [SamplingParams(max_new_tokens=200, seed=j) for j in range(len(reqs))]


def _run(tok, engine, labels, n=1, datasource=None, **settings):
    ex = RegistryExecutor().configure(tokenizer=tok, settings=AgentSettings(**{"step_timeout": 30.0, **settings}))
    reqs, params = _reqs(tok, labels, n, datasource)
    return asyncio.run(ex.execute_batch(reqs, params, engine))


def test_math_tir_runs_python_and_scores_with_math_verify(tok):
    engine = ScriptedEngine(tok, ["Let me compute.\n```python\nprint(6 * 7)\n```", "So the answer is \\boxed{42}."])
    (t,) = _run(tok, engine, [json.dumps({"env_func": "math_tir", "task": "math_tir", "answer": "42"})])
    assert t.drop_reason is None, t.error
    assert t.reward == 1.0 and t.score == 1.0 and t.extra["tir_tool_calls"] == 1.0 and not t.truncated
    (s1, e1), (s2, e2) = t.action_ranges
    assert [ids for _, ids in engine.calls] == [t.token_ids[s1:e1], t.token_ids[s2:e2]]
    assert engine.calls[1][0] == t.token_ids[:s2]  # the second turn saw the tool output
    feedback = tok.decode(t.token_ids[e1:s2])
    assert "```output\n42" in feedback and feedback.startswith("\n<|im_start|>user\n")
    assert feedback.endswith("<|im_start|>assistant\n") and t.rollout_logprobs == [-0.5] * (e1 - s1 + e2 - s2)


def test_math_single_turn_by_datasource_and_a_wrong_answer(tok):
    engine = ScriptedEngine(tok, ["It is \\boxed{41}", "It is \\frac{84}{2}"])
    trajs = _run(tok, engine, ["42", "42"], datasource="math")
    assert [t.reward for t in trajs] == [0.0, 1.0] and all(len(t.action_ranges) == 1 for t in trajs)


def test_user_task_filters_and_reward_failure(tok):
    calls = []

    def reward(response, label, **kw):
        calls.append(kw["trajectory"].prompt_index)
        if label["mode"] == "boom":
            raise RuntimeError("verifier down")
        return {"reward": 2.0, "score": 1.0, "extra_logs": {"my_len": float(len(response))}}

    register_task("t_filters", reward,
                  sample_filter=lambda traj, label: label["mode"] != "mask",
                  experience_filter=lambda group: group[0].label is None or json.loads(group[0].label)["mode"] != "drop",
                  reward_fail=lambda traj, label, err: -1.0 if "down" in str(err) else None)

    @register_env("echo_twice")
    async def echo_twice(ep, label, ctx):
        a = await ep.generate()
        ep.add_feedback(" [again]")
        await ep.generate()
        return {"extra_logs": {"first_len": float(len(a.token_ids))}}

    try:
        labels = [json.dumps({"task": "t_filters", "env_func": "echo_twice", "mode": m})
                  for m in ("keep", "mask", "drop", "boom")]
        engine = ScriptedEngine(tok, ["a b"] * 16)
        trajs = _run(tok, engine, labels, n=2)
        keep, mask, drop, boom = trajs[0:2], trajs[2:4], trajs[4:6], trajs[6:8]
        assert all(t.reward == 2.0 and len(t.action_ranges) == 2 and t.extra["first_len"] > 0 for t in keep)
        assert all(t.action_ranges == [] and t.rollout_logprobs == [] and t.extra["sample_filtered"] == 1.0
                   and t.reward == 2.0 for t in mask)
        assert all(t.drop_reason == "exp_filter" for t in drop)
        assert all(t.reward == -1.0 and t.extra["reward_failed"] == 1.0 for t in boom)
        kept, counts = drop_failed_groups(trajs, 2)
        assert len(kept) == 6 and counts == {"agent_dropped_groups": 1.0, "agent_failed_samples": 0.0,
                                              "exp_filter_groups": 1.0}
        unknown = _run(tok, ScriptedEngine(tok, ["x"]), [json.dumps({"task": "nope"})])[0]
        assert unknown.drop_reason == "env_error" and "unknown task 'nope'" in unknown.error and "math_tir" in unknown.error
    finally:
        registry.TASKS.pop("t_filters", None)
        registry.ENVS.pop("echo_twice", None)


def test_registry_through_the_cli(tiny_model_dir, tmp_path, monkeypatch):
    """Built-in math_tir on the tiny model, routed by each record's label and task field."""
    seen = capture_trajectories(monkeypatch)
    rows = [{"prompt": f"What is {a} + {a}?", "task": "math_tir" if a % 2 else "math",
             "label": json.dumps({"env_func": "math_tir", "answer": str(2 * a)}) if a % 2 else str(2 * a)}
            for a in range(1, 5)]
    data = write_prompts(tmp_path / "p.jsonl", rows)
    out = tmp_path / "run"
    assert rl_main(agent_args(tiny_model_dir, out, data, "registry", "--data.datasource_key", "task", max_new=16)) == 0
    recs = [r for r in metrics(out) if "rollout/reward_mean" in r]
    assert [r["step"] for r in recs] == [1, 2] and "rollout/math_answer_found" in recs[0]
    assert len(seen) == 8 and all(len(t.rollout_logprobs) == t.response_length > 0 for t in seen)
    assert {t.datasource for t in seen} == {"math", "math_tir"}
