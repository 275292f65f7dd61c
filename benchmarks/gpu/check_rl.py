#!/usr/bin/env python3
"""GPU check of issue #11: GRPO with one actor rank and one colocated vLLM engine actor, measured.

Run it through ``bash benchmarks/gpu/check_rl.sh`` (which picks the Python that holds CUDA torch);
see benchmarks/gpu/README.md. Sub-commands (the first three are what a person runs):

    check_rl.py [--steps 4] [--budget-s 450] [--out FILE]   the whole check (GPU)
    check_rl.py --dry-run                                     print every command, run none
    check_rl.py --cpu-smoke                                   the same pipeline, tiny model, CPU, HF engine
    check_rl.py phase --probe-out FILE -- RL_FLAGS...         (internal) one RL run + a greedy probe
    check_rl.py greedy --spec FILE --out FILE                 (internal) greedy-after-sync comparisons

The orchestrator uses the standard library only: every torch / vLLM / Ray import happens in a child
process (so a broken install is recorded, not fatal). The results JSON is rewritten after every
stage, so a crash or a timeout still leaves what was measured so far. Every number in it comes from
this run: metrics.jsonl of the RL runs, the children's own reports, nvidia-smi samples.

Exit status: 0 everything ran and every check passed; 1 an error (a failed stage or check);
2 partial: vLLM or Ray could not be installed/imported, only the HF-engine fallback ran.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()
DEFAULT_OUT = REPO / "benchmarks" / "results" / "gpu_rl.json"
SCHEMA = "rlhforge.gpu_check_rl/1"

# ~105M parameters: 12 layers x (attention 1.57M + MLP 7.08M) + 1024 x 768 tied embeddings; head_dim 64
SPEC_GPU = {"vocab_size": 1024, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
            "num_attention_heads": 12, "num_key_value_heads": 4}
SPEC_SMOKE: dict = {}  # rlhforge tiny-model's defaults (~0.4M parameters)

GREEDY_PROMPTS = 8  # the first prompts of the run's prompt set

# a deterministic, varied reward (by response length) so GRPO advantages are non-zero on a random model
# and the weights really change between syncs (otherwise "greedy after sync" would compare initial weights)
REWARD_PY = '''
def reward_func(queries, prompts, labels, **kwargs):
    rewards = [(len(r) % 3) / 2.0 for r in kwargs["responses"]]
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
'''

ENV_PROBE = r'''
import json, os, sys
out = {"python": sys.executable, "python_version": sys.version.split()[0]}
def ver(mod):
    try:
        m = __import__(mod)
        return getattr(m, "__version__", "unknown")
    except Exception as e:
        return "MISSING: " + (type(e).__name__ + ": " + str(e)).splitlines()[0][:300]
for mod in ("torch", "transformers", "tokenizers", "safetensors", "tyro", "yaml", "rich", "tqdm", "numpy",
            "peft", "accelerate", "datasets", "ray", "deepspeed", "vllm"):
    out[mod] = ver(mod)
try:
    import torch
    out["torch_cuda_build"] = torch.version.cuda
    out["cuda_available"] = bool(torch.cuda.is_available())
    if out["cuda_available"]:
        out["gpu_count"] = torch.cuda.device_count()
        out["gpu_name"] = torch.cuda.get_device_name(0)
        out["gpu_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 1e9, 2)
        out["gpu_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
except Exception as e:
    out["torch_error"] = str(e)[:300]
if not str(out.get("vllm", "")).startswith("MISSING"):
    try:
        import vllm._C  # noqa: F401 - the compiled kernels: fails on a CUDA / torch ABI mismatch
        out["vllm_compiled_ops"] = "ok"
    except Exception as e:
        out["vllm_compiled_ops"] = "FAILED: " + (type(e).__name__ + ": " + str(e)).splitlines()[0][:300]
print("ENV_PROBE_JSON=" + json.dumps(out))
'''

SITE_PROBE = ("import json, site, sysconfig; p = site.getsitepackages() + [sysconfig.get_paths()['purelib']]; "
              "print('SITE_JSON=' + json.dumps(list(dict.fromkeys(p))))")

CORE_MODULES = {"tyro": "tyro", "yaml": "pyyaml", "rich": "rich", "tqdm": "tqdm", "numpy": "numpy",
                "safetensors": "safetensors", "tokenizers": "tokenizers", "peft": "peft", "accelerate": "accelerate"}
OPTIONAL_MODULES = {"datasets": "datasets"}  # not needed by the builtin prompt set; installed when reachable


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


# --------------------------------------------------------------------------------------------- orchestrator


class Check:
    def __init__(self, a):
        self.a = a
        self.t0 = time.time()
        self.deadline = self.t0 + a.budget_s
        self.work = Path(a.work).resolve()
        self.out = Path(a.out).resolve()
        self.base_py = a.base_python or sys.executable
        self.py = self.base_py
        self.dry = a.dry_run
        self.mode = "dry-run" if a.dry_run else "cpu-smoke" if a.cpu_smoke else "gpu"
        self.errors: list[str] = []
        self.partial: list[str] = []
        self.res: dict = {
            "schema": SCHEMA, "mode": self.mode, "started_at": now(), "finished_at": None, "wall_s": None,
            "ok": None, "exit_code": None, "errors": self.errors, "partial": self.partial,
            "argv": sys.argv, "budget_s": a.budget_s, "work_dir": str(self.work),
            "host": {}, "install": {"steps": []}, "model": {}, "phases": {}, "greedy": {}, "commands": [],
        }

    # -- bookkeeping ----------------------------------------------------------------------------
    def left(self) -> float:
        return self.deadline - time.time()

    def log(self, msg: str) -> None:
        print(f"[check_rl {time.time() - self.t0:6.1f}s] {msg}", flush=True)

    def error(self, msg: str) -> None:
        self.errors.append(msg)
        print(f"[check_rl] ERROR: {msg}", file=sys.stderr, flush=True)

    def save(self) -> None:
        if self.dry:
            return
        self.res["wall_s"] = round(time.time() - self.t0, 2)
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.res, indent=2, default=str) + "\n")
        tmp.replace(self.out)

    def env(self) -> dict:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        if self.mode == "cpu-smoke":
            env.setdefault("CUDA_VISIBLE_DEVICES", "")
        return env

    def run(self, name: str, cmd: list[str], timeout: float, log_file: Path | None = None, quiet: bool = False) -> dict:
        """Run one command (its own process group, killed at ``timeout``); record it; return the record."""
        cmd = [str(c) for c in cmd]
        rec = {"name": name, "cmd": shlex.join(cmd), "rc": None, "wall_s": None, "timeout_s": round(timeout, 1)}
        self.res["commands"].append(rec)
        if self.dry:
            print(f"DRY-RUN [{name}] (timeout {timeout:.0f}s): {shlex.join(cmd)}", flush=True)
            rec["rc"] = "dry-run"
            return rec
        if timeout < 5:
            rec["rc"] = "skipped"
            rec["why"] = "no time left in the budget"
            self.error(f"{name}: skipped, {timeout:.0f} s left in the budget")
            return rec
        shown = shlex.join(cmd if "-c" not in cmd else cmd[: cmd.index("-c") + 1] + ["<inline probe>"])
        self.log(f"run [{name}] (timeout {timeout:.0f}s): {shown}")
        t = time.time()
        lines: list[str] = []
        lf = open(log_file, "w") if log_file else None
        try:
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                 env=self.env(), cwd=str(REPO), start_new_session=True)
        except OSError as err:
            rec["rc"], rec["wall_s"] = f"could not start: {err}", 0.0
            if lf:
                lf.close()
            return rec

        def reader():
            for line in p.stdout:
                lines.append(line)
                if len(lines) > 4000:
                    del lines[:1000]
                if lf:
                    lf.write(line)
                if not quiet:
                    sys.stdout.write(f"  | {line}")
                    sys.stdout.flush()

        th = threading.Thread(target=reader, daemon=True)
        th.start()
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rec["timed_out"] = True
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=15)
            except Exception:  # noqa: BLE001
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except Exception:  # noqa: BLE001
                    pass
            rc = p.wait()
        th.join(timeout=10)
        if lf:
            lf.close()
        rec["rc"], rec["wall_s"] = rc, round(time.time() - t, 2)
        rec["output"] = "".join(lines)
        if log_file:
            rec["log"] = str(log_file)
        return rec

    @staticmethod
    def tail(rec: dict, n: int = 25) -> str:
        return "".join(rec.get("output", "").splitlines(True)[-n:])

    def finish_record(self, rec: dict, keep_tail: int = 25) -> None:
        """Commands keep only the end of their output in the JSON."""
        out = rec.pop("output", None)
        if out is not None and (rec["rc"] != 0 or keep_tail):
            rec["output_tail"] = "".join(out.splitlines(True)[-(keep_tail or 40):])

    # -- stage 1: the environment ---------------------------------------------------------------
    def probe(self, py: str, name: str) -> dict:
        rec = self.run(name, [py, "-c", ENV_PROBE], timeout=min(180, max(self.left(), 5)), quiet=True)
        info = {}
        for line in rec.get("output", "").splitlines():
            if line.startswith("ENV_PROBE_JSON="):
                info = json.loads(line.split("=", 1)[1])
        self.finish_record(rec, keep_tail=0 if info else 40)
        return info

    def nvidia_smi(self) -> dict:
        exe = shutil.which("nvidia-smi")
        if not exe:
            return {"nvidia_smi": None}
        try:
            r = subprocess.run([exe, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30)
            out = {"nvidia_smi": r.stdout.strip() or r.stderr.strip()}
            r2 = subprocess.run([exe], capture_output=True, text=True, timeout=30)
            for line in r2.stdout.splitlines():
                if "CUDA Version" in line:
                    out["driver_cuda_version"] = line.split("CUDA Version:")[1].strip(" |")
            return out
        except Exception as err:  # noqa: BLE001
            return {"nvidia_smi": f"failed: {err}"}

    def index_reachable(self) -> dict:
        import urllib.request

        url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/") + "/pip/"
        t = time.time()
        try:
            with urllib.request.urlopen(url, timeout=8) as r:
                return {"url": url, "reachable": r.status == 200, "status": r.status, "s": round(time.time() - t, 2)}
        except Exception as err:  # noqa: BLE001
            return {"url": url, "reachable": False, "error": f"{type(err).__name__}: {err}"[:300]}

    def make_overlay_venv(self) -> str | None:
        """A venv over the found Python's packages (a .pth to its site-packages): installs go to the venv,
        the machine's torch stays as it is. Returns its python, or None (then installs go to the base)."""
        venv = self.work / "venv"
        vpy = venv / "bin" / "python"
        if self.dry:
            print(f"DRY-RUN [venv]: {self.base_py} -m venv {venv}  + a .pth naming the base site-packages", flush=True)
            return str(vpy)
        if not vpy.exists():
            rec = self.run("venv", [self.base_py, "-m", "venv", str(venv)], timeout=min(120, self.left()))
            self.finish_record(rec, keep_tail=0)
            if rec["rc"] != 0:
                return None
        rec = self.run("base-site", [self.base_py, "-c", SITE_PROBE], timeout=60, quiet=True)
        rec2 = self.run("venv-site", [str(vpy), "-c", SITE_PROBE], timeout=60, quiet=True)
        try:
            base = json.loads(rec["output"].split("SITE_JSON=", 1)[1].splitlines()[0])
            own = json.loads(rec2["output"].split("SITE_JSON=", 1)[1].splitlines()[0])
        except (IndexError, KeyError, json.JSONDecodeError):
            self.finish_record(rec)
            self.finish_record(rec2)
            return None
        self.finish_record(rec, keep_tail=0)
        self.finish_record(rec2, keep_tail=0)
        target = Path(own[-1])
        (target / "_rlhforge_check_base.pth").write_text("\n".join(p for p in base if p not in own) + "\n")
        return str(vpy)

    def pip(self, name: str, py: str, pkgs: list[str], src: dict, timeout: float, extra=()) -> dict:
        cmd = [py, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "--retries", "1",
               "--timeout", "20", "--prefer-binary", *extra]
        if src.get("wheels"):
            cmd += ["--find-links", src["wheels"]]
        if not src.get("index"):
            cmd += ["--no-index"]
        if src.get("constraints"):
            cmd += ["-c", src["constraints"]]
        rec = self.run(name, cmd + pkgs, timeout=timeout)
        self.finish_record(rec, keep_tail=8)
        step = {"name": name, "packages": pkgs, "rc": rec["rc"], "wall_s": rec["wall_s"],
                "ok": rec["rc"] == 0 or rec["rc"] == "dry-run"}
        if not step["ok"]:
            step["output_tail"] = rec.get("output_tail", "")
        self.res["install"]["steps"].append(step)
        return step

    def setup(self) -> dict:
        """Find / make the environment; install what the RL path needs (GPU mode). Returns the probe."""
        inst = self.res["install"]
        self.res["host"].update(self.nvidia_smi())
        base = self.probe(self.base_py, "probe-base") if not self.dry else self.dry_versions()
        self.res["host"]["base_python"] = self.base_py
        self.res["host"]["base_env"] = base
        if self.mode == "cpu-smoke" or self.a.no_install:
            inst["skipped"] = "cpu-smoke: uses the found Python as it is" if self.mode == "cpu-smoke" else "--no-install"
            self.res["host"]["env"] = base
            return base
        vpy = self.make_overlay_venv()
        if vpy is None:
            inst["venv"] = "could not create the overlay venv: installing into the base environment"
            vpy = self.base_py
        else:
            inst["venv"] = vpy
        self.py = vpy
        wheels = self.a.wheels or (str(REPO / ".whl") if (REPO / ".whl").is_dir() else None)
        reach = {"reachable": None, "why": "dry-run"} if self.dry else self.index_reachable()
        inst["index"] = reach
        inst["wheel_dir"] = wheels
        src = {"index": bool(reach.get("reachable")) or self.dry, "wheels": wheels}
        cons = self.work / "constraints.txt"
        pins = []
        torch_v = base.get("torch")
        if not missing(torch_v):
            pins.append(f"torch=={torch_v}")
        pins.append("transformers<5.20")  # the project's pin (pyproject.toml)
        pinned = self.pinned_versions(["torchvision", "torchaudio", "triton"])
        pins += [f"{k}=={v}" for k, v in pinned.items()]
        inst["constraints"] = pins
        if not self.dry:
            cons.write_text("\n".join(pins) + "\n")
        else:
            print(f"DRY-RUN [constraints] {cons}: {pins} (+ the installed torchvision/torchaudio/triton versions)")
        src["constraints"] = str(cons)
        if not (src["index"] or wheels):
            inst["note"] = ("the package index is unreachable and no wheel folder was given (--wheels DIR or "
                            "REPO/.whl): nothing can be installed; running with what the machine has")
            self.log(inst["note"])
        # the project itself (no deps: they are handled below); PYTHONPATH=REPO covers a failure here
        self.pip("rlhforge-editable", vpy, ["-e", str(REPO)], {"index": False, "wheels": None}, min(120, self.left()),
                 extra=("--no-deps", "--no-build-isolation"))
        env = self.probe(vpy, "probe-venv") if not self.dry else base
        can = src["index"] or wheels
        need = [pkg for mod, pkg in CORE_MODULES.items() if missing(env.get(mod))]
        if need and can:
            self.pip("core-deps", vpy, need, src, min(150, self.left() - 200))
        want_opt = [pkg for mod, pkg in OPTIONAL_MODULES.items() if missing(env.get(mod))]
        if want_opt and can:
            self.pip("optional-deps", vpy, want_opt, src, min(90, self.left() - 200))
        if (missing(env.get("ray")) or self.dry) and can:
            self.pip("ray", vpy, ["ray>=2.40"], src, min(150, self.left() - 200))
        if (missing(env.get("vllm")) or self.dry) and can and not self.a.no_vllm:
            spec = os.environ.get("CHECK_RL_VLLM_SPEC", "vllm")
            # the constraints keep the machine's torch: pip picks the newest vllm wheel whose torch pin matches it
            self.pip("vllm", vpy, [spec], src, min(self.a.vllm_install_s, self.left() - 200),
                     extra=("--only-binary", "vllm"))
        env = self.probe(vpy, "probe-after-install") if not self.dry else base
        if not self.dry and not missing(torch_v) and env.get("torch") != torch_v:
            self.error(f"the install changed torch: {torch_v} -> {env.get('torch')} (constraints: {pins})")
        self.res["host"]["env"] = env
        return env

    @staticmethod
    def dry_versions() -> dict:
        import importlib.metadata as md

        import importlib.util

        out = {}
        for mod in ("torch", "vllm", "ray", "deepspeed", *CORE_MODULES, *OPTIONAL_MODULES):
            try:
                out[mod] = md.version(mod) if mod in ("torch", "vllm", "ray") else (
                    "found" if importlib.util.find_spec(mod) else "MISSING")
            except (md.PackageNotFoundError, ValueError):
                out[mod] = "MISSING"
        return out

    def pinned_versions(self, names: list[str]) -> dict:
        if self.dry:
            return {}
        code = ("import json, importlib.metadata as m\nout = {}\nfor n in %r:\n    try: out[n] = m.version(n)\n"
                "    except Exception: pass\nprint('PINS_JSON=' + json.dumps(out))" % (names,))
        rec = self.run("probe-pins", [self.base_py, "-c", code], timeout=60, quiet=True)
        try:
            pins = json.loads(rec["output"].split("PINS_JSON=", 1)[1].splitlines()[0])
        except (IndexError, KeyError, json.JSONDecodeError):
            pins = {}
        self.finish_record(rec, keep_tail=0)
        return pins

    # -- stage 2: the model ---------------------------------------------------------------------
    def build_model(self) -> Path | None:
        spec = SPEC_SMOKE if self.mode == "cpu-smoke" else SPEC_GPU
        model = self.work / "model"
        if model.exists() and not self.dry:
            shutil.rmtree(model)
        cmd = [self.py, "-m", "rlhforge.cli.main", "tiny-model", "--out", model, "--seed", "0"]
        for k, v in spec.items():
            cmd += [f"--spec.{k}", v]
        rec = self.run("tiny-model", cmd, timeout=min(240, self.left()))
        self.finish_record(rec, keep_tail=5)
        m = self.res["model"]
        m.update({"path": str(model), "spec": spec, "cmd": rec["cmd"], "rc": rec["rc"], "wall_s": rec["wall_s"]})
        if self.dry:
            return model
        if rec["rc"] != 0:
            self.error("building the model failed (rlhforge tiny-model): " + self.tail(rec, 5).strip()[-500:])
            m["output_tail"] = rec.get("output_tail")
            return None
        m.update(safetensors_params(model))
        try:
            cfg = json.loads((model / "config.json").read_text())
            m["config"] = {k: cfg.get(k) for k in ("architectures", "vocab_size", "hidden_size", "intermediate_size",
                                                   "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                                   "tie_word_embeddings")}
        except (OSError, json.JSONDecodeError):
            pass
        self.log(f"model: {m.get('num_params', 0) / 1e6:.1f}M parameters at {model}")
        return model

    # -- stage 3: the RL runs -------------------------------------------------------------------
    def rl_flags(self, model: Path, run: Path, extra: list[str]) -> list[str]:
        smoke = self.mode == "cpu-smoke"
        reward = self.work / "reward.py"
        if not self.dry:
            reward.write_text(REWARD_PY)
        sizes = (["--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "2", "--rollout.max_new_tokens", "8",
                  "--rollout.micro_batch_size", "8", "--train.batch_size", "8", "--train.micro_batch_size", "4",
                  "--data.max_len", "128", "--actor.adam.lr", "1e-3"] if smoke else
                 ["--rollout.batch_size", "32", "--rollout.n_samples_per_prompt", "8", "--rollout.max_new_tokens", "128",
                  "--rollout.micro_batch_size", "64", "--train.batch_size", "128", "--train.micro_batch_size", "32",
                  "--data.max_len", "512", "--actor.adam.lr", "1e-4"])
        return [
            "--actor.model_name_or_path", str(model),
            "--data.prompt_dataset", "builtin:arithmetic?n=1024&max=99", "--data.input_key", "prompt",
            "--data.label_key", "answer", "--data.apply_chat_template",
            "--reward.remote_url", str(reward),
            *sizes,
            "--algo.advantage.estimator", "group_norm", "--actor.lr_warmup_ratio", "0",
            "--train.max_steps", str(self.a.steps), "--train.seed", "3",
            "--ckpt.output_dir", str(run), "--ckpt.path", str(run / "ckpts"), "--ckpt.disable_ds",
            "--logger.progress_bar", "off",
            *extra,
        ]

    def phases(self, env: dict) -> list[tuple[str, list[str], str]]:
        """(name, extra flags, engine kind) of the runs this machine can do, in order."""
        if self.mode == "cpu-smoke":
            return [("hf_engine", ["--train.workers", "local", "--ds.param_dtype", "fp32"], "hf")]
        eager = ["--vllm.enforce_eager"] if self.a.eager else []
        vllm = ["--train.workers", "ray", "--train.colocate_all", "--vllm.num_engines", "1", "--vllm.enable_sleep",
                "--ds.enable_sleep", "--vllm.sync_backend", "nccl", "--ds.param_dtype", "bf16",
                "--vllm.gpu_memory_utilization", str(self.a.gpu_memory_utilization), *eager]
        ds = [] if not missing(env.get("deepspeed")) else ["--ds.strategy", "torch"]
        has_vllm = self.dry or (not missing(env.get("vllm")) and env.get("vllm_compiled_ops", "ok") == "ok")
        has_ray = self.dry or not missing(env.get("ray"))
        out = []
        if has_vllm and has_ray:
            out += [("vllm_nccl", vllm + ds, "vllm"), ("vllm_sync_with_ray", vllm + ds + ["--vllm.sync_with_ray"], "vllm")]
        else:
            why = []
            if not has_ray:
                why.append(f"ray: {env.get('ray')}")
            if not has_vllm:
                why.append(f"vllm: {env.get('vllm')} {env.get('vllm_compiled_ops', '')}".strip())
            msg = "the vLLM engine-actor runs cannot run (" + "; ".join(why) + "): only the HF-engine fallback runs"
            self.partial.append(msg)
            print(f"[check_rl] WARNING: {msg}", file=sys.stderr, flush=True)
        hf_workers = ["--train.workers", "ray", "--train.colocate_all"] if has_ray else ["--train.workers", "local"]
        out.append(("hf_engine", hf_workers + ["--ds.enable_sleep", "--ds.param_dtype", "bf16",
                                               "--rollout.generate_batch_size", "512"] + ds, "hf"))
        return out

    def run_phase(self, name: str, model: Path, extra: list[str], kind: str, optional: bool, share: float) -> dict:
        run = self.work / "runs" / name
        if run.exists() and not self.dry:
            shutil.rmtree(run)
        if not self.dry:
            run.mkdir(parents=True)
        flags = self.rl_flags(model, run, extra)
        probe = run / "greedy_probe.json"
        cmd = [self.py, THIS, "phase", "--probe-out", probe, "--max-new", self.a.greedy_tokens, "--", *flags]
        ph = {"status": None, "engine": kind, "rl_flags": flags,
              "equivalent_cli": shlex.join(["python", "-m", "rlhforge.cli.train_ppo_ray", *flags]),
              "driver": ("check_rl.py phase: parse_rl_args + build_trainer + fit as rlhforge.cli.train_ppo_ray.run, "
                         "then one extra sync with fingerprints and a greedy probe of the engine, then the same "
                         "clean-up as run()"),
              "run_dir": str(run)}
        self.res["phases"][name] = ph
        timeout = min(self.a.phase_s, share, self.left())
        if optional and timeout < 90 and not self.dry:
            ph["status"] = "skipped"
            ph["why"] = f"{self.left():.0f} s left in the budget"
            self.log(f"phase {name}: skipped ({ph['why']})")
            return ph
        sampler = GpuMemSampler() if self.mode == "gpu" else None
        if sampler:
            with sampler:
                rec = self.run(f"phase:{name}", cmd, timeout=timeout, log_file=self.work / f"{name}.log")
        else:
            rec = self.run(f"phase:{name}", cmd, timeout=timeout, log_file=None if self.dry else self.work / f"{name}.log")
        ph.update(cmd=rec["cmd"], rc=rec["rc"], wall_s=rec["wall_s"], timed_out=rec.get("timed_out", False))
        if self.dry:
            return ph
        ph["run_line"] = next((ln for ln in rec.get("output", "").splitlines() if ln.startswith("[rlhforge] rl:")), None)
        rows = read_metrics(run)
        if probe.exists():
            ph["probe"] = json.loads(probe.read_text())
        sent = (ph.get("probe") or {}).get("sent_weights") or {}
        if sent.get("bytes"):
            sync_bytes, basis = sent["bytes"], "measured: bytes of actor rank 0's engine_state_dict (probe.sent_weights)"
        else:
            sync_bytes, basis = self.sync_bytes(flags), "estimated: parameters x bytes of --ds.param_dtype (no probe)"
        ph["sync_bytes"], ph["sync_bytes_basis"] = sync_bytes, basis
        ph["metrics"] = summarize(rows, sync_bytes)
        if sampler:
            ph["gpu_memory"] = sampler.summary(rows)
        ph["status"] = "ok" if rec["rc"] == 0 else "failed"
        if rec["rc"] != 0:
            ph["output_tail"] = self.tail(rec, 40)
            self.error(f"phase {name} exited {rec['rc']}{' (timed out)' if rec.get('timed_out') else ''}; "
                       f"log: {rec.get('log')}")
        elif ph["metrics"].get("steps", 0) < self.a.steps:
            self.error(f"phase {name}: metrics.jsonl has {ph['metrics'].get('steps')} step rows, expected {self.a.steps}")
        fp = (ph.get("probe") or {}).get("fingerprints") or {}
        if fp.get("engines") and fp.get("actor") and not fp.get("equal"):
            self.error(f"phase {name}: the engine's weight fingerprint differs from the actor's after a sync")
        if rec["rc"] == 0 and fp.get("training_changed_weights") is False:
            self.error(f"phase {name}: the actor's weights did not change in training: the greedy-after-sync "
                       "comparison cannot tell a synced engine from a stale one")
        self.finish_record(rec, keep_tail=0)
        return ph

    def sync_bytes(self, flags: list[str]) -> int | None:
        n = self.res["model"].get("num_params")
        if not n:
            return None
        dtype = flags[flags.index("--ds.param_dtype") + 1] if "--ds.param_dtype" in flags else "fp32"
        return n * {"bf16": 2, "fp16": 2, "fp32": 4}.get(dtype, 4)

    # -- stage 4: greedy after sync -------------------------------------------------------------
    def greedy(self) -> None:
        items = []
        for name, ph in self.res["phases"].items():
            probe = ph.get("probe") if not self.dry else {"tokens": []}
            if probe is None or "tokens" not in probe:
                continue
            flags = ph["rl_flags"]
            dtype = flags[flags.index("--ds.param_dtype") + 1] if "--ds.param_dtype" in flags else "fp32"
            items.append({"phase": name, "engine": ph["engine"], "export": ph["run_dir"],
                          "initial": self.res["model"].get("path"),
                          "probe": str(Path(ph["run_dir"]) / "greedy_probe.json"),
                          "dtype": {"bf16": "bfloat16", "fp16": "float16"}.get(dtype, "float32")})
        g = self.res["greedy"]
        if not items:
            g["status"] = "skipped"
            g["why"] = "no run left a greedy probe"
            self.error("greedy-after-sync: no run left a greedy probe to compare")
            return
        spec = self.work / "greedy_spec.json"
        out = self.work / "greedy_result.json"
        timeout = min(self.a.greedy_s, self.left())
        if not self.dry:
            spec.write_text(json.dumps({"items": items, "deadline": time.time() + timeout - 15,
                                        "eager": self.a.eager, "device": "cpu" if self.mode == "cpu-smoke" else "cuda"}))
            if out.exists():
                out.unlink()
        rec = self.run("greedy", [self.py, THIS, "greedy", "--spec", spec, "--out", out], timeout=timeout,
                       log_file=None if self.dry else self.work / "greedy.log")
        g.update(cmd=rec["cmd"], rc=rec["rc"], wall_s=rec["wall_s"])
        if self.dry:
            return
        if out.exists():
            g.update(json.loads(out.read_text()))
        if rec["rc"] != 0:
            g["output_tail"] = self.tail(rec, 40)
            self.error(f"greedy check exited {rec['rc']}")
        for c in g.get("comparisons", []):
            if c.get("must_equal") and c.get("equal") != c.get("of"):
                self.error(f"greedy-after-sync: {c['a']} vs {c['b']}: {c.get('equal')}/{c.get('of')} prompts equal")
        self.finish_record(rec, keep_tail=0)

    # -- all ------------------------------------------------------------------------------------
    def main(self) -> int:
        try:
            self.work.mkdir(parents=True, exist_ok=True)
            self.log(f"mode {self.mode}; budget {self.a.budget_s:.0f} s; work dir {self.work}; results {self.out}")
            env = self.setup()
            self.save()
            if self.mode == "gpu" and not self.dry and not env.get("cuda_available"):
                self.error(f"no CUDA device visible to {self.py} (torch {env.get('torch')}): this is the GPU check; "
                           "use --cpu-smoke on a CPU machine")
                return self.finalize()
            if not self.dry and missing(env.get("tyro")):
                self.error(f"tyro does not import ({env.get('tyro')}): rlhforge's CLI cannot parse its flags")
            model = self.build_model()
            self.save()
            if model is None:
                return self.finalize()
            plan = self.phases(env)
            required = [name for name, _, _ in plan if not (name == "hf_engine" and len(plan) > 1)]
            for name, extra, kind in plan:
                optional = name not in required
                # each required run gets an equal share of what is left after the greedy check's reserve
                todo = max(1, len(required) - sum(1 for r in required if r in self.res["phases"]))
                share = (self.left() - self.a.greedy_s / 2) / todo if not optional else self.left()
                self.run_phase(name, model, extra, kind, optional, share)
                self.save()
            self.greedy()
        except Exception:  # noqa: BLE001 - the JSON must still be written
            self.error("check_rl.py crashed: " + traceback.format_exc()[-1500:])
        return self.finalize()

    def finalize(self) -> int:
        self.res["finished_at"] = now()
        code = 1 if self.errors else 2 if self.partial else 0
        self.res["ok"] = code == 0
        self.res["exit_code"] = code
        self.save()
        if self.dry:
            print("DRY-RUN: nothing was run; results would go to", self.out)
            return 0
        verdict = {0: "OK", 1: "FAILED", 2: "PARTIAL (the vLLM part did not run)"}[code]
        print(f"[check_rl] {verdict} in {time.time() - self.t0:.0f} s; results: {self.out}", flush=True)
        for e in self.errors:
            print(f"[check_rl]   error: {e.splitlines()[0][:300]}", file=sys.stderr)
        for p in self.partial:
            print(f"[check_rl]   partial: {p[:300]}", file=sys.stderr)
        return code


# --------------------------------------------------------------------------------------------- phase (child)


def cmd_phase(a, rl_argv: list[str]) -> int:
    from rlhforge.cli.env import setup_cli_environment

    setup_cli_environment()
    from rlhforge.cli.train_ppo_ray import build_trainer, parse_rl_args
    from rlhforge.distributed.groups import InProcessGroup
    from rlhforge.rollout.engine import SamplingParams

    cfg = parse_rl_args(rl_argv, prog="check_rl.py phase")
    probe: dict = {}
    t = time.perf_counter()
    trainer = build_trainer(cfg)
    probe["build_s"] = round(time.perf_counter() - t, 3)
    engine = trainer.engine
    probe["engine_class"] = type(engine).__name__
    rc = 0
    try:
        initial_fp = trainer.actor.call("weights_fingerprint")[0]  # before training (outside the timings)
        t = time.perf_counter()
        trainer.fit()  # as rlhforge.cli.train_ppo_ray.run: train, then export to --ckpt.output_dir
        probe["fit_s"] = round(time.perf_counter() - t, 3)
        # one more sync (not in the metrics), now with fingerprints: what the engine loaded vs what rank 0 sends
        if not hasattr(engine, "sync_from"):
            final_fp = trainer.actor.call("weights_fingerprint")[0]
            probe["fingerprints"] = {"actor_before_training": initial_fp, "actor": final_fp,
                                     "training_changed_weights": initial_fp != final_fp,
                                     "engines": None, "why": "the engine is not an engine actor (no sync fingerprint)"}
        else:
            engine.fingerprint_syncs = True
            t = time.perf_counter()
            engine.sync_from(trainer.actor)
            fps = list(engine.last_fingerprints)
            actor_fp = trainer.actor.call("weights_fingerprint")[0]
            probe["fingerprints"] = {"engines": fps, "actor": actor_fp, "equal": bool(fps) and all(f == actor_fp for f in fps),
                                     "actor_before_training": initial_fp, "training_changed_weights": initial_fp != actor_fp,
                                     "extra_sync_with_fingerprint_s": round(time.perf_counter() - t, 3)}
        state = trainer.actor.call("engine_state_dict")[0]  # what a sync sends (rank 0), outside the timings
        if state:
            dtypes: dict = {}
            for t in state.values():
                dtypes[str(t.dtype).removeprefix("torch.")] = dtypes.get(str(t.dtype).removeprefix("torch."), 0) + t.numel()
            probe["sent_weights"] = {"bytes": sum(t.numel() * t.element_size() for t in state.values()),
                                     "tensors": len(state), "numel_by_dtype": dtypes,
                                     "what": "actor rank 0's engine_state_dict after the run: the tensors a sync "
                                             "sends, in the training dtype (a tied weight counts once per name)"}
        del state
        tok = trainer.tokenizer
        # the run's own first prompts, at most its response length: they fit the engine's max_model_len
        prompts = [list(p.ids) for p in trainer.prompts[:GREEDY_PROMPTS]]
        max_new = min(a.max_new, trainer.max_new_tokens)
        params = [SamplingParams(max_new_tokens=max_new, temperature=0.0) for _ in prompts]
        engine.wake_up()
        outs = trainer._run(engine.generate(prompts, params))
        engine.sleep()
        probe.update({"what": "greedy tokens of the run's engine after its last weight sync (the exported weights)",
                      "prompts": prompts, "tokens": [list(o.token_ids) for o in outs], "max_new_tokens": max_new,
                      "eos_token_id": tok.eos_token_id})
    except BaseException:
        traceback.print_exc()
        rc = 4 if "WorkerError" in traceback.format_exc() else 1
    finally:  # the clean-up of rlhforge.cli.train_ppo_ray.run
        trainer.logger.close()
        getattr(trainer.executor, "close", lambda: None)()
        getattr(trainer.engine, "close", lambda: None)()
        if not isinstance(trainer.actor, InProcessGroup):
            from rlhforge.distributed.launch import close_groups

            close_groups(trainer.actor, trainer.ref, trainer.critic, getattr(trainer, "reward_group", None))
        Path(a.probe_out).write_text(json.dumps(probe))
    return rc


# --------------------------------------------------------------------------------------------- greedy (child)


def compare(a_name, a_toks, b_name, b_toks, must_equal: bool, note: str = "") -> dict:
    eq = sum(1 for x, y in zip(a_toks, b_toks) if x == y)
    prefixes, first = [], []
    for i, (x, y) in enumerate(zip(a_toks, b_toks)):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefixes.append(k)
        if x != y and len(first) < 3:
            first.append({"prompt": i, "at": k, "a": x[k:k + 5], "b": y[k:k + 5]})
    return {"a": a_name, "b": b_name, "equal": eq, "of": len(a_toks), "must_equal": must_equal,
            "mean_common_prefix_tokens": sum(prefixes) / max(len(prefixes), 1),
            "mean_len_a": sum(map(len, a_toks)) / max(len(a_toks), 1), "first_mismatches": first, "note": note}


def cut_at_eos(ids: list[int], eos: int | None) -> list[int]:
    if eos is not None and eos in ids:
        return ids[: ids.index(eos) + 1]
    return ids


def cmd_greedy(a) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    spec = json.loads(Path(a.spec).read_text())
    device = spec["device"] if torch.cuda.is_available() or spec["device"] == "cpu" else "cpu"
    result: dict = {"comparisons": [], "skipped": [], "device": device}
    rc = 0

    def save():
        Path(a.out).write_text(json.dumps(result, indent=1))

    for item in spec["items"]:
        probe = json.loads(Path(item["probe"]).read_text())
        prompts, engine_toks, eos, n = probe["prompts"], probe["tokens"], probe.get("eos_token_id"), probe["max_new_tokens"]
        who = f"{item['phase']}: {probe.get('engine_class')} after its last sync"
        fresh = None
        if item["engine"] == "vllm":
            if time.time() + 60 > spec["deadline"]:
                result["skipped"].append(f"{item['phase']}: fresh vLLM engine (no time left)")
            else:
                try:
                    from rlhforge.rollout.engine import SamplingParams
                    from rlhforge.rollout.vllm_engine import VLLMEngine

                    t = time.perf_counter()
                    # a fresh engine from the export, in its own engine-core process (closed after), same dtype
                    eng = VLLMEngine(item["export"], eos_token_id=eos, dtype=item.get("dtype", "bfloat16"),
                                     max_model_len=512,
                                     gpu_memory_utilization=0.25, enforce_eager=spec.get("eager", True), in_process=False)
                    outs = eng.generate_sync(prompts, [SamplingParams(max_new_tokens=n, temperature=0.0)] * len(prompts))
                    fresh = [list(o.token_ids) for o in outs]
                    eng.close()
                    del eng
                    result.setdefault("fresh_vllm_s", {})[item["phase"]] = round(time.perf_counter() - t, 2)
                    result["comparisons"].append(compare(
                        who, engine_toks, f"{item['phase']}: fresh vLLM engine loaded from the export", fresh, True,
                        f"same weights, same vLLM kernels and dtype ({item.get('dtype')}), same batch of prompts: must be equal"))
                except Exception:  # noqa: BLE001
                    rc = 1
                    result.setdefault("errors", []).append(f"{item['phase']}: fresh vLLM: {traceback.format_exc()[-800:]}")
            save()
        if time.time() + 20 > spec["deadline"]:
            result["skipped"].append(f"{item['phase']}: HF comparison (no time left)")
            continue
        try:
            t = time.perf_counter()
            dtype = torch.bfloat16 if device == "cuda" else torch.float32
            model = AutoModelForCausalLM.from_pretrained(item["export"], dtype=dtype).to(device).eval()
            hf = []
            tf_agree = tf_total = 0
            margins = []
            with torch.no_grad():
                for p, e_toks in zip(prompts, engine_toks):
                    x = torch.tensor([p], device=device)
                    y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                       eos_token_id=eos, pad_token_id=eos)
                    hf.append(cut_at_eos(y[0, len(p):].tolist(), eos))
                    if e_toks:  # teacher forcing: is each engine token the HF argmax at its position?
                        full = torch.tensor([p + e_toks], device=device)
                        logits = model(full).logits[0, len(p) - 1: len(p) - 1 + len(e_toks)].float()
                        top = logits.argmax(-1)
                        chosen = torch.tensor(e_toks, device=device)
                        tf_agree += int((top == chosen).sum())
                        tf_total += len(e_toks)
                        gap = logits.max(-1).values - logits.gather(1, chosen[:, None])[:, 0]
                        margins += [float(g) for g in gap[top != chosen]]
            if item.get("initial"):  # the same greedy decoding on the model before training
                init = AutoModelForCausalLM.from_pretrained(item["initial"], dtype=dtype).to(device).eval()
                with torch.no_grad():
                    before = []
                    for p in prompts:
                        x = torch.tensor([p], device=device)
                        y = init.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                          eos_token_id=eos, pad_token_id=eos)
                        before.append(cut_at_eos(y[0, len(p):].tolist(), eos))
                del init
                changed = sum(1 for x, y in zip(before, hf) if x != y)
                result.setdefault("training_changed_greedy", {})[item["phase"]] = {
                    "what": "transformers greedy on the initial model vs on the export: prompts whose tokens differ "
                            "(0: the equality checks above could not tell a synced engine from a stale one)",
                    "differ": changed, "of": len(hf)}
            result.setdefault("hf_s", {})[item["phase"]] = round(time.perf_counter() - t, 2)
            kind = "bf16 on the GPU" if dtype == torch.bfloat16 else "fp32 on CPU"
            exact = item["engine"] == "hf" and device == "cpu"
            result["comparisons"].append(compare(
                who, engine_toks, f"{item['phase']}: transformers generate (greedy) on the export, {kind}", hf, exact,
                "same engine family and fp32: must be equal" if exact else
                f"different kernels ({kind}): a near-tie may flip a token, after which the sequences diverge; "
                "see teacher_forced"))
            if fresh is not None:
                result["comparisons"].append(compare(f"{item['phase']}: fresh vLLM engine", fresh,
                                                     f"{item['phase']}: transformers generate", hf, False))
            result.setdefault("teacher_forced", {})[item["phase"]] = {
                "what": "the engine's greedy tokens fed to the HF model from the export: share that are its argmax",
                "agree": tf_agree, "of": tf_total, "share": tf_agree / tf_total if tf_total else None,
                "max_logit_gap_where_not_argmax": max(margins) if margins else 0.0}
            del model
            if device == "cuda":
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001
            rc = 1
            result.setdefault("errors", []).append(f"{item['phase']}: HF: {traceback.format_exc()[-800:]}")
        save()
    save()
    return rc


