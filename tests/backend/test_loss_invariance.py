"""Loss and gradients of one optimizer step do not depend on ranks or micro-batches:
1 rank x 4 micro-batches and 2 ranks x 2 micro-batches (DDP, ZeRO-2, ZeRO-3) equal one big batch."""

import os
import sys
from pathlib import Path

import pytest
import torch
from tests.torchrun import free_port, run_torchrun

WORKER = Path(__file__).with_name("dist_grad_worker.py")


def _run(tiny_model_dir, tmp_path, nproc, micro, specs):
    out = tmp_path / f"grads_{nproc}_{micro}.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), str(WORKER), str(tiny_model_dir), str(out), str(micro), *specs]
    if nproc == 1:
        cmd = [sys.executable, str(WORKER), str(tiny_model_dir), str(out), str(micro), *specs]
    proc = run_torchrun(cmd, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out, weights_only=False)


@pytest.mark.slow
def test_ranks_and_micro_batches_give_the_global_gradient(tiny_model_dir, tmp_path):
    reference = _run(tiny_model_dir, tmp_path, 1, 8, ["torch"])["torch"]  # one big batch
    one_rank = _run(tiny_model_dir, tmp_path, 1, 2, ["torch"])["torch"]  # 1 rank x 4 micro-batches
    two_ranks = _run(tiny_model_dir, tmp_path, 2, 2, ["torch", "deepspeed:2", "deepspeed:3", "fsdp2"])  # 2 x 2
    assert reference["loss"] > 1.0  # a real NLL of a random model over ~1000 tokens
    for name, result in [("1x4", one_rank), *[(f"2x2 {k}", v) for k, v in two_ranks.items()]]:
        assert result["loss"] == pytest.approx(reference["loss"], rel=1e-5), name
        for pname, g_ref in reference["grads"].items():
            g = result["grads"][pname]
            assert g is not None, f"{name}: no gradient for {pname}"
            torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-6, msg=f"{name}: {pname}")
