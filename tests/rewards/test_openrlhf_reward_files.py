"""Reward files written for OpenRLHF run unchanged through ``--reward.remote_url file.py``:
tensors or lists, a dict or a bare return, ``from openrlhf.utils import ...`` with no openrlhf."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

from rlhforge.rewards.base import RewardBatch, RewardError, call_source
from rlhforge.rewards.sources import FunctionReward

FILES = Path(__file__).parents[1] / "agents" / "openrlhf_files"


def _batch(prompts, responses, labels):
    return RewardBatch(queries=[p + r for p, r in zip(prompts, responses)], prompts=list(prompts),
                       responses=list(responses), labels=list(labels), datasources=[None] * len(prompts))


def _score(source, batch):
    return asyncio.run(call_source(source, batch))


def _no_openrlhf_left():
    return not [m for m in sys.modules if m == "openrlhf" or m.startswith("openrlhf.")]


def test_openrlhf_reward_file_with_tensors():
    src = FunctionReward.from_file(str(FILES / "reward_func.py"))
    out = _score(src, _batch(["Q1: ", "Q2: ", "Q3: "], ["7 and 7", "no", "77 7"], ["7", "7", "7"]))
    assert out.rewards == [2.0, 0.0, 3.0]          # occurrences of the label in the response
    assert out.scores == [1.0, 0.0, 1.0]
    assert out.extra_logs == {"label_hits": [2.0, 0.0, 3.0]}


def test_openrlhf_math_reward_file_imports_openrlhf_utils():
    pytest.importorskip("math_verify")
    if importlib.util.find_spec("openrlhf") is not None:
        pytest.skip("a real openrlhf is installed here")
    src = FunctionReward.from_file(str(FILES / "math_reward_func.py"))
    assert _no_openrlhf_left()  # the alias existed only while the file was imported
    out = _score(src, _batch(["P: ", "P: ", "P: ", "P: "],
                             [r"so \boxed{\frac{1}{2}}", r"\boxed{3}", "0.5 without a box", r"\boxed{1,000}"],
                             ["0.5", "4", "0.5", "1000"]))
    assert out.rewards == out.scores == [1.0, 0.0, 0.0, 1.0]
    assert out.extra_logs == {"math_accuracy": [0.5] * 4}  # a 0-d tensor is one value for the batch


@pytest.mark.parametrize("ret, rewards, scores", [
    ("torch.tensor([0.5, -1.0])", [0.5, -1.0], [0.5, -1.0]),                       # bare tensor
    ("[1, 0.25]", [1.0, 0.25], [1.0, 0.25]),                                        # bare list
    ('{"rewards": [torch.tensor(2.0), torch.tensor(3.0)]}', [2.0, 3.0], [2.0, 3.0]),  # list of 0-d tensors
    ('{"rewards": torch.tensor([1.0, 2.0]), "scores": [0, 1]}', [1.0, 2.0], [0.0, 1.0]),
    ('{"rewards": torch.tensor([[1.0], [2.0]]).squeeze(-1), "scores": None, "extra_logs": {"n": [1, 2]}}',
     [1.0, 2.0], [1.0, 2.0]),
])
def test_reward_func_return_shapes(tmp_path, ret, rewards, scores):
    path = tmp_path / "reward_func.py"
    path.write_text(f"import torch\n\ndef reward_func(queries, prompts, labels, **kwargs):\n    return {ret}\n")
    out = _score(FunctionReward.from_file(str(path)), _batch(["a", "b"], ["x", "y"], [None, None]))
    assert out.rewards == rewards and out.scores == scores


def test_a_single_number_for_a_batch_of_one(tmp_path):
    path = tmp_path / "reward_func.py"
    path.write_text("import torch\n\ndef reward_func(queries, prompts, labels):\n"
                    "    return {'rewards': torch.tensor(0.75), 'scores': 1}\n")
    src = FunctionReward.from_file(str(path))
    out = _score(src, _batch(["a"], ["x"], [None]))
    assert out.rewards == [0.75] and out.scores == [1.0]
    with pytest.raises(RewardError, match="expected a list of 2 numbers"):
        _score(src, _batch(["a", "b"], ["x", "y"], [None, None]))


def test_wrong_length_tensor_is_refused(tmp_path):
    path = tmp_path / "reward_func.py"
    path.write_text("import torch\n\ndef reward_func(queries, prompts, labels):\n    return torch.zeros(3)\n")
    with pytest.raises(RewardError, match="returned 3 rewards for 2 samples"):
        _score(FunctionReward.from_file(str(path)), _batch(["a", "b"], ["x", "y"], [None, None]))


def test_unknown_openrlhf_name_says_what_is_provided(tmp_path):
    if importlib.util.find_spec("openrlhf") is not None:
        pytest.skip("a real openrlhf is installed here")
    path = tmp_path / "reward_func.py"
    path.write_text("from openrlhf.utils import get_tokenizer\n\ndef reward_func(q, p, l):\n    return [0.0]\n")
    with pytest.raises(RewardError, match="get_tokenizer.*rlhforge provides only.*grade_answer"):
        FunctionReward.from_file(str(path))
    assert _no_openrlhf_left()
