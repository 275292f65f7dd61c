"""The quickstart runs end to end (shrunk: a few SFT and GRPO steps) and writes its report; its
accuracies are recomputed independently (``transformers``' own greedy ``generate``)."""

import json
import os
from fractions import Fraction

import torch

from rlhforge.cli.main import main


def _greedy_accuracy(model_dir, records) -> float:
    """Greedy accuracy with HF ``generate`` one prompt at a time (not rlhforge's engine)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhforge.data.builtin import check_answer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    hits = 0
    for r in records:
        ids = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
        hits += check_answer("larger", tok.decode(out[0, len(ids):], skip_special_tokens=True), r["answer"])
    return hits / len(records)


def _held_out(n: int, max_value: int) -> list[dict]:
    """The first ``n`` distinct test problems (numbers 0..max_value), generated here."""
    from rlhforge.data.builtin import generate_builtin

    seen, out = set(), []
    for r in generate_builtin("larger", "test", n=20000, seed=0, max=max_value):
        if r["prompt"] not in seen:
            seen.add(r["prompt"])
            out.append(r)
    return out[:n]


def test_quickstart_smoke(tmp_path):
    out = tmp_path / "qs"
    assert main(["quickstart", "--out", str(out), "--sft_steps", "3", "--sft_batch_size", "8", "--rl_steps", "2",
                 "--rl_prompts", "4", "--group_size", "2", "--eval_every", "1", "--eval_samples", "2",
                 "--eval_size", "12", "--task_params", "max=9", "--train_records", "200"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "larger" and summary["n_eval"] == 12 and summary["eval_samples"] == 2
    # greedy accuracy of each stage's model, recomputed with HF generate on the same 12 problems
    records = _held_out(12, 9)
    assert all(0 <= int(x) <= 9 for r in records for x in r["prompt"].split("(")[1].rstrip(")?").split(","))
    for key, model_dir in (("accuracy_before", out / "base"), ("accuracy_after_sft", out / "sft"),
                           ("accuracy_after_rl", out / "rl")):
        assert summary[key] == _greedy_accuracy(model_dir, records), key
    # sampled pass@1 is a mean over 12 problems x 2 samples: a whole number of 24ths in [0, 1]
    for stage in ("before", "after_sft", "after_rl"):
        value = Fraction(summary[f"pass1_sampled_{stage}"]).limit_denominator(1000)
        assert 0 <= value <= 1 and (value * 24).denominator == 1, (stage, value)
    sec = summary["seconds"]
    assert sec["rl"] > 0 and sec["sft"] > 0 and sec["total"] >= sec["sft"] + sec["rl"]
    assert summary["args"]["rl_steps"] == 2
    report = (out / "report.md").read_text()
    assert "SFT only" in report and "SFT + GRPO" in report and "sampled pass@1" in report
    assert "![GRPO curves](curves.png)" in report and "![SFT loss](sft_loss.png)" in report
    for png in ("curves.png", "sft_loss.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["plots"] == ["curves.png", "sft_loss.png"]
    assert (out / "rl" / "model.safetensors").is_file()
    metrics = [json.loads(line) for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    logged = {k for m in metrics for k in m}
    assert {"rollout/reward_mean", "actor/approx_kl", "actor/entropy", "rollout/response_length",
            "eval/pass1"} <= logged


def test_format_only_sft_records_hide_the_answer():
    """--sft_labels format (the default): every SFT completion is one of the question's two numbers, picked by
    a seeded coin, so about half are the answer and the labels carry no comparison; prompts are the task's."""
    from rlhforge.cli.quickstart import QuickstartArgs, format_only_records
    from rlhforge.data.builtin import generate_builtin

    args = QuickstartArgs(train_records=2000)
    records = format_only_records(args)
    truth = generate_builtin("larger", "train", n=2000, seed=0, max=49)
    assert [r["prompt"] for r in records] == [r["prompt"] for r in truth]
    hits = 0
    for r, t in zip(records, truth):
        a, b = r["prompt"].split("(")[1].rstrip(")?").split(",")
        assert r["completion"] in (a, b)
        hits += r["completion"] == t["answer"]
    assert 0.45 < hits / len(records) < 0.55  # a fair coin over 2000 records (binomial sd 0.011)
    assert format_only_records(args) == records  # seeded: the same records every time


