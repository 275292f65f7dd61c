"""The quickstart runs end to end (shrunk: a few SFT and GRPO steps) and writes its report."""

import json
import math

from rlhforge.cli.main import main


def test_quickstart_smoke(tmp_path):
    out = tmp_path / "qs"
    assert main(["quickstart", "--out", str(out), "--sft_steps", "3", "--sft_batch_size", "8", "--rl_steps", "2",
                 "--rl_prompts", "4", "--group_size", "2", "--eval_every", "1", "--eval_samples", "2",
                 "--eval_size", "12", "--task_params", "max=9", "--train_records", "200"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    for stage in ("before", "after_sft", "after_rl"):
        for key in (f"accuracy_{stage}", f"pass1_sampled_{stage}"):
            assert 0.0 <= summary[key] <= 1.0, (key, summary[key])
    assert math.isclose(summary["rl_gain"], summary["accuracy_after_rl"] - summary["accuracy_after_sft"])
    assert math.isclose(summary["rl_gain_pass1_sampled"],
                        summary["pass1_sampled_after_rl"] - summary["pass1_sampled_after_sft"])
    assert summary["task"] == "larger" and summary["n_eval"] == 12 and summary["eval_samples"] == 2
    assert summary["seconds"]["total"] > 0 and summary["seconds"]["rl"] > 0
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
