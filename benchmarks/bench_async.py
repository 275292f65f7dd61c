"""Sync vs async RL on CPU: the same GRPO run with generation waiting for training (sync) and with
generation running ahead (``--train.async_enable``, queue sizes 1 and 2, with and without partial
rollouts).

    python benchmarks/bench_async.py [--steps 8] [--threads 1 2] [--out benchmarks/results/async.json]

Each configuration trains a fresh copy of the same tiny model (hidden 256, 4 layers; wider than the
test model so generation and training both take measurable time) for ``--steps`` RL steps of 16
prompts x 8 samples (up to 16 new tokens) on the built-in arithmetic task, in this process, with the
HF engine. Records wall seconds per step (after the first step, which includes start-up), the
trainer's mean wait for a batch (``timing/wait_rollout``), mean generation and training time, the
staleness actually seen, and the mean reward. Generation (a thread) and training share this
process's CPU cores: with 1 torch thread each phase uses one core, so overlapping them can use both
cores of a 2-core machine; with 2 threads each phase already uses both, and the overlap mostly
competes. On a GPU node generation and training run on different devices (or, colocated, take
turns), which is where async pays off; measuring that needs a GPU run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONFIGS = {
    "sync": [],
    "async_q1": ["--train.async_enable", "--train.async_queue_size", "1"],
    "async_q2": ["--train.async_enable", "--train.async_queue_size", "2"],
    "async_q1_partial": ["--train.async_enable", "--train.async_queue_size", "1", "--train.partial_rollout_enable"],
}


def run(name: str, extra: list[str], model: Path, out: Path, steps: int) -> dict:
    from rlhforge.cli.train_ppo_ray import build_trainer, parse_rl_args

    cfg = parse_rl_args([
        "--actor.model_name_or_path", str(model), "--reward.remote_url", "builtin:arithmetic",
        "--data.prompt_dataset", "builtin:arithmetic?n=2000&max=14", "--data.input_key", "prompt",
        "--data.label_key", "answer", "--data.apply_chat_template", "--data.max_len", "64",
        "--rollout.batch_size", "16", "--rollout.n_samples_per_prompt", "8", "--rollout.max_new_tokens", "16",
        "--rollout.micro_batch_size", "64", "--train.batch_size", "64", "--train.micro_batch_size", "32",
        "--train.max_steps", str(steps), "--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0",
        "--actor.adam.lr", "1e-4", "--ds.param_dtype", "fp32", "--ckpt.output_dir", str(out),
        "--ckpt.path", str(out / "ck"), "--ckpt.save_steps", "-1", "--logger.progress_bar", "off",
        "--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", "clip", *extra,
    ])
    trainer = build_trainer(cfg)
    t0 = time.perf_counter()
    trainer.fit()
    wall = time.perf_counter() - t0
    trainer.logger.close()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "async/staleness" in r]
    later = rows[1:]

    def mean(key, rs=later):
        vals = [r[key] for r in rs if key in r]
        return sum(vals) / len(vals) if vals else None

    stamps = [r["time"] for r in rows] if all("time" in r for r in rows) else None
    per_step = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if stamps and len(stamps) > 1 else wall / max(len(rows), 1)
    return {
        "wall_s": wall, "seconds_per_step_after_first": per_step,
        "mean_wait_rollout_s": mean("timing/wait_rollout"), "mean_generation_s": mean("timing/generation"),
        "mean_training_s": mean("timing/ppo_train"), "mean_experience_s": mean("timing/make_experience"),
        "staleness": [r["async/staleness"] for r in rows],
        "mean_reward": mean("rollout/reward_mean", rows),
        "mean_logprob_gap": mean("rollout/logprob_diff_rollout_vs_train"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                    help="torch intra-op threads; each value is a separate round of all configs")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "async.json"))
    args = ap.parse_args()
    import torch

    from rlhforge.models.tiny import TinyModelSpec, build_tiny_model

    rounds = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model", TinyModelSpec(hidden_size=256, intermediate_size=1024,
                                                                     num_hidden_layers=4, num_attention_heads=8,
                                                                     num_key_value_heads=4))
        for threads in args.threads:
            torch.set_num_threads(threads)
            results = {}
            for name, extra in CONFIGS.items():
                results[name] = run(name, extra, model, Path(tmp) / f"{name}_t{threads}", args.steps)
                print(threads, name, json.dumps({k: v for k, v in results[name].items() if k != "staleness"}))
            base = results["sync"]["seconds_per_step_after_first"]
            rounds[f"threads_{threads}"] = {
                "configs": results,
                "speedup_over_sync": {k: base / v["seconds_per_step_after_first"] for k, v in results.items()},
            }
    report = {
        "steps": args.steps, "prompts_x_samples": "16 x 8", "max_new_tokens": 16,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "rounds": rounds,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v["speedup_over_sync"] for k, v in rounds.items()}, indent=2))


if __name__ == "__main__":
    main()