def test_committed_numbers_are_what_the_defaults_produce(tmp_path, monkeypatch):
    """benchmarks/results/quickstart.json (quoted by README.md and docs/rl.md) was written with the current
    defaults, and its seed-0 run is what `rlhforge quickstart --seed 0` produces now: the run is deterministic
    (1 torch thread, seeded data, model, sampling), so a change of defaults or of the training path that moves
    the numbers fails here until `python benchmarks/bench_quickstart.py` is rerun."""
    import dataclasses
    from pathlib import Path

    from rlhforge.cli.quickstart import QuickstartArgs

    committed = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "quickstart.json").read_text())
    defaults = {f.name: f.default for f in dataclasses.fields(QuickstartArgs) if f.name not in ("out", "seed")}
    assert committed["flags"] == [] and committed["defaults"] == defaults and committed["args"] == defaults
    seed0 = next(r for r in committed["runs"] if r["seed"] == 0)
    # the fp32 linear kernel the committed runs used (rlhforge/models/cpu_linear.py): its rounding moves them
    from rlhforge.models import cpu_linear

    monkeypatch.setenv(cpu_linear.ENV, committed["machine"]["cpu_linear"])
    monkeypatch.setattr(cpu_linear, "_CHOICE", None)
    out = tmp_path / "qs0"
    assert main(["quickstart", "--out", str(out), "--seed", "0"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for name, key in (("untrained", "before"), ("sft_only", "after_sft"), ("sft_grpo", "after_rl")):
        assert summary[f"accuracy_{key}"] == seed0["greedy"][name], name
        assert summary[f"pass1_sampled_{key}"] == seed0["sampled_pass1"][name], name


def test_larger_task():
    from rlhforge.data.builtin import check_answer, generate_builtin

    train = {r["prompt"] for r in generate_builtin("larger", "train", n=5000, seed=0)}
    test = generate_builtin("larger", "test", n=5000, seed=1)
    assert not train & {r["prompt"] for r in test}
    for r in test[:50]:
        a, b = (int(x) for x in r["prompt"].split("(")[1].rstrip(")?").split(","))
        assert a != b and r["answer"] == str(max(a, b)) and 0 <= min(a, b) and max(a, b) <= 49
    assert check_answer("larger", " 12<|im_end|>", "12") == 1.0
    assert check_answer("larger", "12 or 7", "12") == 0.0
    assert check_answer("larger", "7", "12") == 0.0
    assert check_answer("larger", "none", "12") == 0.0


SHRUNK = ["--sft_steps", "3", "--sft_batch_size", "8", "--rl_steps", "2", "--rl_prompts", "4", "--group_size", "2",
          "--eval_every", "1", "--eval_samples", "2", "--eval_size", "12", "--task_params", "max=9",
          "--train_records", "200"]


def test_bench_quickstart_collects_every_seed(tmp_path):
    """benchmarks/bench_quickstart.py on a shrunk configuration (2 seeds), into a temporary results file:
    every number is the one in that seed's summary.json, the means/min/max are recomputed here."""
    import importlib.util
    from pathlib import Path

    from rlhforge.cli.quickstart import QuickstartArgs

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_quickstart.py"
    spec = importlib.util.spec_from_file_location("bench_quickstart", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = tmp_path / "quickstart.json"
    assert bench.main(["--seeds", "0", "1", "--runs_dir", str(tmp_path / "runs"), "--results", str(results),
                       "--note", "smoke", "--", *SHRUNK]) == 0
    data = json.loads(results.read_text())
    assert data["flags"] == SHRUNK and data["task"] == "larger" and data["task_params"] == "max=9"
    assert data["n_eval"] == 12 and data["eval_samples_per_problem"] == 2
    assert data["defaults"]["rl_steps"] == QuickstartArgs.rl_steps and data["args"]["rl_steps"] == 2  # defaults vs flags used
    assert data["command"].startswith("rlhforge quickstart --out ") and "--seed N --sft_steps 3" in data["command"]
    assert data["machine"]["cpu_count"] == os.cpu_count() and data["machine"]["torch_threads"] == 1
    assert data["notes"][-1] == "smoke"
    assert [r["seed"] for r in data["runs"]] == [0, 1]
    for run in data["runs"]:
        summary = json.loads((tmp_path / "runs" / f"qs{run['seed']}" / "summary.json").read_text())
        assert summary["seed"] == run["seed"] and summary["args"]["rl_steps"] == 2
        for name, key in (("untrained", "before"), ("sft_only", "after_sft"), ("sft_grpo", "after_rl")):
            assert run["greedy"][name] == summary[f"accuracy_{key}"]
            assert run["sampled_pass1"][name] == summary[f"pass1_sampled_{key}"]
        assert run["seconds"]["total"] == round(summary["seconds"]["total"], 1)
        assert run["wall_seconds_process"] >= summary["seconds"]["total"]  # the process includes start-up
    for group in ("greedy", "sampled_pass1"):
        for name in ("sft_only", "sft_grpo"):
            values = [r[group][name] for r in data["runs"]]
            assert data["summary"][f"{group}_{name}"] == {"mean": round((values[0] + values[1]) / 2, 4),
                                                          "min": round(min(values), 4), "max": round(max(values), 4)}


def test_quickstart_script_help_answers_without_installing(tmp_path):
    """``bash scripts/quickstart.sh --help`` (issue 47, item 9) answers from the installed rlhforge where .venv
    has one, and without .venv prints its own usage instead of creating and filling one first."""
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    here = subprocess.run(["bash", "scripts/quickstart.sh", "--help"], cwd=root, capture_output=True, text=True,
                          timeout=120)
    assert here.returncode == 0 and "--sft_steps" in here.stdout and "setup_env" not in here.stderr
    (tmp_path / "scripts").mkdir()
    shutil.copy(root / "scripts" / "quickstart.sh", tmp_path / "scripts")
    bare = subprocess.run(["bash", "scripts/quickstart.sh", "-h"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=30)
    assert bare.returncode == 0 and bare.stdout.startswith("usage: bash scripts/quickstart.sh")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scripts"]  # no .venv made, nothing installed
