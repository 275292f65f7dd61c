"""The GPU check's bookkeeping helpers (standard library only: the orchestrator imports them before any
torch is known to work): timestamps, atomic JSON writes, a model's parameter count from its safetensors
headers, the summary of an RL run's metrics.jsonl, and pytest's summary lines."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import time
from pathlib import Path


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def write_json(path: Path, data: dict) -> None:
    """Write ``data`` to ``path`` atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def mean(xs) -> float | None:
    xs = [x for x in xs if isinstance(x, (int, float))]
    return sum(xs) / len(xs) if xs else None


def safetensors_params(folder: Path) -> dict:
    """Parameter count and bytes of a saved model, read from the safetensors headers."""
    sizes = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}
    numel, nbytes, tensors = 0, 0, 0
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            k = 1
            for d in meta["shape"]:
                k *= d
            numel += k
            nbytes += k * sizes.get(meta["dtype"], 0)
            tensors += 1
    return {"num_params": numel, "file_tensor_bytes": nbytes, "tensors": tensors}


def read_metrics(run_dir: Path) -> list[dict]:
    p = Path(run_dir) / "metrics.jsonl"
    rows = []
    if p.exists():
        for line in p.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


PROBE_KEYS = ("sync/probe_logprob_diff", "sync/probe_logprob_diff_max", "sync/probe_policy_change")


def summarize_rl(rows: list[dict], phases: list[dict]) -> dict:
    """Per-step numbers of an RL run from its metrics.jsonl rows, with the per-phase CUDA peaks and times
    that the child measured around the trainer's methods (``phases``: one dict per call, in order).
    Steady = the steps after the first (the first includes warm-up: kernels, allocator, caches)."""
    steps = [r for r in rows if isinstance(r.get("timing/step_total"), (int, float))]
    per = []
    for r in steps:
        d = {k: r.get(k) for k in ("step", "timing/generation", "timing/make_experience", "timing/ppo_train",
                                   "timing/broadcast", "timing/step_total", "perf/peak_memory_gb",
                                   "rollout/response_length", "rollout/reward_mean")}
        d.update({k: r[k] for k in PROBE_KEYS if k in r})  # the post-sync effect check (issue 39)
        samples = r.get("rollout/samples") or r.get("rollout/num_samples")
        gen = r.get("timing/generation")
        if isinstance(r.get("rollout/response_length"), (int, float)) and isinstance(samples, (int, float)):
            d["generated_tokens"] = round(r["rollout/response_length"] * samples)
            if isinstance(gen, (int, float)) and gen > 0:
                d["generation_tokens_per_s"] = round(d["generated_tokens"] / gen, 1)
        per.append(d)
    steady = per[1:] if len(per) > 1 else per
    peaks: dict[str, float] = {}
    times: dict[str, list] = {}
    for ph in phases:
        name = ph.get("phase")
        if isinstance(ph.get("peak_gb"), (int, float)):
            peaks[name] = max(peaks.get(name, 0.0), ph["peak_gb"])
        times.setdefault(name, []).append(ph.get("s"))
    return {
        "steps": len(per),
        "per_step": per,
        "generation_tokens_per_s_steady": mean([r.get("generation_tokens_per_s") for r in steady]),
        "step_s_steady": mean([r.get("timing/step_total") for r in steady]),
        "step_s_first": per[0].get("timing/step_total") if per else None,
        "train_s_steady": mean([r.get("timing/ppo_train") for r in steady]),
        "weight_sync_s_steady": mean([r.get("timing/broadcast") for r in steady]),
        "sync_probe_logprob_diff_max": max((r["sync/probe_logprob_diff_max"] for r in per
                                            if isinstance(r.get("sync/probe_logprob_diff_max"), (int, float))),
                                           default=None),
        "peak_memory_gb_by_phase": {k: round(v, 3) for k, v in peaks.items()},
        "phase_s_mean": {k: round(mean(v) or 0.0, 3) for k, v in times.items()},
        "notes": ("tokens/s = rollout/response_length x samples / timing/generation; peak_memory_gb_by_phase = "
                  "torch.cuda.max_memory_allocated of the driver process, reset before each phase (generation = "
                  "RLTrainer.rollout, experience = make_experience, training = train, sync = sync_weights); "
                  "with the reset, the run's own perf/peak_memory_gb is the peak since the last phase began"),
    }


_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected|warnings?)")


