"""Does torch.compile buy the SFT step anything on this CPU? The bare SFT step eager and compiled.

    python benchmarks/bench_compile.py                      # fp32 and bf16, 2 rounds: results/compile_sft.json
    python benchmarks/bench_compile.py --precision bf16 --rounds 1 --steps 3

The work is ``bench_vs_trl.py``'s SFT headline (the benchmark's tiny Llama, batch 8, max length 128,
the same generated data, loss on the completion tokens, AdamW, gradient clipping), run three ways, each
in its own process with 1 thread and an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR`` in a fresh
temporary folder, so the compile cost is the one a first run pays):

- ``eager_packed``: :func:`bench_bare.run_bare` itself, one unpadded row with per-sample attention
  (what rlhforge runs on CPU);
- ``eager_padded``: ``run_bare(..., sft_layout="padded")``, the batch padded to its longest sample,
  one forward/backward (what TRL runs);
- ``compiled_padded``: the same step with its forward and loss under ``torch.compile``
  (``compiled=True``; inductor, default settings; the backward is compiled with it by AOTAutograd). The packed layout is not
  compiled: its per-sample attention loops over the samples' lengths, a graph break and a new graph
  for every batch.

Each record: time from before the model load to the first step's end (the compile included),
seconds per step after the warm-up, peak RSS. Rounds alternate the variants.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
VARIANTS = ("eager_packed", "eager_padded", "compiled_padded")


def child(args) -> int:
    import torch

    from bench_bare import peak_rss_gb, run_bare

    torch.set_num_threads(1)
    start = time.time()
    marks = run_bare("sft", args.model, args.data, {"batch": args.batch, "max_len": args.max_len},
                     args.steps + args.warmup, precision=args.precision,
                     sft_layout="packed" if args.child == "eager_packed" else "padded",
                     compiled=args.child == "compiled_padded")["step_end_times"]
    print(json.dumps({"first_step_s": marks[0] - start,
                      "seconds_per_step": (marks[-1] - marks[args.warmup - 1]) / args.steps,
                      "peak_rss_gb": peak_rss_gb()}))
    return 0


def run_variant(variant: str, precision: str, model: str, data: str, args) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, __file__, "--child", variant, "--precision", precision, "--model", model,
               "--data", data, "--batch", str(args.batch), "--max-len", str(args.max_len),
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} ({precision}) failed, rc {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", choices=("fp32", "bf16", "both"), default="both")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(HERE / "results" / "compile_sft.json"))
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(HERE))
    if args.child:
        return child(args)
    if args.warmup < 1 or args.steps < 1:
        parser.error("--warmup and --steps must be at least 1")
    from bench_bare import write_sft
    from bench_vs_trl import build_model

    precisions = ("fp32", "bf16") if args.precision == "both" else (args.precision,)
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(build_model(Path(tmp) / "model"))
        data = str(Path(tmp) / "sft.jsonl")
        write_sft(Path(data), args.batch * (args.steps + args.warmup), args.max_len)
        for precision in precisions:
            runs: dict = {v: [] for v in VARIANTS}
            for r in range(args.rounds):
                for v in VARIANTS:
                    runs[v].append(run_variant(v, precision, model, data, args))
                    print(f"{precision} round {r} {v}: {runs[v][-1]}", flush=True)
            results[precision] = {v: {"runs": rs,
                                      "best_seconds_per_step": min(x["seconds_per_step"] for x in rs),
                                      "first_step_s": [round(x["first_step_s"], 2) for x in rs]}
                                  for v, rs in runs.items()}
    import torch

    record = {"work": "sft", "point": {"batch": args.batch, "max_len": args.max_len}, "threads": 1,
              "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"{'precision':9} {'variant':16} {'best s/step':>11} {'first step s':>14}")
    for precision, by in results.items():
        for v, res in by.items():
            print(f"{precision:9} {v:16} {res['best_seconds_per_step']:11.4f} {str(res['first_step_s']):>14}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
