"""DPO throughput: pairs/s padded vs packed (and packed with precomputed reference log-probs).

    .venv/bin/python benchmarks/bench_dpo.py [--steps 8] [--batch 16] [--micro 4] [--threads 1] [--repeats 2]
                                             [--out benchmarks/results/dpo.json]

Builds a tiny model (wider than the test one, so compute dominates), writes preference pairs of
mixed lengths (responses of 2..120 words, chosen and rejected drawn independently, so a padded
micro-batch pays for its longest sequence), and runs the real DPO CLI in a separate process per
mode with the same batches:

- ``padded``: chosen + rejected right-padded into one [2B, T] forward (policy and reference);
- ``packed``: the same sequences concatenated into one row (``--ds.packing_samples``);
- ``packed_precomputed``: packed, with reference log-probs computed once before training
  (``--ref.precompute_enable``; the one-off pass is reported as ``precompute_seconds``).

Records pairs/s and tokens/s (median over steps after two warm-up steps), step time, wall time of
the whole run and peak RSS (CPU) / peak allocated memory (GPU). The modes run interleaved for
``--repeats`` rounds and each keeps its best round, since other processes on a shared machine
disturb single runs.

On sdpa/eager (CPU) a packed micro-batch is computed in rows of at most its longest sequence
(:func:`rlhforge.models.forward.packed_rows`), so it never costs more than the padded one; with
flash-attention on GPU the single packed row is attended per sequence by the varlen kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {"padded": [], "packed": ["--ds.packing_samples"],
         "packed_precomputed": ["--ds.packing_samples", "--ref.precompute_enable"]}


def write_data(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    words = "the model learns to add small numbers and answer questions about them clearly".split()
    with open(path, "w") as f:
        for i in range(n):
            chosen = " ".join(rng.choice(words) for _ in range(rng.choice([2, 8, 16, 32, 64, 120])))
            rejected = " ".join(rng.choice(words) for _ in range(rng.choice([2, 8, 16, 32, 64, 120])))
            f.write(json.dumps({"prompt": f"Question {i}: say some words.", "chosen": chosen, "rejected": rejected}) + "\n")


def run(mode: str, model: Path, data: Path, out: Path, steps: int, batch: int, micro: int, threads: int | None) -> dict:
    args = [sys.executable, "-m", "rlhforge.cli.train_dpo", "--model.model_name_or_path", str(model),
            "--data.dataset", str(data), "--data.prompt_key", "prompt", "--data.apply_chat_template",
            "--data.max_len", "256", "--train.batch_size", str(batch), "--train.micro_batch_size", str(micro),
            "--train.max_steps", str(steps), "--train.max_epochs", "1", "--ckpt.output_dir", str(out),
            "--adam.lr", "1e-4", *MODES[mode]]
    env = {**os.environ, "TQDM_DISABLE": "1"}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    start = time.perf_counter()
    proc = subprocess.run(args, check=True, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    timed = records[2:]  # skip warm-up steps
    match = re.search(r"precomputed in ([0-9.]+)s", proc.stdout)
    return {
        "pairs_per_s_median": statistics.median(r["perf/pairs_per_s"] for r in timed),
        "tokens_per_s_median": statistics.median(r["perf/tokens_per_s"] for r in timed),
        "step_seconds_median": statistics.median(r["timing/step"] for r in timed),
        "precompute_seconds": float(match.group(1)) if match else 0.0,
        "run_wall_seconds": wall,
        "peak_memory_gb": max(r["perf/peak_memory_gb"] for r in records),
        "first_step_loss": records[0]["train/loss"],
        "steps": len(records),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="pairs per optimizer step")
    parser.add_argument("--micro", type=int, default=4, help="pairs per micro-batch (2x sequences per forward)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run (0: leave as is)")
    parser.add_argument("--repeats", type=int, default=2, help="interleaved rounds; each mode keeps its best")
    parser.add_argument("--quick", action="store_true", help="3 steps of a small batch (a smoke run; numbers not meaningful)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "dpo.json"))
    args = parser.parse_args()
    if args.quick:
        args.steps, args.batch, args.micro, args.repeats = 3, 4, 2, 1
    from rlhforge.models.tiny import TinyModelSpec, build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_tiny_model(tmp / "model", TinyModelSpec(hidden_size=256, intermediate_size=768,
                                                              num_hidden_layers=4, num_attention_heads=8,
                                                              num_key_value_heads=4))
        data = tmp / "pairs.jsonl"
        write_data(data, args.steps * args.batch)
        # modes interleaved over --repeats rounds (the machine's load drifts); each mode keeps its
        # best round (the least disturbed by other processes)
        rounds: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for r in range(args.repeats):
            for mode in MODES:
                rounds[mode].append(run(mode, model, data, tmp / f"{mode}_{r}", args.steps, args.batch, args.micro,
                                        args.threads))
        results = {}
        for mode, runs in rounds.items():
            best = max(runs, key=lambda x: x["pairs_per_s_median"])
            results[mode] = {**best, "pairs_per_s_all_rounds": [x["pairs_per_s_median"] for x in runs]}
    results["packed_over_padded_pairs_per_s"] = (
        results["packed"]["pairs_per_s_median"] / results["padded"]["pairs_per_s_median"]
    )
    results["precomputed_over_packed_pairs_per_s"] = (
        results["packed_precomputed"]["pairs_per_s_median"] / results["packed"]["pairs_per_s_median"]
    )
    try:
        load = os.getloadavg()[0]
    except OSError:  # pragma: no cover
        load = None
    results["setup"] = {"model": "tiny llama 4x256 (head_dim 32)", "batch_pairs": args.batch,
                        "micro_batch_pairs": args.micro, "threads": args.threads or None, "steps": args.steps,
                        "repeats": args.repeats,
                        "data": "responses of 2..120 words (chosen/rejected independent), chat template, max_len 256",
                        "device": "cpu", "cpus": os.cpu_count(), "load_average_1min_at_end": load}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
