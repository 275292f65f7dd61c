"""RL step benchmark: rlhforge GRPO on a tiny model (and TRL's GRPOTrainer side by side when installed).

    python benchmarks/bench_rl.py [--steps 6] [--threads 1] [--no-trl] [--quick]

Writes ``benchmarks/results/rl.json``: per framework, seconds per RL step (one generation of
``prompts x group`` completions + the optimizer steps on them), samples/s, tokens/s, the share of
time in generation vs training (rlhforge), peak resident memory, and the TRL/rlhforge time ratio.
Both frameworks get the same tiny model, prompts, group size, lengths, batch sizes and lr, on CPU
with the HF generation path (no vLLM). The first step is a warm-up and is not timed. Each
framework runs in its own process (``--side``), so its peak RSS is its own (its ``VmHWM``), not the
maximum of a process that already ran the other one. ``bench_vs_trl.py`` is the fuller comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_bare import wait_with_peak  # noqa: E402

PROMPTS, GROUP, MAX_NEW = 16, 8, 8


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def bench_rlhforge(model_dir: Path, out_dir: Path, steps: int) -> dict:
    from rlhforge.cli.train_ppo_ray import build_trainer, parse_rl_args

    cfg = parse_rl_args([
        "--actor.model_name_or_path", str(model_dir), "--reward.remote_url", "builtin:arithmetic",
        "--data.prompt_dataset", "builtin:arithmetic?n=2000&max=14", "--data.input_key", "prompt",
        "--data.label_key", "answer", "--data.apply_chat_template", "--data.max_len", "64",
        "--rollout.batch_size", str(PROMPTS), "--rollout.n_samples_per_prompt", str(GROUP),
        "--rollout.max_new_tokens", str(MAX_NEW), "--rollout.micro_batch_size", str(PROMPTS * GROUP),
        "--train.batch_size", str(PROMPTS * GROUP // 2), "--train.micro_batch_size", str(PROMPTS * GROUP // 2),
        "--train.max_steps", str(steps + 1), "--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0",
        "--actor.adam.lr", "1e-4", "--ckpt.output_dir", str(out_dir), "--ckpt.path", str(out_dir / "ck"),
        "--logger.progress_bar", "off",
    ])
    trainer = build_trainer(cfg)
    trainer.sync_weights()
    trainer.step()  # warm-up (generates its batch synchronously)
    rows = [trainer.step() for _ in range(steps)]
    trainer.logger.close()
    names = {"generation": "generation", "experience": "make_experience", "training": "ppo_train",
             "weight_sync": "broadcast", "step": "step_total"}  # result keys -> the trainer's timing/* names
    t = {k: sum(r[f"timing/{name}"] for r in rows) for k, name in names.items()}
    tokens = sum(r["perf/tokens_per_s"] * r["timing/step_total"] for r in rows)
    samples = PROMPTS * GROUP * steps
    return {
        "seconds_per_step": t["step"] / steps, "samples_per_s": samples / t["step"], "tokens_per_s": tokens / t["step"],
        "share_generation": t["generation"] / t["step"], "share_experience": t["experience"] / t["step"],
        "share_training": t["training"] / t["step"], "share_weight_sync": t["weight_sync"] / t["step"],
        "mean_response_length": sum(r["rollout/response_length"] for r in rows) / steps,
        "peak_rss_gb": _peak_rss_gb(),
    }


def bench_trl(model_dir: Path, out_dir: Path, steps: int) -> dict:
    import datasets
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from rlhforge.data.builtin import check_answer, generate_builtin

    records = generate_builtin("arithmetic", "train", n=2000, seed=0, max=14)
    ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                                     for r in records])

    def reward(completions, answer, **kwargs):
        return [check_answer("arithmetic", c[0]["content"], a) for c, a in zip(completions, answer)]

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    args = trl.GRPOConfig(
        output_dir=str(out_dir), per_device_train_batch_size=PROMPTS * GROUP // 2, gradient_accumulation_steps=1,
        generation_batch_size=PROMPTS * GROUP, num_generations=GROUP, max_completion_length=MAX_NEW,
        learning_rate=1e-4, beta=0.0, max_steps=2 * (steps + 1), logging_steps=1, save_strategy="no",
        report_to=[], use_cpu=True, bf16=False, seed=0, temperature=1.0, disable_tqdm=True,
    )
    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            marks.append(time.perf_counter())

    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok,
                              callbacks=[Clock()])
    trainer.train()
    # two optimizer steps per generation; skip the warm-up generation (first two optimizer steps)
    elapsed = marks[-1] - marks[1]
    samples = PROMPTS * GROUP * steps
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return {"version": trl.__version__, "seconds_per_step": elapsed / steps, "samples_per_s": samples / elapsed,
            "mean_response_length": sum(lengths[2:]) / max(len(lengths[2:]), 1), "peak_rss_gb": _peak_rss_gb()}


def run_side(side: str, model_dir: Path, out_dir: Path, steps: int, threads: int) -> dict:
    """One framework in a fresh process; its peak RSS is that process's own (``VmHWM``)."""
    result = out_dir / f"{side}.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TQDM_DISABLE": "1"}
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--side", side, "--model", str(model_dir),
                             "--steps", str(steps), "--threads", str(threads), "--out", str(result)], env=env)
    status, _, peak = wait_with_peak(proc)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"the {side} run failed (exit {proc.returncode})")
    out = json.loads(result.read_text())
    out["peak_rss_gb"] = peak
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="timed RL steps (after one warm-up step)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--no-trl", action="store_true", help="skip the TRL side-by-side run")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "rl.json"))
    parser.add_argument("--quick", action="store_true", help="one timed step (a smoke run; numbers not meaningful)")
    parser.add_argument("--side", choices=("rlhforge", "trl"), help=argparse.SUPPRESS)  # child process
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 1
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(args.threads)
    if args.side:
        with tempfile.TemporaryDirectory() as tmp:
            fn = bench_rlhforge if args.side == "rlhforge" else bench_trl
            Path(args.out).write_text(json.dumps(fn(Path(args.model), Path(tmp) / args.side, args.steps)))
        return 0
    from rlhforge.models.tiny import build_tiny_model

    result = {"setup": {"model": "rlhforge tiny Llama (TinyModelSpec defaults)", "prompts_per_step": PROMPTS,
                        "group_size": GROUP, "max_new_tokens": MAX_NEW, "optimizer_steps_per_rl_step": 2,
                        "torch_threads": args.threads, "device": "cpu", "steps_timed": args.steps,
                        "memory": "peak RSS of each framework's own process"}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = build_tiny_model(tmp / "model", seed=0)
        result["rlhforge"] = run_side("rlhforge", model_dir, tmp, args.steps, args.threads)
        print("rlhforge:", json.dumps(result["rlhforge"], indent=1))
        if not args.no_trl:
            try:
                import trl  # noqa: F401
            except ImportError:
                result["trl"] = {"skipped": "trl is not installed (pip install -e '.[bench]')"}
            else:
                result["trl"] = run_side("trl", model_dir, tmp, args.steps, args.threads)
                result["trl_over_rlhforge_seconds_per_step"] = (
                    result["trl"]["seconds_per_step"] / result["rlhforge"]["seconds_per_step"])
                print("trl:", json.dumps(result["trl"], indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
