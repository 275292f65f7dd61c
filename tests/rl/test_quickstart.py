"""The quickstart runs end to end (shrunk: a few SFT and GRPO steps) and writes its report."""

import json

from rlhforge.cli.main import main


def test_quickstart_smoke(tmp_path):
    out = tmp_path / "qs"
    assert main(["quickstart", "--out", str(out), "--sft_steps", "3", "--sft_batch_size", "8", "--rl_steps", "2",
                 "--rl_prompts", "4", "--group_size", "2", "--eval_every", "1", "--task_params", "max=5"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert {"accuracy_before", "accuracy_after_sft", "accuracy_after_rl", "rl_gain"} <= set(summary)
    report = (out / "report.md").read_text()
    assert "after GRPO" in report and (out / "curves.png").is_file()
    assert (out / "rl" / "model.safetensors").is_file()
