"""SFT with ring attention (``--ds.ring_attn_size 2``) on 2 CPU processes matches one process.

Both ring ranks hold the same packed micro-batches (data-parallel size 1), each runs half of every
packed row; the loss curve and the trained weights equal the one-process packed run.
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhforge.cli.train_sft import main as sft_main
from tests.trainers.sft_helpers import losses, sft_args, write_sft_data
from tests.torchrun import free_port, run_torchrun

ROOT = Path(__file__).parents[2]


def test_sft_ring_attention_two_ranks_match_one(tiny_model_dir, tmp_path):
    """DDP here; DeepSpeed ZeRO-2 with a ring runs in tests/distributed/test_ray_ring.py (the RL actor)."""
    strategy = ["--ds.strategy", "torch"]
    data = write_sft_data(tmp_path / "train.jsonl", n=20)
    common = ["--ds.packing_samples", "--train.micro_batch_size", "4", "--eval.holdout_ratio", "0.2"]  # 16 + 4
    single = tmp_path / "single"
    assert sft_main(sft_args(tiny_model_dir, data, single, *common, "--ds.strategy", "torch")) == 0
    ring = tmp_path / "ring"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), "-m", "rlhforge.cli.train_sft",
           *sft_args(tiny_model_dir, data, ring, *common, *strategy, "--ds.ring_attn_size", "2",
                     "--ds.ring_attn_head_stride", "1",
                     "--model.gradient_checkpointing_enable")]  # recomputed layers find the ring layout
    proc = run_torchrun(cmd, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "16 train / 4 eval" in proc.stdout and "1 data-parallel x 2 ring-attention" in proc.stdout
    a, b = losses(single), losses(ring)
    assert sorted(a) == sorted(b) == [1, 2]
    assert a[1] > 1.0  # a real NLL of the tiny model
    assert b[1] == pytest.approx(a[1], rel=1e-5)
    assert b[2] == pytest.approx(a[2], rel=1e-4)
    evals = [{r["step"]: r["eval/loss"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
              if "eval/loss" in r} for d in (single, ring)]
    assert evals[0].keys() == evals[1].keys() == {2} and evals[0][2] > 1.0
    assert evals[1][2] == pytest.approx(evals[0][2], rel=1e-4)  # eval shards by data-parallel rank too
    norms = [{r["step"]: r["train/grad_norm"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
              if "train/grad_norm" in r} for d in (single, ring)]
    assert norms[1][1] == pytest.approx(norms[0][1], rel=1e-5)  # the gradient itself, not only Adam's direction
    assert norms[1][2] == pytest.approx(norms[0][2], rel=1e-4)
    w1, w2 = load_file(single / "model.safetensors"), load_file(ring / "model.safetensors")
    assert w1.keys() == w2.keys()
    for name in w1:  # Adam's first steps move each weight by ~lr = 1e-3: float noise stays far below
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=5e-5, msg=name)
    assert "rlhforge_ring" not in (ring / "config.json").read_text()  # the export loads anywhere
    assert json.loads((ring / "config.json").read_text())["num_key_value_heads"] == 2  # GQA: 4 query heads
