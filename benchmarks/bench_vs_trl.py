"""rlhforge vs TRL (and vs a bare torch loop) on the same work, side by side.

    python benchmarks/bench_vs_trl.py                 # SFT, DPO, GRPO at the headline shapes
    python benchmarks/bench_vs_trl.py --quick         # 2 timed steps, smallest shapes (a smoke run)
    python benchmarks/bench_vs_trl.py --sweep         # the full grid of the scaling plot
    python benchmarks/bench_vs_trl.py --work grpo --vllm --rounds 3
    python benchmarks/bench_vs_trl.py --precision bf16   # every side in bf16 (vs_trl_bf16.json)
    python benchmarks/bench_vs_trl.py --preset vocab-real-small --shape ...  # real vocabulary (151936)

Every side trains the same locally built model folder (Llama, hidden 256, 4 layers, ~1k vocab,
head_dim 32) on the same data with the same batch shapes, on CPU, each run in a fresh process:

- ``trl``: TRL's ``SFTTrainer`` / ``DPOTrainer`` / ``GRPOTrainer`` (HF generation, ``use_vllm=False``),
  step ends from a ``TrainerCallback.on_step_end``; gradient checkpointing off as on the other sides
  (TRL's configs default to on: ``--trl-gradient-checkpointing`` keeps that);
- ``rlhforge``: the real CLI (``python -m rlhforge.cli.train_sft`` / ``train_dpo`` /
  ``train_ppo_ray``), step ends from the ``time`` of each ``metrics.jsonl`` record; SFT and DPO
  packed (``--ds.packing_samples``), GRPO padded; ``rlhforge_packed`` is GRPO packed, and
  ``rlhforge_vllm`` / ``rlhforge_vllm_packed`` (``--vllm``) GRPO padded / packed with ``--vllm.num_engines 1``;
- ``bare``: ``benchmarks/bench_bare.py``, the same math with nothing around it.

One GRPO step is one generation of ``prompts x samples`` completions and one optimizer step on
them (TRL: ``generation_batch_size = per_device_train_batch_size``, ``num_iterations=1``;
rlhforge: ``train.batch_size = rollout.batch_size x n_samples``), no KL term, temperature 1.

Per side and shape the figures are: seconds per step from the step-end timestamps after the
warm-up steps (no start-up in the figure), time to first step (process launch to the end of the
first step: imports, model load, tokenisation, first step) and peak RSS of that process (its
``VmHWM``, :func:`bench_bare.wait_with_peak`; each side is measured in its own process). Sides alternate within each round (the
order flips every round) and each keeps its best round. Results go to
``benchmarks/results/vs_trl.json`` (``--quick``: ``vs_trl_quick.json``), a table is printed, and
with several shapes per work a plot of seconds per step against the shape is saved beside it
(``vs_trl_scaling.png``). Timings on a machine other processes are using are not comparable.

``--precision bf16`` runs every side in bf16 with fp32 weights: TRL ``bf16=True`` (autocast on CPU),
rlhforge ``--ds.param_dtype bf16``, the bare loop's forwards under ``torch.autocast`` (its generation
fp32); results then go to ``vs_trl_bf16.json`` / ``vs_trl_sweep_bf16.json`` (plot
``vs_trl_bf16_scaling.png``).
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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from bench_bare import (peak_rss_gb, read_jsonl, run_bare, wait_with_peak, write_dpo,  # noqa: E402
                        write_sft)
from bench_phases import flop_limit, flop_params, matmul_gflops, median_phases, print_phases, step_phases  # noqa: E402

HEADLINE = {"sft": [{"batch": 8, "max_len": 128}], "dpo": [{"batch": 8, "max_len": 128}],
            "grpo": [{"prompts": 4, "samples": 4, "new_tokens": 64}]}
QUICK = {"sft": [{"batch": 8, "max_len": 128}], "dpo": [{"batch": 8, "max_len": 128}],
         "grpo": [{"prompts": 4, "samples": 4, "new_tokens": 8}]}
SWEEP = {"sft": [{"batch": b, "max_len": n} for b in (8, 64) for n in (128, 512, 1024)],
         "dpo": [{"batch": b, "max_len": n} for b in (8, 64) for n in (128, 512, 1024)],
         "grpo": [{"prompts": p, "samples": s, "new_tokens": t} for p, s in ((4, 4), (16, 8), (32, 8))
                  for t in (8, 64, 256)]}
LR = 1e-5


#: --preset: the default small model, or a real shape from ``rlhforge tiny-model --preset`` (random weights)
MODELS = {
    "small": "Llama hidden 256, 4 layers, 8 heads (4 kv), vocab ~1000",
    "vocab-real-small": "Qwen3 hidden 512, 4 layers, 8 heads (4 kv), vocab 151936, tied (~90M parameters)",
    "qwen3-0.6b": "Qwen3-0.6B shape: hidden 1024, 28 layers, 16 heads (8 kv), head_dim 128, vocab 151936, tied",
}


def build_model(path: Path, preset: str = "small") -> Path:
    from rlhforge.models.tiny import PRESETS, TinyModelSpec, build_tiny_model

    if preset != "small":
        arch, spec = PRESETS[preset]
        return build_tiny_model(path, spec, seed=0, arch=arch)
    spec = TinyModelSpec(vocab_size=1000, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4)
    return build_tiny_model(path, spec, seed=0)


def label(point: dict) -> str:
    if "prompts" in point:
        return f"{point['prompts']}x{point['samples']}x{point['new_tokens']}"
    return f"b{point['batch']} len{point['max_len']}"


# ------------------------------------------------------------------------------------------ TRL side
def run_trl(work: str, model_dir: str, data: str | None, point: dict, steps: int, out_dir: str,
            gradient_checkpointing: bool = False, precision: str = "fp32") -> dict:
    import datasets
    import torch
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    marks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            marks.append(time.time())

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    common = dict(output_dir=out_dir, learning_rate=LR, max_steps=steps, logging_steps=1, save_strategy="no",
                  report_to=[], use_cpu=True, bf16=precision == "bf16", seed=0, disable_tqdm=True, dataloader_num_workers=0,
                  # TRL's configs turn gradient checkpointing on by default; rlhforge's is off: the same work is off
                  gradient_checkpointing=gradient_checkpointing)
    extra: dict = {}
    if work == "sft":
        rows = [{"prompt": [{"role": "user", "content": r["prompt"]}],
                 "completion": [{"role": "assistant", "content": r["completion"]}]} for r in read_jsonl(data)]
        args = trl.SFTConfig(per_device_train_batch_size=point["batch"], max_length=point["max_len"], **common)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                                 processing_class=tok, callbacks=[Clock()])
    elif work == "dpo":
        rows = [{"prompt": [{"role": "user", "content": r["prompt"]}],
                 "chosen": [{"role": "assistant", "content": r["chosen"]}],
                 "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in read_jsonl(data)]
        args = trl.DPOConfig(per_device_train_batch_size=point["batch"], max_length=point["max_len"], beta=0.1,
                             **common)
        trainer = trl.DPOTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows),
                                 processing_class=tok, callbacks=[Clock()])
    elif work == "grpo":
        from rlhforge.data.builtin import check_answer, generate_builtin

        n = point["prompts"] * point["samples"]
        records = generate_builtin("arithmetic", "train", n=max(2000, point["prompts"] * (steps + 1)), seed=0, max=14)
        ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                                         for r in records])

        def reward(completions, answer, **kwargs):
            return [check_answer("arithmetic", c[0]["content"], a) for c, a in zip(completions, answer)]

        args = trl.GRPOConfig(per_device_train_batch_size=n, gradient_accumulation_steps=1, generation_batch_size=n,
                              num_generations=point["samples"], max_completion_length=point["new_tokens"],
                              num_iterations=1, beta=0.0, temperature=1.0, use_vllm=False, **common)
        trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds,
                                  processing_class=tok, callbacks=[Clock()])
    else:
        raise ValueError(f"unknown work {work!r}")
    trainer.train()
    if work == "grpo":
        lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
        extra["mean_response_length"] = sum(lengths) / max(len(lengths), 1)
    return {"step_end_times": marks, "version": trl.__version__, "peak_rss_gb": peak_rss_gb(), **extra}


def peer_versions(python: str) -> dict:
    """``{"python": path, "python_version", "torch", "transformers", "trl"}`` of the interpreter ``python``
    (a package it lacks: None), asked in a child process so that its own environment answers."""
    probe = ("import json, sys\nout = {'python_version': sys.version.split()[0]}\n"
             "for name in ('torch', 'transformers', 'trl'):\n"
             "    try:\n        out[name] = __import__(name).__version__\n"
             "    except ImportError:\n        out[name] = None\nprint(json.dumps(out))")
    try:
        res = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300, check=True,
                             env={**os.environ, "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"})
        found = json.loads(res.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        raise ValueError(f"--trl-python {python}: cannot ask it for its versions ({e})") from e
    return {"python": python, **found}


# ------------------------------------------------------------------------------------------ rlhforge side
def rlhforge_command(side: str, work: str, model_dir: str, data: str | None, point: dict, steps: int,
                     out_dir: str, precision: str = "fp32") -> list[str]:
    out = ["--ckpt.output_dir", out_dir, "--ckpt.path", f"{out_dir}/ckpt", "--ds.param_dtype", precision]
    if work == "sft":
        return [sys.executable, "-m", "rlhforge.cli.train_sft", "--model.model_name_or_path", model_dir,
                "--data.dataset", data, "--data.input_key", "prompt", "--data.output_key", "completion",
                "--data.apply_chat_template", "--data.max_len", str(point["max_len"]),
                "--train.batch_size", str(point["batch"]), "--train.micro_batch_size", str(point["batch"]),
                "--train.max_steps", str(steps), "--train.max_epochs", "1", "--adam.lr", str(LR),
                "--ds.packing_samples", *out]
    if work == "dpo":
        return [sys.executable, "-m", "rlhforge.cli.train_dpo", "--model.model_name_or_path", model_dir,
                "--data.dataset", data, "--data.prompt_key", "prompt", "--data.apply_chat_template",
                "--data.max_len", str(point["max_len"]), "--train.batch_size", str(point["batch"]),
                "--train.micro_batch_size", str(point["batch"]), "--train.max_steps", str(steps),
                "--train.max_epochs", "1", "--adam.lr", str(LR), "--model.beta", "0.1", "--ds.packing_samples", *out]
    n = point["prompts"] * point["samples"]
    cmd = [sys.executable, "-m", "rlhforge.cli.train_ppo_ray", "--actor.model_name_or_path", model_dir,
           "--reward.remote_url", "builtin:arithmetic", "--data.prompt_dataset", "builtin:arithmetic?n=2000&max=14",
           "--data.input_key", "prompt", "--data.label_key", "answer", "--data.apply_chat_template",
           "--data.max_len", str(point["new_tokens"] + 128), "--rollout.batch_size", str(point["prompts"]),
           "--rollout.n_samples_per_prompt", str(point["samples"]), "--rollout.max_new_tokens",
           str(point["new_tokens"]), "--rollout.temperature", "1.0", "--rollout.micro_batch_size", str(n),
           "--train.batch_size", str(n), "--train.micro_batch_size", str(n), "--train.max_steps", str(steps),
           "--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0", "--actor.adam.lr", str(LR),
           "--logger.progress_bar", "off", *out]
    if side in ("rlhforge_packed", "rlhforge_vllm_packed"):
        cmd.append("--ds.packing_samples")
    if side in ("rlhforge_vllm", "rlhforge_vllm_packed"):
        cmd += ["--vllm.num_engines", "1"]
    return cmd


def rlhforge_result(out_dir: str, work: str) -> dict:
    records = [json.loads(x) for x in (Path(out_dir) / "metrics.jsonl").read_text().splitlines() if x.strip()]
    records = [r for r in records if "time" in r and not any(k.startswith("eval/") for k in r)]
    extra = {}
    if work == "grpo":
        lengths = [r["rollout/response_length"] for r in records if "rollout/response_length" in r]
        extra["mean_response_length"] = sum(lengths) / max(len(lengths), 1)
        extra["phases_per_step"] = step_phases(records)  # bench_phases.py: the step's split
    return {"step_end_times": [r["time"] for r in records], **extra}


# ------------------------------------------------------------------------------------------ one run
def run_side(side: str, work: str, model_dir: str, data: str | None, point: dict, steps: int, tmp: Path,
             threads: int, timeout: float, trl_checkpointing: bool = False, precision: str = "fp32",
             trl_python: str | None = None) -> dict:
    """One side in its own process: step-end times, time to first step, peak RSS of that process. The TRL
    side runs under ``trl_python`` (its own environment; None: this interpreter)."""
    run_dir = Path(tempfile.mkdtemp(dir=tmp, prefix=f"{side}_{work}_"))
    env = {**os.environ, "TQDM_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": str(threads), "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if side.startswith("rlhforge"):
        cmd = rlhforge_command(side, work, model_dir, data, point, steps, str(run_dir), precision)
    else:
        python = trl_python if side == "trl" and trl_python else sys.executable
        cmd = [python, str(Path(__file__).resolve()), "--child", side, "--work", work, "--point",
               json.dumps(point), "--model", model_dir, "--steps", str(steps), "--threads", str(threads),
               "--result", str(run_dir / "result.json"), "--child-dir", str(run_dir), "--precision", precision]
        if trl_checkpointing and side == "trl":
            cmd.append("--trl-gradient-checkpointing")
        if data:
            cmd += ["--data", data]
    log = open(run_dir / "log.txt", "w")
    launched = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    status, usage, hwm = wait_with_peak(proc, deadline=launched + timeout)
    log.close()
    rc = os.waitstatus_to_exitcode(status)
    proc.returncode = rc
    if rc != 0:
        tail = (run_dir / "log.txt").read_text()[-1500:]
        return {"error": f"exit {rc}", "log_tail": tail}
    res = rlhforge_result(str(run_dir), work) if side.startswith("rlhforge") else json.loads(
        (run_dir / "result.json").read_text())
    marks = res.pop("step_end_times")
    res.pop("peak_rss_gb", None)  # the process's own figure; wait4 below is the same kind for every side
    return {**res, "step_end_times": marks, "time_to_first_step_s": marks[0] - launched if marks else None,
            "peak_rss_gb": hwm}



def summarise(runs: list[dict], warmup: int) -> dict:
    good = [r for r in runs if "error" not in r and len(r["step_end_times"]) > warmup]
    if not good:
        return {"error": runs[-1].get("error", "too few steps"), "log_tail": runs[-1].get("log_tail", "")}
    for r in good:
        m = r["step_end_times"]
        r["seconds_per_step"] = (m[-1] - m[warmup - 1]) / (len(m) - warmup)
    best = min(good, key=lambda r: r["seconds_per_step"])
    out = {k: v for k, v in best.items() if k not in ("step_end_times", "phases_per_step")}
    if best.get("phases_per_step"):  # entry i is the interval ending at step i + 2: skip the warm-up's
        out["phases_s"] = median_phases(best["phases_per_step"], warmup - 1)
    out["seconds_per_step_all_rounds"] = [r["seconds_per_step"] for r in good]
    out["time_to_first_step_s"] = min(r["time_to_first_step_s"] for r in good)
    out["peak_rss_gb"] = min(r["peak_rss_gb"] for r in good)
    return out


def print_table(results: dict) -> None:
    print(f"\n{'work':5} {'shape':18} {'side':16} {'s/step':>8} {'vs rlhforge':>11} {'first step s':>12} "
          f"{'peak RSS GB':>11}")
    for entry in results["points"]:
        ref = entry["sides"].get("rlhforge", {}).get("seconds_per_step")
        for side, r in entry["sides"].items():
            if "error" in r:
                print(f"{entry['work']:5} {label(entry['point']):18} {side:16} {'failed: ' + r['error']}")
                continue
            ratio = f"{r['seconds_per_step'] / ref:.2f}x" if ref else "-"
            print(f"{entry['work']:5} {label(entry['point']):18} {side:16} {r['seconds_per_step']:8.3f} {ratio:>11} "
                  f"{r['time_to_first_step_s']:12.1f} {r['peak_rss_gb']:11.2f}")
    print("(vs rlhforge: that side's s/step over rlhforge's; > 1 means rlhforge is faster)")


def plot(results: dict, path: Path) -> bool:
    works = [w for w in ("sft", "dpo", "grpo") if sum(e["work"] == w for e in results["points"]) > 1]
    if not works:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(works), figsize=(6 * len(works), 4.5), squeeze=False)
    for ax, work in zip(axes[0], works):
        entries = [e for e in results["points"] if e["work"] == work]
        sides = sorted({s for e in entries for s in e["sides"]})
        for side in sides:
            ys = [e["sides"].get(side, {}).get("seconds_per_step") for e in entries]
            ax.plot(range(len(entries)), [y if y is not None else float("nan") for y in ys], marker="o", label=side)
        ax.set_xticks(range(len(entries)), [label(e["point"]) for e in entries], rotation=45, ha="right", fontsize=8)
        ax.set_yscale("log")
        ax.set_title(work.upper())
        ax.set_ylabel("seconds per step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def child_main(args) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    point = json.loads(args.point)
    if args.child == "trl":
        res = run_trl(args.work[0], args.model, args.data, point, args.steps, args.child_dir,
                      gradient_checkpointing=args.trl_gradient_checkpointing, precision=args.precision)
    else:
        res = run_bare(args.work[0], args.model, args.data, point, args.steps, lr=LR, precision=args.precision)
    Path(args.result).write_text(json.dumps(res))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 timed steps after 1 warm-up, smallest shapes, 1 round")
    parser.add_argument("--sweep", action="store_true",
                        help="SFT/DPO over batch 8/64 x max_len 128/512/1024, GRPO over 4x4/16x8/32x8 x 8/64/256")
    parser.add_argument("--work", nargs="+", choices=("sft", "dpo", "grpo"), default=["sft", "dpo", "grpo"])
    parser.add_argument("--sides", nargs="+", default=None,
                        help="subset of trl rlhforge rlhforge_packed rlhforge_vllm rlhforge_vllm_packed bare (default: all that "
                        "apply)")
    parser.add_argument("--shape", help="one shape instead of the grid, as JSON: "
                        "'{\"batch\": 8, \"max_len\": 512}' (sft/dpo) or '{\"prompts\": 16, \"samples\": 8, "
                        "\"new_tokens\": 64}' (grpo); works it does not fit are skipped")
    parser.add_argument("--vllm", action="store_true", help="add rlhforge_vllm and rlhforge_vllm_packed (--vllm.num_engines 1) to GRPO")
    parser.add_argument("--preset", dest="model_preset", choices=tuple(MODELS), default="small",
                        help="the model shape (real-vocabulary presets: results go to vs_trl_<preset>.json)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 5; --quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps, not timed (default 3; --quick 1)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds; best kept (default 2; --quick 1)")
    parser.add_argument("--threads", type=int, default=1,
                        help="OMP/torch threads of every run (1 by default: steadier on a shared machine)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--out", default=None, help="results JSON (default benchmarks/results/vs_trl.json; "
                        "--sweep and --merge: vs_trl_sweep.json, plot vs_trl_scaling.png)")
    parser.add_argument("--merge", nargs="+", metavar="JSON",
                        help="combine the points of earlier runs (e.g. a sweep run one work at a time, or a rerun of "
                        "some sides: a later file's side replaces an earlier one's) into --out and plot them; runs "
                        "nothing")
    parser.add_argument("--trl-gradient-checkpointing", action="store_true",
                        help="run TRL with its own default (gradient checkpointing on: less memory, ~30%% more "
                        "compute); by default it is off, as rlhforge's and the bare loop's")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: every side trains under bf16 autocast with fp32 weights (TRL bf16=True, rlhforge "
                        "--ds.param_dtype bf16, the bare loop's forwards under torch.autocast); results default to "
                        "vs_trl_bf16.json / vs_trl_sweep_bf16.json")
    parser.add_argument("--trl-python", metavar="PATH", default=None,
                        help="the Python interpreter that runs the TRL side (e.g. a venv with TRL and its own "
                        "transformers: /work/trl-venv/bin/python); default: this interpreter. Its python/torch/"
                        "transformers/trl versions are recorded in the results' setup.trl_env")
    parser.add_argument("--child", choices=("trl", "bare"), help=argparse.SUPPRESS)
    for name in ("--point", "--model", "--data", "--result", "--child-dir"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args)
    if args.merge:
        return merge_main(args.merge, Path(args.out or HERE / "results" / "vs_trl_sweep.json"))
    steps = args.steps or (2 if args.quick else 5)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    rounds = args.rounds or (1 if args.quick else 2)
    if warmup < 1:
        parser.error("--warmup must be >= 1 (the step time is measured from the end of the last warm-up step)")
    grid = QUICK if args.quick else SWEEP if args.sweep else HEADLINE
    if args.shape:
        shape = json.loads(args.shape)
        grid = {w: [shape] for w, points in grid.items() if set(points[0]) == set(shape)}
        args.work = [w for w in args.work if w in grid]
    suffix = ("" if args.precision == "fp32" else f"_{args.precision}") + (
        "" if args.model_preset == "small" else f"_{args.model_preset}")
    out = Path(args.out or HERE / "results" / (("vs_trl_quick" if args.quick else "vs_trl_sweep" if args.sweep
                                                else "vs_trl") + suffix + ".json"))
    try:
        trl_env = peer_versions(args.trl_python or sys.executable)
    except ValueError as e:
        parser.error(str(e))  # exit 2, before anything runs
    trl_version = trl_env.get("trl")
    if trl_version is None:
        print(f"trl is not installed for {trl_env['python']} (pip install -e '.[bench]', or --trl-python PATH): "
              "running rlhforge and bare only")
    results = {"setup": {"model": MODELS[args.model_preset], "model_preset": args.model_preset, "device": "cpu",
                         "threads": args.threads, "cpus": os.cpu_count(), "steps_timed": steps, "warmup": warmup,
                         "rounds": rounds, "trl": trl_version, "trl_env": trl_env, "lr": LR, "quick": args.quick,
                         "trl_gradient_checkpointing": args.trl_gradient_checkpointing,
                         "precision": args.precision, "load_average_at_start": list(os.getloadavg())},
               "points": []}
    total = steps + warmup
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = str(build_model(tmp / "model", args.model_preset))
        hidden = json.loads((Path(model_dir) / "config.json").read_text())["hidden_size"]
        params, gflops = flop_params(model_dir), matmul_gflops(hidden, args.threads)
        results["setup"].update(flop_params=params, matmul_gflops=gflops)
        for work in args.work:
            sides = ["trl", "rlhforge"] + (["rlhforge_packed"] + (["rlhforge_vllm", "rlhforge_vllm_packed"] if args.vllm else [])
                                           if work == "grpo" else []) + ["bare"]
            sides = [s for s in sides if (args.sides is None or s in args.sides) and (s != "trl" or trl_version)]
            for point in grid[work]:
                data = None
                if work in ("sft", "dpo"):
                    data = str(tmp / f"{work}_{label(point).replace(' ', '_')}.jsonl")
                    (write_sft if work == "sft" else write_dpo)(Path(data), point["batch"] * total, point["max_len"])
                runs: dict[str, list[dict]] = {s: [] for s in sides}
                for r in range(rounds):
                    for side in sides if r % 2 == 0 else sides[::-1]:
                        print(f"[{work} {label(point)}] round {r + 1}/{rounds}: {side}", flush=True)
                        runs[side].append(run_side(side, work, model_dir, data, point, total, tmp, args.threads,
                                                   args.timeout, args.trl_gradient_checkpointing, args.precision,
                                                   args.trl_python))
                summary = {s: summarise(v, warmup) for s, v in runs.items()}
                for r in summary.values():  # the arithmetic floor of the rlhforge sides' GRPO step
                    if r.get("phases_s"):
                        r["flop_limit"] = flop_limit(r["phases_s"], params, gflops,
                                                     old_pass=r["phases_s"]["old_logprobs"] > 1e-3,
                                                     reference=r["phases_s"]["reference"] > 1e-3)
                results["points"].append({"work": work, "point": point, "sides": summary})
    try:
        results["setup"]["load_average_1min_at_end"] = os.getloadavg()[0]
    except OSError:  # pragma: no cover
        pass
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print_phases(results)
    png = plot_path(out)
    if plot(results, png):
        print(f"wrote {png}")
    print(f"wrote {out}")
    return 0


def plot_path(out: Path) -> Path:
    """``vs_trl_sweep[_bf16].json`` -> ``vs_trl[_bf16]_scaling.png``; any other ``X.json`` -> ``X_scaling.png``."""
    stem = "vs_trl" + out.stem[len("vs_trl_sweep"):] if out.stem.startswith("vs_trl_sweep") else out.stem
    return out.with_name(stem + "_scaling.png")


def merge_main(paths: list[str], out: Path) -> int:
    """One results file (and plot) from several runs' files, points in the sweep's order (work, then shape
    as in :data:`SWEEP`; shapes outside the grid after it, in the order first seen).

    The sides of one point (same work and shape) found in several files are combined, a later file's side
    replacing an earlier one's (so a rerun of some sides updates just those); every side records the file
    it came from (``from``), and ``setup.merged_from`` lists each file's setup (flattened when a file is
    itself a merge)."""
    setups: list[dict] = []
    points: dict[str, dict] = {}
    for path in paths:
        part = json.loads(Path(path).read_text())
        setup = part["setup"]
        own = setup["merged_from"] if "merged_from" in setup else [{"file": Path(path).name, **setup}]
        setups += own
        source = own[0]["file"] if len(own) == 1 else Path(path).name  # what a side without "from" came from
        for entry in part["points"]:
            key = json.dumps([entry["work"], entry["point"]], sort_keys=True)
            merged = points.setdefault(key, {"work": entry["work"], "point": entry["point"], "sides": {}})
            for side, r in entry["sides"].items():
                merged["sides"][side] = {**r, "from": r.get("from", source)}
    grid = [json.dumps([w, pt], sort_keys=True) for w in ("sft", "dpo", "grpo") for pt in SWEEP[w]]
    ordered = sorted(points, key=lambda k: grid.index(k) if k in grid else len(grid))  # (a stable sort)
    results = {"setup": {"merged_from": setups}, "points": [points[k] for k in ordered]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print_table(results)
    print_phases(results)
    png = plot_path(out)
    if plot(results, png):
        print(f"wrote {png}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
