"""check_rl.py's measurement helpers: timestamps, nvidia-smi memory sampling, the model's parameter count
from its safetensors header, and the per-phase summary of an RL run's metrics.jsonl (standard library only)."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import threading
import time
from pathlib import Path

def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def missing(v) -> bool:
    return v is None or str(v).startswith("MISSING")


def mean(xs):
    xs = [x for x in xs if isinstance(x, (int, float))]
    return sum(xs) / len(xs) if xs else None


# --------------------------------------------------------------------------------------------- GPU memory


class GpuMemSampler:
    """nvidia-smi's memory.used of GPU 0 every ``period`` s (whole device: the actor, ref and vLLM together)."""

    def __init__(self, period: float = 0.5):
        self.period, self.samples, self._stop = period, [], threading.Event()
        self.exe = shutil.which("nvidia-smi")
        self._thread = None

    def __enter__(self):
        if self.exe:
            self._thread = threading.Thread(target=self._loop, daemon=True)
            self._thread.start()
        return self

    def _loop(self):
        while not self._stop.is_set():
            try:
                r = subprocess.run([self.exe, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                                   capture_output=True, text=True, timeout=10)
                if r.returncode == 0 and r.stdout.strip():
                    self.samples.append((time.time(), float(r.stdout.strip().splitlines()[0])))
            except Exception:  # noqa: BLE001 - sampling is best effort; its absence is recorded
                pass
            self._stop.wait(self.period)

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=15)

    def summary(self, rows: list[dict]) -> dict:
        if not self.exe:
            return {"available": False, "why": "nvidia-smi not on PATH"}
        if not self.samples:
            return {"available": False, "why": "nvidia-smi gave no sample"}
        t0 = self.samples[0][0]
        out = {"available": True, "source": "nvidia-smi memory.used, GPU 0, every %.1f s" % self.period,
               "samples": len(self.samples), "peak_gb": round(max(m for _, m in self.samples) / 1024, 3)}
        # windows of each step from metrics.jsonl: the row is written at the end of the step; the step began
        # timing/step_total earlier and its generation took the first timing/generation seconds (approximate)
        gen, train = [], []
        for r in rows:
            end, total, g = r.get("time"), r.get("timing/step_total"), r.get("timing/generation")
            if not all(isinstance(x, (int, float)) for x in (end, total, g)):
                continue
            start = end - total
            gen += [m for t, m in self.samples if start <= t <= start + g]
            train += [m for t, m in self.samples if start + g < t <= end]
        out["peak_gb_generation_windows"] = round(max(gen) / 1024, 3) if gen else None
        out["peak_gb_training_windows"] = round(max(train) / 1024, 3) if train else None
        out["min_gb_training_windows"] = round(min(train) / 1024, 3) if train else None
        out["windows_note"] = ("per step, from metrics.jsonl times: generation = the first timing/generation s "
                               "of the step, training = the rest (experience, train, weight sync); approximate")
        step = max(1, len(self.samples) // 200)
        out["series_s_gb"] = [[round(t - t0, 1), round(m / 1024, 3)] for t, m in self.samples[::step]]
        return out


# --------------------------------------------------------------------------------------------- helpers


def safetensors_params(folder: Path) -> dict:
    """Parameter count and bytes of a saved model, read from the safetensors headers (stdlib only)."""
    sizes = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}
    numel, nbytes, dtypes, tensors = 0, 0, {}, 0
    for f in sorted(folder.glob("*.safetensors")):
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
            dtypes[meta["dtype"]] = dtypes.get(meta["dtype"], 0) + k
            tensors += 1
    return {"num_params": numel, "file_tensor_bytes": nbytes, "dtypes": dtypes, "tensors": tensors}


def read_metrics(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    if not p.exists():
        return []
    rows = []
    for line in p.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    return rows


PER_STEP_KEYS = ("step", "timing/generation", "timing/make_experience", "timing/ppo_train", "timing/broadcast",
                 "timing/step_total", "perf/tokens_per_s", "perf/peak_memory_gb", "rollout/samples",
                 "rollout/response_length", "rollout/reward_mean", "rollout/engine_restarts")


def summarize(rows: list[dict], sync_bytes: int | None) -> dict:
    steps = [r for r in rows if isinstance(r.get("timing/step_total"), (int, float))]
    if not steps:
        return {"steps": 0, "why": "metrics.jsonl has no step row"}
    per = []
    for r in steps:
        d = {k: r[k] for k in PER_STEP_KEYS if k in r}
        if isinstance(r.get("rollout/response_length"), (int, float)) and isinstance(r.get("rollout/samples"), (int, float)):
            d["generated_tokens"] = round(r["rollout/response_length"] * r["rollout/samples"])
        per.append(d)
    steady = per[1:] if len(per) > 1 else per

    def tot(key, rows_):
        return sum(r[key] for r in rows_ if isinstance(r.get(key), (int, float)))

    def block(rows_):
        sync = mean([r.get("timing/broadcast") for r in rows_])
        gen_s, toks = tot("timing/generation", rows_), tot("generated_tokens", rows_)
        return {
            "steps": [r["step"] for r in rows_],
            "weight_sync_s_mean": sync,
            "weight_sync_s_per_gb": (sync / (sync_bytes / 1e9)) if sync is not None and sync_bytes else None,
            "generation_s_mean": mean([r.get("timing/generation") for r in rows_]),
            "generated_tokens": toks,
            "generation_tokens_per_s": toks / gen_s if gen_s > 0 else None,
            "step_s_mean": mean([r.get("timing/step_total") for r in rows_]),
            "make_experience_s_mean": mean([r.get("timing/make_experience") for r in rows_]),
            "ppo_train_s_mean": mean([r.get("timing/ppo_train") for r in rows_]),
        }

    peaks = [r.get("perf/peak_memory_gb") for r in per if isinstance(r.get("perf/peak_memory_gb"), (int, float))]
    return {
        "steps": len(per), "per_step": per,
        "all_steps": block(per),
        "steady_steps": block(steady),
        "actor_peak_memory_gb": max(peaks) if peaks else None,
        "reward_varied": len({r.get("rollout/reward_mean") for r in per}) > 1 or None,
        "notes": ("weight sync = timing/broadcast (after each step; the sync before step 1 is not in the metrics); "
                  "GB = 1e9 bytes of the weights as sent (see sync_bytes_basis); generated "
                  "tokens = rollout/response_length x rollout/samples; tokens/s = generated tokens / timing/generation; "
                  "steady = steps after the first (the first includes warm-up); actor_peak_memory_gb = the actor "
                  "rank's torch peak (perf/peak_memory_gb); the whole device is in gpu_memory"),
    }
