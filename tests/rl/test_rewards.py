"""Reward sources: reward_func files (sync/async), built-in verifiers, and every failure is loud."""

import asyncio

import pytest

from rlhforge.rewards.base import RewardBatch, RewardError, call_source
from rlhforge.rewards.sources import BuiltinReward, FunctionReward


def _batch(responses, labels, sources=None):
    prompts = [f"Q{i}" for i in range(len(responses))]
    return RewardBatch(queries=[p + r for p, r in zip(prompts, responses)], prompts=prompts, responses=responses,
                       labels=labels, datasources=sources or ["arithmetic"] * len(responses))


def test_builtin_rewards_and_routing():
    out = asyncio.run(call_source(BuiltinReward("arithmetic"), _batch(["19", "18 or 19", " 7<|im_end|>"], ["19", "19", "7"])))
    assert out.rewards == [1.0, 0.0, 1.0] and out.scores == out.rewards
    auto = asyncio.run(call_source(BuiltinReward(None), _batch(["cba", "3"], ["cba", "3"], ["reverse", "arithmetic"])))
    assert auto.rewards == [1.0, 1.0]
    with pytest.raises(RewardError, match="unknown built-in reward"):
        BuiltinReward("nope")


def test_reward_func_file_sync_and_async(tmp_path):
    sync = tmp_path / "r.py"
    sync.write_text("def reward_func(queries, prompts, labels):\n"
                    "    return {'rewards': [len(q) for q in queries], 'scores': [0.5] * len(queries),"
                    " 'extra_logs': {'n': [1.0] * len(queries)}}\n")
    out = asyncio.run(call_source(FunctionReward.from_file(str(sync)), _batch(["a", "bb"], [None, None])))
    assert out.rewards == [3.0, 4.0] and out.scores == [0.5, 0.5] and out.extra_logs == {"n": [1.0, 1.0]}
    asy = tmp_path / "a.py"
    asy.write_text("async def reward_func(queries, prompts, labels, **kw):\n"
                   "    return {'rewards': [float(r == l) for r, l in zip(kw['responses'], labels)]}\n")
    out = asyncio.run(call_source(FunctionReward.from_file(str(asy)), _batch(["x", "y"], ["x", "z"])))
    assert out.rewards == [1.0, 0.0] and out.scores == [1.0, 0.0]


@pytest.mark.parametrize("body, message", [
    ("raise ValueError('boom')", r"reward_func in .*bad.py raised ValueError: boom \(batch of 2 samples; "
                                 r"first: sample 0 \(prompt\+response 'Q0a', label 1\)\)"),
    ("return {'rewards': [1.0]}", r"reward_func in .*bad.py returned 1 rewards for 2 samples"),
    ("return {'rewards': [1.0, float('nan')]}", r"rewards\[1\] = nan for sample 1 \(prompt\+response 'Q1b', label 2\)"),
    ("return {'rewards': [1.0, 2.0], 'scores': [0.5, float('inf')]}", r"scores\[1\] = inf for sample 1"),
    ("return None", r"returned None"),
    ("return {'rewards': ['a', 1]}", r"rewards\[0\] = 'a' \(not a number\) for sample 0 \(prompt\+response 'Q0a'"),
])
def test_reward_func_failures_name_the_function_and_sample(tmp_path, body, message):
    path = tmp_path / "bad.py"
    path.write_text(f"def reward_func(queries, prompts, labels):\n    {body}\n")
    with pytest.raises(RewardError, match=message):
        asyncio.run(call_source(FunctionReward.from_file(str(path)), _batch(["a", "b"], [1, 2])))


def test_missing_reward_func(tmp_path):
    path = tmp_path / "none.py"
    path.write_text("x = 1\n")
    with pytest.raises(RewardError, match="defines no function reward_func"):
        FunctionReward.from_file(str(path))


def test_non_finite_extra_logs_are_kept_and_malformed_ones_warned(tmp_path, capsys):
    """NaN/inf in extra_logs reach the metrics (the logger writes them as "nan" and warns); a malformed
    one (wrong length) is dropped with one warning naming it; rewards stay untouched."""
    import math

    path = tmp_path / "r.py"
    path.write_text("def reward_func(queries, prompts, labels):\n"
                    "    return {'rewards': [1.0, 0.0], 'extra_logs': {'flaky': [float('nan'), 2.5],"
                    " 'spiky': [float('inf'), 1.0], 'short': [1.0]}}\n")
    out = asyncio.run(call_source(FunctionReward.from_file(str(path)), _batch(["a", "b"], [1, 2])))
    assert out.rewards == [1.0, 0.0]
    assert math.isnan(out.extra_logs["flaky"][0]) and out.extra_logs["flaky"][1] == 2.5
    assert out.extra_logs["spiky"] == [math.inf, 1.0]
    assert "short" not in out.extra_logs
    assert "extra_logs['short']" in capsys.readouterr().out


def test_agent_metric_dicts_keep_non_finite_values(capsys):
    import math

    from rlhforge.agents.values import _float_logs

    logs = _float_logs({"nan_metric": float("nan"), "ok": 3, "text_metric": "x"}, "extra_logs")
    assert math.isnan(logs["nan_metric"]) and logs["ok"] == 3.0 and "text_metric" not in logs
    assert "text_metric" in capsys.readouterr().out
