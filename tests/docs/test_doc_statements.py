"""Statements of the docs checked against what the code does and the results files say (issue 47,
item 8): docs/config.md's image flags per command, docs/agents.md's one row for ``environment_images``,
docs/sandbox.md's math-answer examples, and the quick-start numbers README.md and docs/rl.md quote
(from benchmarks/results/quickstart.json, through ``bench_quickstart.docs_quotes``)."""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from tests.docs.blocks import ROOT


def page(name: str) -> str:
    """The page with its lines joined (a quoted phrase may wrap)."""
    return " ".join((ROOT / name).read_text().split())


def test_config_md_image_flags_are_taken_by_the_commands_it_names():
    """The line of docs/config.md on image flags: each ``(commands)`` group names commands whose config
    takes every flag before it (rl takes them: docs/vlm.md "RL with images"); nothing there is refused."""
    from rlhforge.config.dpo import DPOConfig
    from rlhforge.config.parsing import _nest_dotted, from_dict
    from rlhforge.config.rl import RLConfig
    from rlhforge.config.sft import SFTConfig

    line = next(x for x in (ROOT / "docs/config.md").read_text().splitlines() if "`--data.image_key`" in x)
    assert "refused" not in line, line
    classes = {"sft": SFTConfig, "dpo": DPOConfig, "rl": RLConfig}
    values = {"image_key": "pics", "max_images_per_prompt": 2, "freeze_visual_encoder": True}
    named = {}
    for flags, commands in re.findall(r"((?:`--[\w.]+`,? ?)+)\(([\w, ]+)\)", line.split(":")[0]):
        for flag in re.findall(r"`--([\w.]+)`", flags):
            for command in commands.split(", "):
                named.setdefault(command, []).append(flag)
    assert set(named) == {"sft", "dpo", "rl"}, named  # rl among them
    for command, flags in named.items():
        for flag in flags:
            section, key = flag.split(".")
            cfg = from_dict(classes[command], _nest_dotted({flag: values[key]}))
            assert getattr(getattr(cfg, section), key) == values[key], (command, flag)


def test_agents_md_has_one_answer_on_environment_images():
    """docs/agents.md's OpenRLHF table has one row for ``environment_images``, and it does not say
    "not supported" (rlhforge.agents.episode_images puts them in the feedback; tests/agents/test_multi_turn_images.py)."""
    rows = [x for x in (ROOT / "docs/agents.md").read_text().splitlines() if x.startswith("| `environment_images`")]
    assert len(rows) == 1, rows
    assert "not supported" not in rows[0] and "same" in rows[0]


def test_sandbox_md_math_examples_hold():
    """Every "`A` matches `B`" / "`A` does not match `B`" of docs/sandbox.md's math-answer paragraph is
    what ``math_reward(A, B)`` gives (1.0 / 0.0)."""
    from tests.conftest import require_module

    require_module("math_verify", "pip install 'rlhforge[math]'")
    from rlhforge.rewards.math import math_reward

    text = page("docs/sandbox.md")
    para = text[text.index("The final answer is the content of the last"):][:1500]
    claims = re.findall(r"`([^`]+)` (matches|does not match) `([^`]+)`", para)
    for answer, verb, label in claims:
        assert math_reward(answer, label) == (1.0 if verb == "matches" else 0.0), (answer, verb, label)
    assert len(claims) >= 5, claims


def test_quick_start_numbers_are_the_results_files():
    """README.md and docs/rl.md quote benchmarks/results/quickstart.json (the seed-0 run of which
    tests/rl/test_quickstart.py reruns): each line ``bench_quickstart.py --docs`` prints is on its page."""
    spec = importlib.util.spec_from_file_location("bench_quickstart", ROOT / "benchmarks" / "bench_quickstart.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = json.loads((ROOT / "benchmarks" / "results" / "quickstart.json").read_text())
    quotes = bench.docs_quotes(results)
    assert len(quotes["docs/rl.md"]) == len(results["runs"]) + 2
    for name, lines in quotes.items():
        text = page(name)
        missing = [x for x in lines if " ".join(x.split()) not in text]
        assert not missing, f"{name} does not quote {missing}: python benchmarks/bench_quickstart.py --docs"
