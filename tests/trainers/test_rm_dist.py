"""Reward model on 2 CPU processes with DeepSpeed ZeRO-3 and packing (torchrun, gloo): the same
per-step losses as one process, and the exported model reloads. Slow (one torchrun launch)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from rlhforge.cli import train_rm
from rlhforge.tracking.metrics import read_metrics
from tests.torchrun import free_port, run_torchrun


def args(model_dir, out):
    return ["--model.model_name_or_path", str(model_dir), "--data.dataset", "builtin:arithmetic_preference?n=48",
            "--eval.dataset", "builtin:arithmetic_preference?n=15@test", "--data.prompt_key", "prompt",
            "--train.batch_size", "16", "--train.micro_batch_size", "4", "--adam.lr", "2e-3", "--ds.packing_samples",
            "--ckpt.output_dir", str(out), "--ckpt.save_steps", "2", "--ckpt.path", str(out / "ckpt"),
            "--logger.progress_bar", "off"]


@pytest.mark.slow
def test_two_ranks_zero3_match_one_process(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    single = tmp_path / "single"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train_rm.main(args(tiny_model_dir, single)) == 0
    finally:
        torch.set_num_threads(n)
    dist = tmp_path / "dist"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2]), "TQDM_DISABLE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), "-m", "rlhforge.cli.train_rm", *args(tiny_model_dir, dist),
           "--ds.zero_stage", "3"]
    proc = run_torchrun(cmd, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "2 rank(s)" in proc.stdout and "DeepSpeedStrategy" in proc.stdout
    a, b = read_metrics(single), read_metrics(dist)
    assert len(a) == len(b) == 3
    for ra, rb in zip(a, b):
        for key in ("train/loss", "train/acc", "train/reward_margin"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-5), (ra["step"], key)
    assert b[-1]["eval/acc"] == pytest.approx(a[-1]["eval/acc"]) and b[-1]["eval/acc"] >= 0.8
    assert (dist / "ckpt" / "step_2" / "deepspeed").is_dir()
    model = AutoModelForSequenceClassification.from_pretrained(dist)
    assert model.config.num_labels == 1 and model.config.reward_std > 0