# --------------------------------------------------------------------------------------------- CLI


def parse(argv: list[str]):
    if argv and argv[0] == "phase":
        rl = argv[argv.index("--") + 1:] if "--" in argv else []
        head = argv[1: argv.index("--")] if "--" in argv else argv[1:]
        p = argparse.ArgumentParser(prog="check_rl.py phase")
        p.add_argument("--probe-out", required=True)
        p.add_argument("--max-new", type=int, default=32)
        return "phase", p.parse_args(head), rl
    if argv and argv[0] == "greedy":
        p = argparse.ArgumentParser(prog="check_rl.py greedy")
        p.add_argument("--spec", required=True)
        p.add_argument("--out", required=True)
        return "greedy", p.parse_args(argv[1:]), None
    p = argparse.ArgumentParser(prog="check_rl.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="print every command, run none")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model, CPU, HF engine: proves the pipeline and JSON")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default 4; 2 with --cpu-smoke)")
    p.add_argument("--budget-s", type=float, default=None, help="whole-check budget (default 450 s; 240 s smoke)")
    p.add_argument("--phase-s", type=float, default=170, help="cap per RL run")
    p.add_argument("--greedy-s", type=float, default=120, help="cap of the greedy-after-sync check")
    p.add_argument("--vllm-install-s", type=float, default=240, help="cap of the vLLM pip install")
    p.add_argument("--greedy-tokens", type=int, default=32)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--no-eager", dest="eager", action="store_false",
                   help="let vLLM capture CUDA graphs / compile (slower start-up; default: --vllm.enforce_eager)")
    p.add_argument("--no-install", action="store_true", help="install nothing; use the found Python as it is")
    p.add_argument("--no-vllm", action="store_true", help="do not try to install vLLM")
    p.add_argument("--wheels", default=os.environ.get("CHECK_RL_WHEELS"),
                   help="a folder of wheels for pip --find-links (default: REPO/.whl when it exists)")
    p.add_argument("--base-python", default=None, help="the Python that holds torch (check_rl.sh passes it)")
    p.add_argument("--work", default=os.environ.get("CHECK_RL_WORK", "/tmp/rlhforge_gpu_check"))
    p.add_argument("--out", default=None, help=f"results JSON (default {DEFAULT_OUT.relative_to(REPO)}; "
                                                 "cpu-smoke: WORK/gpu_rl_cpu_smoke.json)")
    a = p.parse_args(argv)
    smoke = a.cpu_smoke
    a.steps = a.steps or (2 if smoke else 4)
    a.budget_s = a.budget_s or (240.0 if smoke else 450.0)
    a.out = a.out or (str(Path(a.work) / "gpu_rl_cpu_smoke.json") if smoke else str(DEFAULT_OUT))
    if smoke:
        a.greedy_tokens = min(a.greedy_tokens, 8)
    return "all", a, None


def main(argv: list[str] | None = None) -> int:
    cmd, a, rl = parse(list(sys.argv[1:] if argv is None else argv))
    if cmd == "phase":
        return cmd_phase(a, rl)
    if cmd == "greedy":
        return cmd_greedy(a)
    return Check(a).main()


if __name__ == "__main__":
    sys.exit(main())
