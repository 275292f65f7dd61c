"""tinker-cookbook 0.6.1's minimal loops, ``recipes/sl_loop.py`` and ``recipes/rl_loop.py`` (RL with
``loss_fn=importance_sampling``), run unchanged against ``rlhforge serve-tinker``, offline.

Offline stand-ins, all through public seams, none in the server: the base model name the recipes know
(``meta-llama/Llama-3.2-1B``, whose recommended renderer ``role_colon`` works with any tokenizer) is mapped to the
tiny model by ``--model_map``; its tokenizer is registered with the cookbook's ``register_tokenizer``;
``datasets.load_dataset`` returns small generated datasets in the shapes of no_robots and GSM8K; and the RL
reward (GSM8K's ``\\boxed{}`` grader, which a tiny random model never satisfies, so every advantage would be 0
and the loop would skip training) is replaced by one with variance.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import require_module
from tests.tinker.conftest import KEY

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NAME = "meta-llama/Llama-3.2-1B"


@pytest.fixture
def cookbook(tinker, tiny_model_dir, start_server, monkeypatch):
    require_module("tinker_cookbook", "pip install --no-deps tinker-cookbook==0.6.1 chz blobfile pyrage termcolor "
                                      "pylatexenc (docs/tinker.md)")
    import datasets
    from transformers import AutoTokenizer
    from tinker_cookbook import tokenizer_utils

    server = start_server(model_map=(f"{NAME}={tiny_model_dir}",))
    monkeypatch.setenv("TINKER_BASE_URL", server.base_url)
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setitem(tokenizer_utils._CUSTOM_TOKENIZER_REGISTRY, NAME,
                        lambda: AutoTokenizer.from_pretrained(str(tiny_model_dir)))

    def load_dataset(name, *args, **kwargs):
        if name == "HuggingFaceH4/no_robots":
            rows = {"messages": [[{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": f"{w} {w}"}]
                                 for w in ["red", "green", "blue", "cat", "dog", "sun", "one", "two"]]}
        elif name == "openai/gsm8k":
            pairs = [(1, 2), (3, 4), (2, 2), (5, 1)]
            rows = {"question": [f"What is {a} plus {b}?" for a, b in pairs],
                    "answer": [f"{a} + {b} = {a + b}\n#### {a + b}" for a, b in pairs]}
        else:
            raise AssertionError(f"unexpected dataset {name}")
        ds = datasets.Dataset.from_dict(rows)
        return datasets.DatasetDict({"train": ds, "test": ds})

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return server


def _metrics(log_dir):
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def _trained_steps(server):
    models = server.app.state.tinker.models.values()
    return [m.trained.steps for m in models if m.base_model == NAME]


def test_sl_loop(cookbook, tmp_path):
    from tinker_cookbook.recipes import sl_loop

    sl_loop.main(sl_loop.Config(model_name=NAME, batch_size=4, learning_rate=1e-3, lora_rank=4, max_steps=2,
                                save_every=0, max_length=64, log_path=str(tmp_path)))
    rows = _metrics(tmp_path)
    assert len([r for r in rows if "train_mean_nll" in r]) == 2, rows
    assert all(r["train_mean_nll"] > 0 for r in rows if "train_mean_nll" in r)
    assert _trained_steps(cookbook) == [2]


def test_rl_loop_importance_sampling(cookbook, tmp_path, monkeypatch):
    from tinker_cookbook.recipes import rl_loop

    monkeypatch.setattr(rl_loop, "get_reward", lambda response, answer: float(len(response) % 2))
    rl_loop.main(rl_loop.Config(model_name=NAME, batch_size=2, group_size=4, max_tokens=6, max_steps=2,
                                loss_fn="importance_sampling", lora_rank=4, learning_rate=1e-3, save_every=0,
                                log_path=str(tmp_path)))
    rows = _metrics(tmp_path)
    assert len(rows) == 2 and all("reward/total" in r for r in rows)
    assert _trained_steps(cookbook) == [2]  # both batches trained (advantages not all zero)
