"""Cost of the post-sync effect check (issue 39, point 2) per weight sync, on CPU, and the log-prob gaps it sees.

    python benchmarks/bench_sync_probe.py [--steps 3] [--no-vllm]

**What is measured.** Short GRPO runs of the tiny test model (``rlhforge.models.tiny``, the test suite's
``rl_args`` settings: 4 prompts x 2 samples, 6 new tokens, lr 1e-3, varied rewards so the weights move) through
the real trainer (``build_trainer`` + ``fit``, as ``rlhforge rl`` runs it), one per engine setting: the HF engine
(fp32), one in-process vLLM CPU engine (fp32), the same in bf16 (``--ds.param_dtype bf16``: vLLM's CPU bf16
kernels vs the trainer's bf16 torch forward), and the vLLM fp32 run with a 4x longer probe. Per step the
metrics the trainer logs: ``timing/sync_probe`` (the whole check after a sync: the engines' scoring, the
actor's log-prob pass over the same tokens, the comparison), ``timing/broadcast`` (the sync including the
probe), ``timing/step_total``, and the probe's ``sync/probe_logprob_diff`` (mean |engine - trainer| per
token), ``sync/probe_logprob_diff_max`` and ``sync/probe_policy_change`` (how far the actor's own probe
log-probs moved since the previous sync: what an engine holding the previous weights would show). The probe
is the run's first prompts cut at ``--train.sync_probe_tokens``; its token count is recorded.
Writes ``benchmarks/results/sync_probe_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_one(model: Path, work: Path, name: str, steps: int, *extra: str) -> dict:
    from rlhforge.cli.train_ppo_ray import build_trainer, parse_rl_args
    from tests.rl.helpers import metrics, rl_args, write_reward

    out = work / name
    args = rl_args(model, out, "--reward.remote_url", write_reward(work / "reward.py"), *extra, steps=steps)
    cfg = parse_rl_args(args)
    t0 = time.perf_counter()
    trainer = build_trainer(cfg)
    try:
        trainer.fit()
        probe = trainer._probe()[0]
    finally:
        trainer.logger.close()
        getattr(trainer.engine, "close", lambda: None)()
    wall = time.perf_counter() - t0
    rows = [r for r in metrics(out) if "timing/sync_probe" in r]
    keys = ("timing/sync_probe", "timing/broadcast", "timing/step_total", "sync/probe_logprob_diff",
            "sync/probe_logprob_diff_max", "sync/probe_policy_change")
    per_step = [{"step": r["step"], **{k: r[k] for k in keys if k in r}} for r in rows]
    probe_s = [r["timing/sync_probe"] for r in rows]
    return {
        "name": name, "args": list(extra), "steps": steps, "wall_s": wall,
        "probe_sequences": len(probe), "probe_tokens": sum(len(p) for p in probe),
        "scored_tokens": sum(len(p) - 1 for p in probe),
        "bound": trainer._probe_bound(),
        "probe_s_median": statistics.median(probe_s),
        "probe_share_of_step_median": statistics.median(r["timing/sync_probe"] / r["timing/step_total"] for r in rows),
        "diff_mean_max_over_steps": max(r["sync/probe_logprob_diff"] for r in rows),
        "diff_max_max_over_steps": max(r["sync/probe_logprob_diff_max"] for r in rows),
        "policy_change_min_over_steps": min(r["sync/probe_policy_change"] for r in rows),
        "per_step": per_step,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sync_probe_cpu.json"))
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # as the test suite (a shared 2-core machine)
    from rlhforge.models.tiny import build_tiny_model

    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build_tiny_model(work / "model", seed=0)
        runs.append(run_one(model, work, "hf_fp32", a.steps))
        if not a.no_vllm:
            runs.append(run_one(model, work, "vllm_fp32", a.steps, "--vllm.num_engines", "1"))
            runs.append(run_one(model, work, "vllm_fp32_probe512", a.steps, "--vllm.num_engines", "1",
                                "--train.sync_probe_tokens", "512"))
            runs.append(run_one(model, work, "vllm_bf16", a.steps, "--vllm.num_engines", "1",
                                "--ds.param_dtype", "bf16"))
    import vllm  # noqa: F401 - its version, for the record

    result = {
        "benchmark": "bench_sync_probe", "command": "python benchmarks/bench_sync_probe.py " + " ".join(sys.argv[1:]),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "torch_threads": 1, "torch": torch.__version__,
        "vllm": None if a.no_vllm else sys.modules["vllm"].__version__, "runs": runs,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    for r in runs:
        print(f"{r['name']:>20}: probe {r['probe_tokens']} tokens, {r['probe_s_median'] * 1e3:.1f} ms per sync "
              f"({100 * r['probe_share_of_step_median']:.1f}% of a step); diff mean <= {r['diff_mean_max_over_steps']:.2g}, "
              f"max <= {r['diff_max_max_over_steps']:.2g}; policy change >= {r['policy_change_min_over_steps']:.2g}; "
              f"bound {r['bound']:g}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
