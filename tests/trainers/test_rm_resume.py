"""Exact resume: a reward-model run interrupted after its step-2 checkpoint and resumed in a new
process gives the same per-step losses and eval metrics as the run straight through (CPU fp32)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhforge.cli import train_rm
from rlhforge.tracking.metrics import read_metrics
from rlhforge.trainers.rm import RMTrainer

STEPS = 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Interrupted(Exception):
    pass


def args(model_dir, run_dir):
    return ["--model.model_name_or_path", str(model_dir), "--data.dataset", "builtin:arithmetic_preference?n=64",
            "--eval.dataset", "builtin:arithmetic_preference?n=16@test", "--data.prompt_key", "prompt",
            "--train.batch_size", "16", "--train.micro_batch_size", "8", "--train.max_steps", str(STEPS),
            "--adam.lr", "2e-3", "--eval.steps", "2", "--ckpt.save_steps", "2", "--ckpt.output_dir", str(run_dir),
            "--ckpt.path", str(run_dir / "ckpt"), "--logger.progress_bar", "off"]


def test_interrupted_and_resumed_run_matches_the_straight_run(tiny_model_dir, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    assert train_rm.main(args(tiny_model_dir, straight)) == 0

    resumed = tmp_path / "resumed"
    save = RMTrainer.save_checkpoint

    def save_then_crash(self):
        path = save(self)
        if self.state.global_step == STEPS // 2:
            raise Interrupted  # the process "dies" right after its mid-run checkpoint
        return path

    monkeypatch.setattr(RMTrainer, "save_checkpoint", save_then_crash)
    with pytest.raises(Interrupted):
        train_rm.main(args(tiny_model_dir, resumed))
    monkeypatch.undo()
    assert [r["step"] for r in read_metrics(resumed)] == [1, 2]

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "rlhforge.cli.train_rm", *args(tiny_model_dir, resumed),
                           "--ckpt.load_enable"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"resuming from {resumed / 'ckpt' / 'step_2'}: steps 1-2 of {STEPS} are done; next is step 3" in proc.stdout

    a, b = read_metrics(straight), read_metrics(resumed)
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    for ra, rb in zip(a, b):
        for key in ("train/loss", "train/acc", "train/reward_margin", "train/grad_norm", "train/lr", "eval/loss",
                    "eval/acc", "eval/reward_mean", "eval/reward_std"):
            if key in ra:
                assert rb[key] == pytest.approx(ra[key], abs=1e-5, rel=1e-5), (ra["step"], key)
    assert (straight / "config.json").read_text() == (resumed / "config.json").read_text()  # same reward stats
