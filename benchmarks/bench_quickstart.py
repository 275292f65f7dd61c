"""The quickstart over several seeds: ``rlhforge quickstart`` once per seed, one after another,
collected into ``benchmarks/results/quickstart.json`` (the numbers README.md and docs/rl.md quote).

    python benchmarks/bench_quickstart.py                       # seeds 0 1 2, default flags (~5 min on 2 cores)
    python benchmarks/bench_quickstart.py --seeds 0 -- --rl_steps 300     # extra flags go to the quickstart
    python benchmarks/bench_quickstart.py --results /tmp/qs.json -- --train_records 200 --eval_size 12 \\
        --sft_steps 3 --rl_steps 2                                         # a shrunk smoke run
    python benchmarks/bench_quickstart.py --vlm                 # the VLM quick start (--task shape_colour), seeds 0 1 2

Each seed runs ``python -m rlhforge quickstart --out RUNS/qsN --seed N [extra flags]`` in a fresh
process (``wall_seconds_process`` is that process's wall time, Python start-up included) and its
``summary.json`` provides the numbers: greedy accuracy and sampled pass@1 before training, after the
SFT warm start ("SFT only") and after GRPO ("SFT + GRPO"), the gain of RL alone, and the stage
timings. The results file also records the quickstart's defaults, the flags actually used, the
machine (CPU count, torch threads, platform, load average) and the command lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STAGES = (("untrained", "before"), ("sft_only", "after_sft"), ("sft_grpo", "after_rl"))


def quickstart_defaults(vlm: bool = False) -> dict:
    from rlhforge.cli.quickstart import QuickstartArgs
    from rlhforge.cli.quickstart_vlm import VLMQuickstartArgs

    fields = dataclasses.fields(VLMQuickstartArgs if vlm else QuickstartArgs)
    return {f.name: f.default for f in fields if f.name not in ("out", "seed")}


def run_seed(seed: int, runs_dir: Path, extra: list[str], prefix: str = "qs") -> dict:
    """One quickstart in its own process; its summary.json plus the process wall time."""
    out = runs_dir / f"{prefix}{seed}"
    cmd = [sys.executable, "-m", "rlhforge", "quickstart", "--out", str(out.resolve()), "--seed", str(seed), *extra]
    print(f"[bench_quickstart] seed {seed}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "TQDM_DISABLE": "1"})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"bench_quickstart: seed {seed}: the quickstart exited with status {proc.returncode}")
    summary = json.loads((out / "summary.json").read_text())
    return {"summary": summary, "wall": wall, "out": out}


def run_record(seed: int, res: dict) -> dict:
    s = res["summary"]
    greedy = {name: s[f"accuracy_{key}"] for name, key in STAGES}
    sampled = {name: s[f"pass1_sampled_{key}"] for name, key in STAGES}
    greedy["rl_gain"] = greedy["sft_grpo"] - greedy["sft_only"]
    sampled["rl_gain"] = sampled["sft_grpo"] - sampled["sft_only"]
    return {
        "run": str(res["out"]), "seed": seed, "greedy": greedy, "sampled_pass1": sampled,
        "seconds": {k: round(v, 1) for k, v in s["seconds"].items()},
        "load": dict(s.get("load_avg_1min") or {}),
        "wall_seconds_process": round(res["wall"], 2),
    }


def _stats(values: list[float], keys=("mean", "min", "max"), digits: int = 4) -> dict:
    out = {"mean": sum(values) / len(values), "min": min(values), "max": max(values)}
    return {k: round(out[k], digits) for k in keys}


def summarize(runs: list[dict]) -> dict:
    out = {}
    for group, prefix in (("greedy", "greedy"), ("sampled_pass1", "sampled_pass1")):
        for name in ("sft_only", "sft_grpo", "rl_gain"):
            out[f"{prefix}_{name}"] = _stats([r[group][name] for r in runs])
    out["total_seconds"] = _stats([r["seconds"]["total"] for r in runs], ("mean", "max"), 1)
    out["wall_seconds_process_max"] = max(r["wall_seconds_process"] for r in runs)
    out["sampled_pass1_rose_on_every_seed"] = all(r["sampled_pass1"]["rl_gain"] > 0 for r in runs)
    return out


def docs_quotes(results: dict) -> dict[str, list[str]]:
    """What README.md and docs/rl.md quote from a text quick-start results file, as they must read
    (``tests/docs/test_quoted_numbers.py`` checks that each page holds each line; ``--docs`` prints them
    after a rerun, to paste): docs/rl.md's per-seed table rows and the README's ranges."""
    runs, summ = results["runs"], results["summary"]

    def pair(group: dict, bold: bool) -> str:
        after = f"**{group['sft_grpo']:.3f}**" if bold else f"{group['sft_grpo']:.3f}"
        return f"{group['sft_only']:.3f} -> {after} (+{group['rl_gain']:.3f})"

    rows = [f"| {r['seed']} | {pair(r['greedy'], True)} | {pair(r['sampled_pass1'], True)} | "
            f"{r['seconds']['total']:.0f} s |" for r in runs]
    mean = {g: {k: summ[f"{g}_{k}"]["mean"] for k in ("sft_only", "sft_grpo", "rl_gain")}
            for g in ("greedy", "sampled_pass1")}
    rows.append(f"| mean | {pair(mean['greedy'], False)} | {pair(mean['sampled_pass1'], False)} | |")
    g0, g1, gain = summ["greedy_sft_only"], summ["greedy_sft_grpo"], summ["greedy_rl_gain"]
    seconds = [r["seconds"]["total"] for r in runs]
    readme = [f"from {g0['min']:.2f}-{g0['max']:.2f} (SFT only) to {g1['min']:.2f}-{g1['max']:.2f}",
              f"+{gain['min']:.2f} to +{gain['max']:.2f}",
              f"sampled pass@1 {summ['sampled_pass1_sft_only']['mean']:.2f} -> "
              f"{summ['sampled_pass1_sft_grpo']['mean']:.2f} on average",
              f"{min(seconds):.0f}-{max(seconds):.0f} s per seed"]
    rl = rows + [f"GRPO raises greedy accuracy by +{gain['min']:.2f} to +{gain['max']:.2f} on every seed, to "
                 f"{g1['min']:.2f}-{g1['max']:.2f}"]
    return {"README.md": readme, "docs/rl.md": rl}


def machine_info(threads: int) -> dict:
    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    from rlhforge.models.cpu_linear import ENV

    return {"cpu_count": os.cpu_count(), "cpus_usable": affinity, "torch_threads": threads,
            # the fp32 linear kernel every seed's run inherited (decided in main, rlhforge/models/cpu_linear.py)
            "cpu_linear": os.environ.get(ENV),
            "platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor() or None,
            "python": platform.python_version(), "torch": version("torch"), "transformers": version("transformers")}


def load_avg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds, run one after another")
    p.add_argument("--runs_dir", default="runs", help="where the quickstart runs go (RUNS_DIR/qsN per seed)")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "quickstart.json"),
                   help="results JSON to write")
    p.add_argument("--note", action="append", default=[], help="a note to store with the results (repeatable)")
    p.add_argument("--vlm", action="store_true", help="the VLM quick start (--task shape_colour; results "
                   "benchmarks/results/quickstart_vlm.json unless --results is given)")
    p.add_argument("--docs", action="store_true", help="run nothing: print what README.md and docs/rl.md must "
                   "quote from the results file (--results)")
    args, unknown = p.parse_known_args(argv)
    extra = unknown + extra
    if args.docs:
        for page, lines in docs_quotes(json.loads(Path(args.results).read_text())).items():
            print(f"{page}:", *lines, sep="\n  ")
        return 0
    prefix = "qs"
    if args.vlm:
        extra, prefix = ["--task", "shape_colour", *extra], "qsvlm"
        if args.results == p.get_default("results"):
            args.results = str(ROOT / "benchmarks" / "results" / "quickstart_vlm.json")
    for flag in ("--seed", "--out"):
        if any(a == flag or a.startswith(flag + "=") for a in extra):
            p.error(f"{flag} is set per seed by this script; use --seeds / --runs_dir")

    runs_dir = Path(args.runs_dir)
    load_start = load_avg()
    from rlhforge.models.cpu_linear import onednn_chosen

    onednn_chosen()  # the fp32 linear kernel, decided once here and inherited by every seed's run
    t0 = time.perf_counter()
    results = {seed: run_seed(seed, runs_dir, extra, prefix) for seed in args.seeds}
    elapsed = time.perf_counter() - t0
    runs = [run_record(seed, res) for seed, res in results.items()]
    first = results[args.seeds[0]]["summary"]
    used = {k: v for k, v in first["args"].items() if k not in ("out", "seed")}
    seeds = ", ".join(map(str, args.seeds))
    flags = (" " + " ".join(extra)) if extra else ""
    what = ("rlhforge quickstart --task shape_colour: tiny Qwen2-VL, SFT warm start on the questions without their "
            "images (answer format only), then GRPO with the images (RL trainer, HF engine), held-out accuracy "
            "SFT-only vs SFT+GRPO on the same test images" if args.vlm else
            "rlhforge quickstart: tiny Llama, SFT warm start on the answer format only (one of the question's two "
            "numbers at random), then GRPO (RL trainer), held-out accuracy SFT-only vs SFT+GRPO on the same eval set")
    report = {
        "what": what + (" (non-default flags)" if len(extra) > 2 * args.vlm else " with default flags"),
        "command": f"rlhforge quickstart --out {runs_dir}/{prefix}N --seed N{flags}  (N = {seeds}, one after another)",
        "bench_command": " ".join(["python benchmarks/bench_quickstart.py", *(["--vlm"] if args.vlm else []), "--seeds",
                                   *map(str, args.seeds),
                                   "--runs_dir", str(runs_dir),
                                   *(["--", *extra[2 * args.vlm:]] if extra[2 * args.vlm:] else [])]),
        "task": first["task"],
        "task_params": first["task_params"],
        "n_eval": first["n_eval"],
        "eval_samples_per_problem": first["eval_samples"],
        "defaults": quickstart_defaults(args.vlm),
        "flags": extra,
        "args": used,
        "machine": {**machine_info(used.get("threads", 1)), "load_avg_1min": {"start": load_start, "end": load_avg()}},
        "elapsed_seconds": round(elapsed, 1),
        "runs": runs,
        "summary": summarize(runs),
        "notes": [
            "Runs are sequential, each in a fresh process; wall_seconds_process includes Python start-up.",
            f"sampled_pass1 = mean over {first['eval_samples']} temperature-1 samples per held-out problem; "
            "greedy = temperature 0; rl_gain = SFT + GRPO minus SFT only (RL alone).",
            *args.note,
        ],
    }
    path = Path(args.results)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(path)
    s = report["summary"]
    print(f"[bench_quickstart] {len(runs)} seed(s) in {elapsed:.0f} s: greedy {s['greedy_sft_only']['mean']:.3f} -> "
          f"{s['greedy_sft_grpo']['mean']:.3f}, sampled pass@1 {s['sampled_pass1_sft_only']['mean']:.3f} -> "
          f"{s['sampled_pass1_sft_grpo']['mean']:.3f} (means); wrote {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
