"""SFT throughput: packed vs padded on mixed-length data (tokens/s, peak memory).

    .venv/bin/python benchmarks/bench_sft.py [--steps 20] [--out benchmarks/results/sft.json]

Builds a tiny model (wider than the test one, so compute dominates), writes mixed-length
prompt/response data (responses of 4..120 words), runs the real SFT CLI twice (padded, packed) with
the same batches, and records target tokens/s (median over steps after warm-up), wall time and
peak RSS (CPU) / peak allocated (GPU) of each run in a separate process.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_data(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    words = "the model learns to add small numbers and answer questions about them clearly".split()
    with open(path, "w") as f:
        for _ in range(n):
            length = rng.choice([4, 8, 16, 32, 64, 120])
            response = " ".join(rng.choice(words) for _ in range(length))
            f.write(json.dumps({"input": f"Say {length} words.", "output": response}) + "\n")


def run(mode: str, model: Path, data: Path, out: Path, steps: int, batch: int) -> dict:
    args = [sys.executable, "-m", "rlhforge.cli.train_sft", "--model.model_name_or_path", str(model),
            "--data.dataset", str(data), "--data.input_key", "input", "--data.output_key", "output",
            "--data.apply_chat_template", "--data.max_len", "256", "--train.batch_size", str(batch),
            "--train.micro_batch_size", str(batch), "--train.max_steps", str(steps), "--train.max_epochs", "1",
            "--ckpt.output_dir", str(out), "--ckpt.path", str(out / "ckpt"), "--adam.lr", "1e-4"]
    if mode == "packed":
        args += ["--ds.packing_samples"]
    env = {**os.environ, "TQDM_DISABLE": "1"}
    subprocess.run(args, check=True, cwd=ROOT, env=env, capture_output=True, text=True)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    tps = [r["perf/tokens_per_s"] for r in records[2:]]  # skip warm-up steps
    return {
        "tokens_per_s_median": statistics.median(tps),
        "step_seconds_median": statistics.median(r["timing/step"] for r in records[2:]),
        "peak_memory_gb": max(r["perf/peak_memory_gb"] for r in records),
        "steps": len(records),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="3 steps of a small batch (a smoke run; numbers not meaningful)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sft.json"))
    args = parser.parse_args()
    if args.quick:
        args.steps, args.batch = 3, 4
    from rlhforge.models.tiny import TinyModelSpec, build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_tiny_model(tmp / "model", TinyModelSpec(hidden_size=256, intermediate_size=768,
                                                              num_hidden_layers=4, num_attention_heads=8,
                                                              num_key_value_heads=4))
        data = tmp / "data.jsonl"
        write_data(data, args.steps * args.batch)
        results = {mode: run(mode, model, data, tmp / mode, args.steps, args.batch) for mode in ("padded", "packed")}
    results["packed_over_padded_tokens_per_s"] = (
        results["packed"]["tokens_per_s_median"] / results["padded"]["tokens_per_s_median"]
    )
    results["setup"] = {"model": "tiny llama 4x256 (head_dim 32)", "batch": args.batch, "steps": args.steps,
                        "data": "responses of 4..120 words, max_len 256", "device": "cpu", "threads": os.cpu_count()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