def parse_pytest(output: str) -> dict:
    """Counts from pytest's last summary line, the SKIPPED/ERROR/FAILED lines of its -ra summary."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "deselected": 0}
    lines = output.splitlines()
    for line in reversed(lines):
        if re.search(r"\d+ (passed|failed|skipped|errors?|deselected)", line) and " in " in line:
            for n, kind in _PYTEST_COUNT.findall(line):
                key = "errors" if kind.startswith("error") else kind
                if key in counts:
                    counts[key] = int(n)
            break
    skipped = [ln.strip() for ln in lines if ln.startswith("SKIPPED")]
    failed = [ln.strip() for ln in lines if ln.startswith("FAILED")]
    errors = [ln.strip() for ln in lines if ln.startswith("ERROR")]
    return {**counts, "skip_reasons": skipped[:40], "failed_tests": failed[:40], "error_lines": errors[:40]}


def wheel_fits(name: str, python: str) -> bool:
    """A wheel's Python tag (``py3``, ``py312``, ``cp312``...) fits ``python``'s version."""
    try:
        out = subprocess.run([python, "-c", "import sys; print(*sys.version_info[:2], sep='')"], capture_output=True,
                             text=True, timeout=60).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return True
    tags = name[:-4].split("-")[-3].split(".")
    return any(t in ("py3", f"py{out}", f"cp{out}") for t in tags)


def generation_line(stages: dict) -> list[str]:
    """The HF engine's graphs decode loop (stage hf_decode) against its eager loop and TRL's generation."""
    d, t, g = ((stages.get(k) or {}).get("result") or {} for k in ("hf_decode", "trl", "grpo_torch"))
    graphs = (d.get("graphs") or {}).get("tokens_per_s_median")
    trl = (t.get("summary") or {}).get("generation_tokens_per_s_steady")
    if not graphs:
        return []
    vs = f" = {graphs / trl:.2f}x TRL's GRPO generation ({trl:.0f} tok/s)" if trl else ""
    ours = (g.get("summary") or {}).get("generation_tokens_per_s_steady")
    return [f"generation: HF engine graphs {graphs:.0f} tok/s{vs}; eager {d['eager']['tokens_per_s_median']:.0f} tok/s"
            + (f"; grpo_torch's rollouts (hf_decode auto) {ours:.0f} tok/s" if ours else "")]


#: issue 42's GPU baseline: the HF engine's generation tok/s in grpo_torch of the 2026-12-04 check (gpu_check.json)
HF_ENGINE_TOKS_20261204 = 2810


def vllm_line(stages: dict, gpu: bool) -> list[str]:
    """rlhforge's vLLM engine (stage vllm_engine) and its hybrid-engine GRPO step against TRL's with vLLM."""
    e, g, t = ((stages.get(k) or {}).get("result") or {} for k in ("vllm_engine", "grpo_vllm", "trl_vllm"))
    ours, trl = ((x.get("summary") or {}).get("step_s_steady") for x in (g, t))
    out = []
    if e.get("tokens_per_s_median") and gpu:  # (the 2810 was measured on a GPU: no CPU comparison)
        out.append(f"generation: rlhforge's vLLM engine {e['tokens_per_s_median']:.0f} tok/s at {e.get('rows')} rows x "
                   f"{e.get('new_tokens')} tokens ({e['tokens_per_s_median'] / HF_ENGINE_TOKS_20261204:.2f}x the HF "
                   f"engine's {HF_ENGINE_TOKS_20261204} tok/s of the 2026-12-04 check)")
    if ours and trl:
        out.append(f"step: rlhforge + vLLM (hybrid engine, Ray, ZeRO-3) {ours:.2f} s, TRL + vLLM (colocate) {trl:.2f} s: "
                   f"{trl / ours:.2f}x")
    return out


def headline(name: str, rec: dict) -> str:
    """One line per stage for the log and the JSON's ``summary``."""
    r = rec.get("result") or {}
    s = f"{name:<11} {rec.get('status', '?'):<9} {rec.get('wall_s', '-')!s:>6} s"
    try:
        if name == "env" and r:
            g = r.get("gpu", {})
            s += f"  torch {r['modules']['torch'].get('version')} cuda {g.get('torch_cuda')} {g.get('name', 'no GPU')}"
        elif name == "bug1" and r:
            s += f"  bug reproduced: {r.get('bug_reproduced')} ({(r.get('bug') or {}).get('error', 'no error')[:90]})"
            s += f"; strategies: {', '.join(k for k, v in (r.get('strategies') or {}).items() if v.get('ok'))}"
        elif name == "nccl_group" and r:
            s += f"  open {r.get('open_s')} s, send {r.get('send_s')} s"
        elif name == "ipc_sync" and r:
            g = r.get("greedy") or {}
            s += (f"  fingerprints equal: {r.get('fingerprints_equal')}, greedy {g.get('equal_prompts')}/"
                  f"{g.get('prompts')}, {r.get('s_per_gb')} s/GB ({(r.get('model') or {}).get('bytes', 0) / 1e9:.3f} GB)")
        elif name == "gpu_tests" and rec.get("counts"):
            c = rec["counts"]
            s += f"  {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped, {c['errors']} errors"
        elif name in ("hf_decode", "vllm_engine") and r.get("headline"):
            s += f"  {r['headline']}"
        elif name == "model" and rec.get("num_params"):
            s += f"  {rec['num_params'] / 1e6:.1f}M parameters"
        elif (name.startswith("grpo_") or name.startswith("trl")) and r.get("summary"):
            m = r["summary"]
            tps = m.get("generation_tokens_per_s_steady")
            s += (f"  {m.get('steps')} steps, gen {tps:.0f} tok/s" if tps else f"  {m.get('steps')} steps") + \
                 f", step {m.get('step_s_steady') or 0:.2f} s, peak GB {m.get('peak_memory_gb_by_phase')}"
            if r.get("weight_sync"):
                s += f", weights by {r['weight_sync']}"
            if m.get("sync_probe_logprob_diff_max") is not None:
                s += f", post-sync probe |engine - trainer| <= {m['sync_probe_logprob_diff_max']:.2g}"
    except Exception as err:  # noqa: BLE001 - a summary line must never break the check
        s += f"  (summary failed: {err})"
    if rec.get("why"):
        s += f"  ({rec['why'][:150]})"
    if rec.get("status") not in ("ok", "n/a", "dry-run"):
        errors = r.get("errors") or [ln for ln in (rec.get("output_tail") or "").splitlines() if ln.strip()][-1:]
        if errors:
            s += f"  error: {errors[0][:200]}"
    return s


def out_of_memory(rec: dict) -> bool:
    """A failed stage whose error or log tail says the device ran out of memory, or that rlhforge's start-up
    check refused the engines' memory (colocated engines that could not wake beside the models)."""
    if rec.get("status") not in ("failed", "timed_out"):
        return False
    text = (json.dumps((rec.get("result") or {}).get("errors") or []) + (rec.get("output_tail") or "")).lower()
    return any(s in text for s in ("out of memory", "outofmemoryerror", "cannot wake their kv cache"))
