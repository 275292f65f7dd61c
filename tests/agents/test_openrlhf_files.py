"""Files written for OpenRLHF (``from openrlhf.utils.agent import ...``, tensors, a custom
``execute()``) load through the real loader and run unchanged, with no ``openrlhf`` installed;
an installed ``openrlhf`` is never shadowed."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

from rlhforge.agents import AgentSettings, MultiTurnAgentExecutor
from rlhforge.agents.loader import load_agent_executor
from rlhforge.agents.openrlhf.multi_turn import AgentExecutorBase, AgentInstanceBase
from rlhforge.agents.single_turn import PromptRequest
from rlhforge.cli.train_ppo_ray import main as rl_main
from rlhforge.config.parsing import ConfigError
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

FILES = Path(__file__).parent / "openrlhf_files"


@pytest.fixture(autouse=True)
def _no_openrlhf():
    """These tests are about running without OpenRLHF; each leaves no ``openrlhf`` module behind."""
    if importlib.util.find_spec("openrlhf") is not None:
        pytest.skip("a real openrlhf is installed here")
    yield
    assert not [m for m in sys.modules if m == "openrlhf" or m.startswith("openrlhf.")]
    assert importlib.util.find_spec("openrlhf") is None


@pytest.fixture(scope="module")
def engine_tok(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return HFEngine.from_pretrained(str(tiny_model_dir), tok), tok


def _run(executor, engine_tok, labels, *, max_new=24, reward_source=None, stop=()):
    engine, tok = engine_tok
    executor.configure(tokenizer=tok, reward_source=reward_source,
                       settings=AgentSettings(step_timeout=5.0, fail_fast=True))
    text = tok.apply_chat_template([{"role": "user", "content": "Say something."}], add_generation_prompt=True,
                                   tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    reqs = [PromptRequest(ids, lab, None, i, 0) for i, lab in enumerate(labels)]
    params = [SamplingParams(max_new_tokens=max_new, seed=40 + k, stop_token_ids=tuple(stop)) for k in range(len(reqs))]
    return asyncio.run(executor.execute_batch(reqs, params, engine)), ids


def test_multi_turn_file_loads_with_openrlhf_imports_and_runs(engine_tok, monkeypatch):
    rec = Recorder(monkeypatch)
    ex = load_agent_executor(str(FILES / "agent_func.py"))
    assert type(ex).__name__ == "AgentExecutor" and isinstance(ex, MultiTurnAgentExecutor)
    assert issubclass(ex.agent_instance_cls, AgentInstanceBase)  # rlhforge's class behind openrlhf's name
    tok = engine_tok[1]
    stop = range(4, len(tok), 3)  # a third of the vocabulary ends an action: several short turns
    (t1, t3), prompt = _run(ex, engine_tok, ["1", "3"], max_new=40, stop=stop)
    for t, turns in ((t1, 1), (t3, 3)):
        assert t.drop_reason is None, t.error
        check_trajectory(t, rec)
        assert t.prompt_ids == prompt and len(t.action_ranges) == turns
        # the first action used the run's budget, later ones the 5 tokens set on states["sampling_params"]
        assert all(e - s <= 5 for s, e in t.action_ranges[1:])
        for k, ((_, e), (s2, _)) in enumerate(zip(t.action_ranges, t.action_ranges[1:])):
            assert t.token_ids[e:s2] == tok.encode(f"\nhint {k + 1}:\n", add_special_tokens=False)
        actions = [tok.decode(t.token_ids[s:e], skip_special_tokens=True) for s, e in t.action_ranges]
        assert t.reward == sum(1.0 for a in actions if len(a) % 2 == 0)  # tensor rewards summed
        assert t.score == 0.25 and t.extra["echo_turn"] == float(turns)


def test_custom_execute_in_openrlhfs_signature(engine_tok, monkeypatch):
    rec = Recorder(monkeypatch)
    ex = load_agent_executor(str(FILES / "custom_executor.py"))
    assert isinstance(ex, AgentExecutorBase) and type(ex).__name__ == "AgentExecutor"
    (t_yes, t_no), prompt = _run(ex, engine_tok, ["yes", "no"])
    tok = engine_tok[1]
    reply = tok.encode("\nok, once more:\n", add_special_tokens=False)
    for t in (t_yes, t_no):
        assert t.drop_reason is None, t.error
        assert check_trajectory(t, rec) == len(reply)  # actions and log-probs are the engine's, exactly
        assert t.prompt_ids == prompt and len(t.action_ranges) == 2
        (s1, e1), (s2, e2) = t.action_ranges
        assert s1 == len(prompt) and t.token_ids[e1:s2] == reply and e1 - s1 <= 6 and e2 - s2 <= 6
        chars = sum(len(tok.decode(t.token_ids[s:e], skip_special_tokens=True)) for s, e in t.action_ranges)
        assert t.reward == pytest.approx(chars / 10.0) and t.extra["text_chars"] == chars
        last = [c for c in rec.calls if c[0] == tuple(t.token_ids[:s2])]
        assert t.truncated == (len(last[-1][1]) == 6 and tok.eos_token_id not in last[-1][1])
    assert (t_yes.score, t_no.score) == (1.0, 0.0)
    # the second turn of a sample is seeded from the sample's seed: the same run gives the same tokens
    (again, _), _ = _run(load_agent_executor(str(FILES / "custom_executor.py")), engine_tok, ["yes", "no"])
    assert again.token_ids == t_yes.token_ids


def test_overridden_execute_calling_super(engine_tok):
    ex = load_agent_executor(str(FILES / "wrapped_multi_turn.py"))
    (t,), prompt = _run(ex, engine_tok, ["x"])
    assert t.drop_reason is None, t.error
    assert t.reward == 2.0 and t.score == 0.5 and t.extra["wrapped"] == 1.0  # 0.5 * 4; scores untouched
    assert t.prompt_ids == prompt and len(t.action_ranges) == 1 and len(t.rollout_logprobs) == t.response_length


def test_reward_none_needs_a_reward_source(engine_tok, tmp_path):
    path = tmp_path / "no_reward.py"
    path.write_text((FILES / "custom_executor.py").read_text().replace('"reward": reward,', '"reward": None,'))
    from rlhforge.agents.episode import AgentError

    with pytest.raises(AgentError, match="reward None"):
        _run(load_agent_executor(str(path)), engine_tok, ["yes"])

    class Constant:
        name = "constant"

        async def __call__(self, batch):
            return {"rewards": [0.75] * len(batch)}

    (t,), _ = _run(load_agent_executor(str(path)), engine_tok, ["yes"], reward_source=Constant())
    assert t.reward == 0.75 and t.extra["env_reward"] == 0.0


def test_broken_executor_results_name_the_problem(engine_tok, tmp_path):
    from rlhforge.agents.episode import AgentError

    body = FILES.joinpath("custom_executor.py").read_text()
    cases = {
        '"action_ranges": action_ranges,': ('"action_ranges": [(0, 10**6)],', "outside observation_tokens"),
        '"rollout_log_probs": log_probs,': ('"rollout_log_probs": None, "observation_tokens": tokens + [5, 6],'
                                            '"action_ranges": action_ranges + [(len(tokens), len(tokens) + 2)],',
                                            "not generated by llm_engine"),
    }
    for old, (new, message) in cases.items():
        path = tmp_path / f"bad{len(message)}.py"
        path.write_text(body.replace(old, new))
        with pytest.raises(AgentError, match=message):
            _run(load_agent_executor(str(path)), engine_tok, ["yes"])
    empty = tmp_path / "empty.py"
    empty.write_text("from openrlhf.utils.agent import AgentExecutorBase\n\nclass AgentExecutor(AgentExecutorBase):\n"
                     "    pass\n")
    with pytest.raises(ConfigError, match="implements neither"):
        load_agent_executor(str(empty))
    missing = tmp_path / "missing.py"
    missing.write_text("from openrlhf.utils.agent import SingleTurnAgentExecutor\n")
    with pytest.raises(ConfigError, match="SingleTurnAgentExecutor.*rlhforge provides only.*MultiTurnAgentExecutor"):
        load_agent_executor(str(missing))


def test_installed_openrlhf_is_not_shadowed(tmp_path, monkeypatch):
    """With a real ``openrlhf`` importable (a stand-in package here) its own classes are imported;
    a plain multi-turn file still runs (rlhforge drives its AgentInstance), a custom execute() is
    refused with the reason."""
    pkg = tmp_path / "site" / "openrlhf" / "utils"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("REAL = True\n")
    (pkg / "__init__.py").write_text("")
    (pkg / "agent.py").write_text(
        "class AgentExecutorBase:\n    async def execute(self, *a):\n        raise NotImplementedError\n\n"
        "class AgentInstanceBase:\n    async def reset(self, states, **kw):\n        return states\n\n"
        "class MultiTurnAgentExecutor(AgentExecutorBase):\n    def __init__(self, cls):\n        self.cls = cls\n\n"
        "    async def execute(self, *a):\n        raise NotImplementedError\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    try:
        assert importlib.util.find_spec("openrlhf") is not None
        ex = load_agent_executor(str(FILES / "agent_func.py"))
        assert sys.modules["openrlhf"].REAL  # the installed package, not the alias
        assert ex.agent_instance_cls.__mro__[1].__module__ == "openrlhf.utils.agent"
        assert isinstance(ex, MultiTurnAgentExecutor)
        with pytest.raises(ConfigError, match="installed OpenRLHF"):
            load_agent_executor(str(FILES / "custom_executor.py"))
    finally:
        for name in [m for m in sys.modules if m == "openrlhf" or m.startswith("openrlhf.")]:
            del sys.modules[name]
        monkeypatch.undo()


def test_cli_runs_an_openrlhf_executor_file(tiny_model_dir, tmp_path, monkeypatch):
    """Through the real CLI: the custom execute() file trains; its trajectories are the engine's."""
    rec = Recorder(monkeypatch)
    seen = capture_trajectories(monkeypatch)
    data = write_prompts(tmp_path / "p.jsonl", [{"prompt": f"Tell {i}.", "label": lab}
                                                 for i, lab in enumerate(["yes", "no"])])
    out = tmp_path / "run"
    assert rl_main(agent_args(tiny_model_dir, out, data, FILES / "custom_executor.py", steps=1)) == 0
    (rec_metrics,) = [r for r in metrics(out) if "rollout/reward_mean" in r]
    assert "rollout/text_chars" in rec_metrics and rec_metrics.get("rollout/agent_dropped_groups", 0) == 0
    assert len(seen) == 4
    for t in seen:
        assert len(t.action_ranges) == 2
        check_trajectory(t, rec)
    assert rec_metrics["rollout/reward_mean"] == pytest.approx(sum(t.reward for t in seen) / 4)
    assert rec_metrics["rollout/text_chars"] == pytest.approx(sum(t.extra["text_chars"] for t in seen) / 4)
