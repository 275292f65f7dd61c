"""DPO with ring attention (``--ds.ring_attn_size 2``) on 2 CPU processes matches one process.

Both ring ranks hold the same packed micro-batches (data-parallel size 1); policy and a separate
reference model each run half of every packed row and the token log-probs are gathered before the
per-sequence sums. Loss (DPO + the chosen NLL term), accuracy, margins, summed log-probs, gradient
norm, eval metrics and the trained weights equal the one-process packed run; so do they with LoRA,
the reference being the adapter-disabled policy, precomputed through the ring before training.
"""

import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhforge.cli import train_dpo
from rlhforge.tracking.metrics import read_metrics
from tests.model_helpers import perturbed_copy
from tests.torchrun import free_port, run_torchrun

ROOT = Path(__file__).parents[2]
KEYS = ("train/loss", "train/acc", "train/reward_margin", "train/chosen_logp", "train/rejected_logp",
        "train/nll_loss", "train/grad_norm", "train/pairs", "train/tokens")


def args(model_dir, ref_dir, out, *extra):
    return ["--model.model_name_or_path", str(model_dir), "--ref.model_name_or_path", str(ref_dir),
            "--data.dataset", "builtin:arithmetic_preference?n=16", "--eval.dataset",
            "builtin:arithmetic_preference?n=6@test", "--data.prompt_key", "prompt", "--train.batch_size", "8",
            "--train.micro_batch_size", "4", "--adam.lr", "1e-3", "--lr_warmup_ratio", "0", "--ds.param_dtype",
            "fp32", "--ds.packing_samples", "--ds.strategy", "torch", "--model.nll_loss_coef", "0.5",
            "--model.beta", "0.5", "--ckpt.output_dir", str(out), "--logger.progress_bar", "off", *extra]


def run_single_and_ring(argv, tmp_path):
    """The one-process packed run and the 2-rank ring run of ``argv(out)``: their metrics and folders."""
    single, ring = tmp_path / "single", tmp_path / "ring"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert train_dpo.main(argv(single)) == 0
    finally:
        torch.set_num_threads(n)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), "-m", "rlhforge.cli.train_dpo", *argv(ring), "--ds.ring_attn_size", "2"]
    proc = run_torchrun(cmd, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "1 data-parallel x 2 ring-attention" in proc.stdout
    return read_metrics(single), read_metrics(ring), single, ring, proc.stdout


def test_dpo_ring_attention_two_ranks_match_one(tiny_model_dir, tmp_path):
    ref = perturbed_copy(tiny_model_dir, tmp_path / "ref", seed=1)  # policy != reference: a real loss at step 1
    a, b, single, ring, stdout = run_single_and_ring(lambda out: args(tiny_model_dir, ref, out), tmp_path)
    assert "reference: separate model" in stdout
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]
    assert a[0]["train/pairs"] == 8 and a[0]["train/nll_loss"] > 1.0  # a real NLL of the tiny model
    assert abs(a[0]["train/reward_margin"]) > 1e-3  # the perturbed reference differs from the policy
    for ra, rb in zip(a, b):
        for key in KEYS:  # the pair and token counts are not multiplied by the ring
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-5), (ra["step"], key)
    assert b[0]["train/loss"] == pytest.approx(a[0]["train/loss"], rel=1e-5)
    assert b[0]["train/grad_norm"] == pytest.approx(a[0]["train/grad_norm"], rel=1e-5)
    for key in ("eval/loss", "eval/acc", "eval/reward_margin", "eval/pairs"):
        assert b[-1][key] == pytest.approx(a[-1][key], rel=1e-4, abs=1e-5), key
    assert a[-1]["eval/pairs"] == 6
    w1, w2 = load_file(single / "model.safetensors"), load_file(ring / "model.safetensors")
    assert w1.keys() == w2.keys()
    for name in w1:  # Adam moves each weight by ~lr = 1e-3 per step; float noise in a near-zero gradient
        # can move a rare element by a fraction of that (1.07e-4 once, on main as well, with torch 2.13 and
        # transformers 5.19: Adam's step of a near-zero gradient depends on its sign), the rest agree far below it
        diff = (w2[name] - w1[name]).abs()
        assert diff.max() < 2e-4 and diff.mean() < 1e-6, (name, diff.max().item(), diff.mean().item())
    assert "rlhforge_ring" not in (ring / "config.json").read_text()


def test_dpo_ring_lora_precomputed_reference_matches_one(tiny_model_dir, tmp_path):
    """LoRA: the reference is the policy with its adapter disabled, run through the ring once per pair
    before training (``--ref.precompute_enable``)."""
    def argv(out):
        a = args(tiny_model_dir, tiny_model_dir, out, "--ds.lora.rank", "4", "--adam.lr", "5e-3",
                 "--ref.precompute_enable", "--model.nll_loss_coef", "0")
        return a[:2] + a[4:]  # no --ref.model_name_or_path: the policy's own checkpoint
    a, b, single, ring, stdout = run_single_and_ring(argv, tmp_path)
    assert "reference: adapter-disabled policy (precomputed once)" in stdout
    assert a[0]["train/loss"] == pytest.approx(0.6931472, abs=1e-6)  # policy == reference at step 1: log 2
    assert abs(a[1]["train/reward_margin"]) > 0.1  # the adapter has moved the policy away from the reference
    for ra, rb in zip(a, b):
        # step 1: policy == reference, every margin is float noise around 0 and its sign (train/acc) is noise
        keys = ["train/loss", "train/reward_margin", "train/chosen_logp", "train/grad_norm"]
        if ra["step"] > 1:
            keys.append("train/acc")
        else:
            assert abs(ra["train/reward_margin"]) < 1e-5 and abs(rb["train/reward_margin"]) < 1e-5
        for key in keys:
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-5), (ra["step"], key)
    assert b[-1]["eval/loss"] == pytest.approx(a[-1]["eval/loss"], rel=1e-4)
    w1, w2 = (load_file(d / "adapter_model.safetensors") for d in (single, ring))
    assert w1.keys() == w2.keys() and w1
    for name in w1:
        diff = (w2[name] - w1[name]).abs()
        assert diff.max() < 1e-4 and diff.mean() < 1e-6, (name, diff.max().item(), diff.mean().item())
