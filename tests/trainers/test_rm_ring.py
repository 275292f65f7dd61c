"""Reward-model training with ring attention (``--ds.ring_attn_size 2``) on 2 CPU processes
(DeepSpeed ZeRO-2) matches one process.

Both ring ranks hold the same packed micro-batches (data-parallel size 1), each runs half of every
packed row; the value head's per-token outputs are gathered so that every ring rank reads each
sample's reward at its last token, wherever that token lies. Loss, accuracy, rewards, gradient
norm, eval metrics, the exported reward mean/std and the trained weights equal the one-process
packed run.
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhforge.cli import train_rm
from rlhforge.tracking.metrics import read_metrics
from tests.torchrun import free_port, run_torchrun

ROOT = Path(__file__).parents[2]
KEYS = ("train/loss", "train/acc", "train/chosen_reward", "train/rejected_reward", "train/reward_margin",
        "train/grad_norm", "train/pairs", "train/tokens")


def args(model_dir, out, *extra):
    return ["--model.model_name_or_path", str(model_dir), "--data.dataset", "builtin:arithmetic_preference?n=16",
            "--eval.dataset", "builtin:arithmetic_preference?n=6@test", "--data.prompt_key", "prompt",
            "--train.batch_size", "8", "--train.micro_batch_size", "4", "--adam.lr", "1e-3", "--lr_warmup_ratio",
            "0", "--ds.param_dtype", "fp32", "--ds.packing_samples", "--ckpt.output_dir", str(out),
            "--logger.progress_bar", "off", *extra]


def test_rm_ring_attention_two_ranks_match_one(tiny_model_dir, tmp_path):
    single = tmp_path / "single"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train_rm.main(args(tiny_model_dir, single, "--ds.strategy", "torch")) == 0
    finally:
        torch.set_num_threads(n)
    ring = tmp_path / "ring"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), "-m", "rlhforge.cli.train_rm",
           *args(tiny_model_dir, ring, "--ds.strategy", "deepspeed", "--ds.zero_stage", "2",
                 "--ds.ring_attn_size", "2")]
    proc = run_torchrun(cmd, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "1 data-parallel x 2 ring-attention" in proc.stdout and "DeepSpeedStrategy" in proc.stdout
    a, b = read_metrics(single), read_metrics(ring)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    assert a[0]["train/pairs"] == 8 and abs(a[0]["train/reward_margin"]) > 1e-4  # random head: nonzero rewards
    for ra, rb in zip(a, b):
        for key in KEYS:  # the pair and token counts are not multiplied by the ring
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-6), (ra["step"], key)
    assert b[0]["train/loss"] == pytest.approx(a[0]["train/loss"], rel=1e-5)
    assert b[0]["train/grad_norm"] == pytest.approx(a[0]["train/grad_norm"], rel=1e-5)
    for key in ("eval/loss", "eval/acc", "eval/chosen_reward", "eval/reward_mean", "eval/reward_std", "eval/pairs"):
        assert b[-1][key] == pytest.approx(a[-1][key], rel=1e-4, abs=1e-6), key
    assert a[-1]["eval/pairs"] == 6
    c1, c2 = (json.loads((d / "config.json").read_text()) for d in (single, ring))
    assert c2["reward_mean"] == pytest.approx(c1["reward_mean"], rel=1e-4, abs=1e-6)
    assert c2["reward_std"] == pytest.approx(c1["reward_std"], rel=1e-4)
    assert "rlhforge_ring" not in json.dumps(c2)  # the export loads anywhere
    w1, w2 = load_file(single / "model.safetensors"), load_file(ring / "model.safetensors")
    assert w1.keys() == w2.keys() and any("score" in k for k in w1)
    for name in w1:  # Adam moves each weight by ~lr = 1e-3 per step; float noise in a near-zero gradient
        # can move a rare element by a fraction of that, the rest agree far below it
        diff = (w2[name] - w1[name]).abs()
        assert diff.max() < 1e-4 and diff.mean() < 1e-6, (name, diff.max().item(), diff.mean().item())
