"""benchmarks/bench_cpu_linear.py at its smallest: both kernels' products and model steps are measured, and the
two kernels give the same loss and gradients to fp32 rounding."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_cpu_linear_writes_both_kernels(tmp_path):
    out = tmp_path / "cpu_linear.json"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_cpu_linear.py"), "--repeats", "1",
                          "--steps", "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["auto_chooses"] in ("onednn", "blas") and result["auto_probe_ratio"] > 0
    shapes = {(r["rows"], r["in"], r["out"], r["product"]) for r in result["products"]}
    assert len(shapes) == 18 and all(r["blas_gflops"] > 0 and r["onednn_gflops"] > 0 for r in result["products"])
    step = result["model_step"]
    assert step["layers_turned"] == 29  # 4 layers x 7 projections + the head
    assert abs(step["loss_blas"] - step["loss_onednn"]) <= 1e-5 * abs(step["loss_blas"])
    assert step["max_rel_grad_difference"] < 1e-4
