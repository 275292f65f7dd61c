"""fp32 linear layers on CPU: PyTorch's BLAS (``F.linear``, MKL's sgemm) against oneDNN
(rlhforge/models/cpu_linear.py), one thread.

    python benchmarks/bench_cpu_linear.py            # ~1 min; writes benchmarks/results/cpu_linear.json

Two parts:

- **products**: GFLOP/s of the three products of a linear layer (forward ``x @ W.T``, the input's gradient
  ``g @ W``, the weight's gradient ``g.T @ x``) at the shapes of the benchmark model (hidden 256, MLP 768,
  vocabulary 1000): 1,024 rows (a training micro-batch) and 16 rows (a decoding step); best of ``--repeats``.
- **model step**: the benchmark's Llama (hidden 256 x 4 layers) forward + backward on 8 x 128 tokens, the same
  model with its linear layers as they load and turned into ``CpuLinear`` (same weights), alternating, median of
  ``--steps``; the loss and the largest relative gradient difference between the two.

Also records the decision ``onednn_chosen()`` makes on this machine (``auto``) and its probe's ratio.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def products(repeats: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from rlhforge.models.cpu_linear import best_seconds as _best
    from rlhforge.models.cpu_linear import onednn_linear

    rows = []
    g = torch.Generator().manual_seed(0)
    for m in (1024, 16):
        for k, n in ((256, 768), (768, 256), (256, 1000)):
            x, w, gr = (torch.randn(*s, generator=g) for s in ((m, k), (n, k), (m, n)))
            flop = 2 * m * k * n
            cases = {
                "forward": (lambda: F.linear(x, w), lambda: onednn_linear(x, w, None)),
                "grad_input": (lambda: gr @ w, lambda: onednn_linear(gr, w.t(), None)),
                "grad_weight": (lambda: gr.t() @ x, lambda: onednn_linear(gr.t(), x.t(), None)),
            }
            for name, (blas, dnn) in cases.items():
                tb, td = _best(blas, repeats), _best(dnn, repeats)
                rows.append({"rows": m, "in": k, "out": n, "product": name,
                             "blas_gflops": round(flop / tb / 1e9, 1), "onednn_gflops": round(flop / td / 1e9, 1),
                             "speedup": round(tb / td, 2)})
    return rows


def model_step(steps: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from bench_vs_trl import build_model
    from rlhforge.models import cpu_linear

    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(Path(tmp) / "model")
        blas = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    dnn = copy.deepcopy(blas)
    saved = cpu_linear._CHOICE
    cpu_linear._CHOICE = True  # measured whatever this machine's auto decision is
    try:
        turned = cpu_linear.use_cpu_linear(dnn)
        ids = torch.randint(5, 1000, (8, 128), generator=torch.Generator().manual_seed(0))

        def step(model):
            model.zero_grad(set_to_none=True)
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            return out.loss.item(), [p.grad for p in model.parameters()]

        (lb, gb), (ld, gd) = step(blas), step(dnn)
        rel = max(float((a - b).abs().max() / a.abs().max().clamp(min=1e-30)) for a, b in zip(gb, gd))
        times: dict[str, list[float]] = {"blas": [], "onednn": []}
        for i in range(steps):
            for name, model in ((("blas", blas), ("onednn", dnn)) if i % 2 == 0 else (("onednn", dnn), ("blas", blas))):
                t = time.perf_counter()
                step(model)
                times[name].append(time.perf_counter() - t)
    finally:
        cpu_linear._CHOICE = saved
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"tokens": 8 * 128, "layers_turned": turned, "loss_blas": lb, "loss_onednn": ld,
            "max_rel_grad_difference": rel, "blas_s": round(med["blas"], 4), "onednn_s": round(med["onednn"], 4),
            "speedup": round(med["blas"] / med["onednn"], 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench_cpu_linear.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default=str(HERE / "results" / "cpu_linear.json"))
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    from rlhforge.models import cpu_linear

    probe = cpu_linear._probe_gain()
    result = {"setup": {"threads": 1, "torch": torch.__version__, "cpu": _cpu_name()},
              "auto_probe_ratio": round(probe, 2), "auto_chooses": "onednn" if cpu_linear.onednn_chosen() else "blas",
              "products": products(args.repeats), "model_step": model_step(args.steps)}
    for r in result["products"]:
        print(f"{r['rows']:5d} x {r['in']:4d} -> {r['out']:4d} {r['product']:12s} BLAS {r['blas_gflops']:6.1f}  "
              f"oneDNN {r['onednn_gflops']:6.1f} GFLOP/s  ({r['speedup']}x)")
    s = result["model_step"]
    print(f"model fwd+bwd {s['tokens']} tokens: BLAS {s['blas_s']} s, oneDNN {s['onednn_s']} s ({s['speedup']}x); "
          f"largest relative gradient difference {s['max_rel_grad_difference']:.1e}; auto: {result['auto_chooses']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
