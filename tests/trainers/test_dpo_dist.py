"""DPO on 2 CPU processes with DeepSpeed ZeRO-2 and LoRA (reference = adapter disabled): the same
per-step losses as one process; checkpoints are written. Slow (one torchrun launch)."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

from rlhforge.cli import train_dpo
from rlhforge.tracking.metrics import read_metrics
from tests.torchrun import free_port, run_torchrun


def args(model_dir, out):
    return ["--model.model_name_or_path", str(model_dir), "--data.dataset", "builtin:arithmetic_preference?n=48",
            "--eval.dataset", "builtin:arithmetic_preference?n=15@test", "--data.prompt_key", "prompt",
            "--train.batch_size", "16", "--train.micro_batch_size", "4", "--adam.lr", "5e-3", "--ds.lora.rank", "4",
            "--ckpt.output_dir", str(out), "--ckpt.save_steps", "2", "--ckpt.path", str(out / "ckpt"),
            "--logger.progress_bar", "off"]


def _single_and_two_ranks(template: list[str], tmp_path: Path, *dist_extra: str):
    """One process, then two torchrun ranks with ``dist_extra``: ``(single run dir, dist run dir, torchrun result)``."""
    single = tmp_path / "single"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train_dpo.main(args_for(template, single)) == 0
    finally:
        torch.set_num_threads(n)
    dist = tmp_path / "dist"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2]), "TQDM_DISABLE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), "-m", "rlhforge.cli.train_dpo", *args_for(template, dist),
           *dist_extra]
    proc = run_torchrun(cmd, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return single, dist, proc


@pytest.mark.slow
def test_two_ranks_zero2_lora_match_one_process(tiny_model_dir, tmp_path):
    single, dist, proc = _single_and_two_ranks(args(tiny_model_dir, tmp_path), tmp_path, "--ds.zero_stage", "2")
    assert "2 rank(s)" in proc.stdout and "adapter-disabled policy" in proc.stdout
    a, b = read_metrics(single), read_metrics(dist)
    assert len(a) == len(b) == 3
    assert b[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)
    for ra, rb in zip(a, b):
        for key in ("train/loss", "train/reward_margin", "train/chosen_logp"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-5), (ra["step"], key)
    assert b[-1]["eval/loss"] == pytest.approx(a[-1]["eval/loss"], rel=1e-4)
    assert (dist / "ckpt" / "step_2" / "deepspeed").is_dir() and (dist / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_two_ranks_zero3_partition_the_reference_and_match_one_process(tiny_model_dir, tmp_path):
    """A separate reference under ZeRO-3 is partitioned over the ranks like the policy (not a full copy
    per rank), and the losses equal one process's."""
    full = args(tiny_model_dir, tmp_path)
    i = full.index("--ds.lora.rank")
    del full[i : i + 2]  # a separate reference (no LoRA)
    single, dist, proc = _single_and_two_ranks(full, tmp_path, "--ds.zero_stage", "3")
    (line,) = [x for x in proc.stdout.splitlines() if "reference: separate model" in x]
    part = line.split("reference: separate model (deepspeed, ")[1]
    local, total = (int(x) for x in part.split(" parameters on this rank")[0].split(" of "))
    assert local <= total // 2 + 1024, line  # each rank holds about half (ZeRO-3 pads partitions)
    a, b = read_metrics(single), read_metrics(dist)
    assert len(a) == len(b) == 3
    assert b[0]["train/loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at step 0
    for ra, rb in zip(a, b):
        for key in ("train/loss", "train/reward_margin", "train/chosen_logp"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-5), (ra["step"], key)


def args_for(template: list[str], out: Path) -> list[str]:
    """``template`` (from :func:`args`) writing to ``out``."""
    got = list(template)
    for flag, value in (("--ckpt.output_dir", out), ("--ckpt.path", out / "ckpt")):
        got[got.index(flag) + 1] = str(value)
    return got
