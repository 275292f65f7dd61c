#!/usr/bin/env python3
"""The GPU check of issue 30, made for the machine it runs on (one H200, torch + transformers preinstalled,
no vLLM / Ray / DeepSpeed, no package index, the wheels of benchmarks/gpu/fetch_wheels.sh carried in .whl/:
DeepSpeed among them, built here with ``DS_BUILD_OPS=0``).

Run it through ``bash benchmarks/gpu/check_rl.sh`` (see benchmarks/gpu/README.md):

    check_rl.py [--budget-s 510]     the check (GPU): results in benchmarks/results/gpu_check.json
    check_rl.py --dry-run            print every command, run none
    check_rl.py --cpu-smoke          the same stages on CPU (gloo, shared memory, tiny model): /tmp only

Stages, each in its own process with its own timeout, in order: env (versions, GPU, wheel install),
bug1 (a host tensor in an NCCL all-reduce, and the fix), nccl_group (the weight-sync channel as an NCCL
group of one), ipc_sync (CUDA-IPC weight sync into a plain-torch receiver: fingerprints, greedy tokens,
s/GB); then, on a ~0.4B Qwen3-shaped random model in bf16: vllm_engine (rlhforge's vLLM engine: tokens/s,
sleep, wake, the same tokens), grpo_vllm (the hybrid engine through Ray: colocated actor, reference and vLLM,
ZeRO-3, CUDA-IPC sync, the post-sync probe), trl_vllm (TRL with vLLM in colocate mode), hf_decode (the HF
engine's eager and CUDA-graph decode loops), grpo_torch, grpo_deepspeed and grpo_fsdp2 (GRPO through
rlhforge's RL CLI with the HF engine; DeepSpeed as ZeRO-3 with ``--ds.enable_sleep --ds.adam_offload``), trl
(TRL's GRPOTrainer side by side), gpu_tests (pytest -m gpu). The model is built in the background while the
first stages run. vLLM, Ray and DeepSpeed come from benchmarks/gpu/carry_kit.py's bundle (issue 44). The results JSON is rewritten after every stage (and copied to
$OUT when that names a folder), so a later failure or a timeout keeps what ran before.

This file uses the standard library only; everything that imports torch runs in a child process.
Exit status: 0 every stage passed (``n/a`` ones included: stages a CPU smoke cannot do); 1 otherwise.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from check_plan import (CAPS, DEEPSPEED_FLAGS, HYBRID_FLAGS, HYBRID_GPU_FLAGS, HYBRID_KL,  # noqa: E402
                        HYBRID_RETRY_UTIL, IPC_MODEL, MODEL, ORDER, SHAPE, STRATEGIES, TRL_VLLM_UTIL, VLLM_STAGES,
                        rl_flags)
from gpu_metrics import (generation_line, headline, now, out_of_memory, parse_pytest, read_json,  # noqa: E402
                         safetensors_params, vllm_line, wheel_fits, write_json)

SCHEMA = "rlhforge.gpu_check/2"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "gpu_check.json"
class Check:
    def __init__(self, a):
        self.a = a
        self.mode = "cpu-smoke" if a.cpu_smoke else "gpu"
        self.dry = a.dry_run
        self.caps = CAPS[self.mode]
        self.t0 = time.time()
        self.deadline = self.t0 + a.budget_s
        self.work = Path(a.work)
        self.out = Path(a.out)
        self.py = a.python or sys.executable
        self.site: Path | None = None
        self.cuda = self.mode == "gpu"
        self.res: dict = {"schema": SCHEMA, "mode": "dry-run" if self.dry else self.mode, "started_at": now(),
                          "finished_at": None, "wall_s": None, "ok": None, "exit_code": None, "budget_s": a.budget_s,
                          "work_dir": str(self.work), "python": self.py, "argv": sys.argv[1:], "stages": {},
                          "summary": []}

    # ------------------------------------------------------------------ bookkeeping
    def left(self) -> float:
        return self.deadline - time.time()

    def log(self, msg: str) -> None:
        print(f"[check_rl {time.time() - self.t0:6.1f}s] {msg}", flush=True)

    def save(self) -> None:
        if self.dry:
            return
        self.res["wall_s"] = round(time.time() - self.t0, 1)
        write_json(self.out, self.res)
        out_dir = os.environ.get("OUT")
        if out_dir and Path(out_dir).is_dir() and self.mode == "gpu":
            try:
                shutil.copy(self.out, Path(out_dir) / self.out.name)
            except OSError:
                pass

    def env(self, stage: str) -> dict:
        env = dict(os.environ)
        paths = [str(self.site)] if self.site else []
        paths += [str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env.update(PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   TQDM_DISABLE="1", HF_DATASETS_OFFLINE="1")
        for k in ("CI", "RLHFORGE_WITH_VLLM"):  # optional deps then skip instead of failing (tests/conftest.py)
            env.pop(k, None)
        if stage != "gpu_tests":  # the check shows what users get; the test suite sets strict mode itself
            env.pop("RLHFORGE_STRICT_DEVICE", None)
        if not self.cuda:
            env["CUDA_VISIBLE_DEVICES"] = ""
        return env

    def stage(self, name: str) -> dict:
        rec = self.res["stages"].setdefault(name, {"status": "pending"})
        return rec

    # ------------------------------------------------------------------ running commands
    def start(self, name: str, cmd: list, log_file: Path | None):
        cmd = [str(c) for c in cmd]
        lf = open(log_file, "w") if log_file else subprocess.DEVNULL
        p = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=self.env(name), cwd=str(REPO),
                             start_new_session=True)
        if log_file:
            lf.close()
        return p

    @staticmethod
    def stop(p) -> None:
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            try:
                os.killpg(p.pid, sig)
                p.wait(timeout=wait)
                return
            except ProcessLookupError:
                return
            except subprocess.TimeoutExpired:
                continue

    def run(self, name: str, cmd: list, cap_key: str | None = None, echo: bool = True) -> dict:
        """Run ``cmd`` for stage ``name`` under min(its cap, what is left of the budget); record it."""
        rec = self.stage(name)
        timeout = min(self.caps[cap_key or name], self.left())
        rec.update(cmd=shlex.join(str(c) for c in cmd), timeout_s=round(timeout, 1))
        if self.dry:
            print(f"DRY-RUN [{name}] (timeout {timeout:.0f}s): {rec['cmd']}", flush=True)
            rec["status"] = "dry-run"
            return rec
        if timeout < 3:
            rec.update(status="skipped", why=f"no time left in the --budget-s {self.a.budget_s:.0f}")
            self.log(f"{name}: skipped ({rec['why']})")
            return rec
        log_file = self.work / f"{name}.log"
        rec["log"] = str(log_file)
        self.log(f"{name}: start (timeout {timeout:.0f}s)")
        t = time.time()
        p = self.start(name, cmd, log_file)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop(p)
            rc, rec["timed_out"] = p.returncode, True
        rec.update(rc=rc, wall_s=round(time.time() - t, 2))
        text = log_file.read_text(errors="replace") if log_file.exists() else ""
        rec["output_tail"] = "\n".join(text.splitlines()[-30:])
        if echo:
            for line in text.splitlines()[-8:]:
                print(f"  | {line}", flush=True)
        return rec

    def child(self, name: str, child_stage: str, spec: dict) -> dict:
        spec_file, out_file = self.work / f"{name}.spec.json", self.work / f"{name}.result.json"
        if not self.dry:
            write_json(spec_file, spec)
            out_file.unlink(missing_ok=True)
        rec = self.run(name, [self.py, HERE / "check_rl_child.py", child_stage, "--spec", spec_file, "--out", out_file])
        if self.dry:
            print(f"  {spec_file.name}: {json.dumps(spec)}", flush=True)
        if self.dry or rec.get("status") == "skipped":
            return rec
        result = read_json(out_file) or {}
        rec["result"] = result
        if rec.get("timed_out"):
            rec["status"] = "timed_out"
        elif result.get("not_applicable"):
            rec.update(status="n/a", why=result["not_applicable"])
        else:
            rec["status"] = "ok" if rec["rc"] == 0 and result.get("ok") else "failed"
        if rec["status"] == "ok":
            rec.pop("output_tail", None)
        return rec

    # ------------------------------------------------------------------ stages
    def env_stage(self) -> None:
        rec = self.stage("env")
        wheels = sorted(Path(self.a.wheels).glob("*.whl")) if self.a.wheels else []
        inst: dict = {"wheel_dir": self.a.wheels, "wheels": [w.name for w in wheels]}
        if self.mode == "cpu-smoke":  # the wheels are for the GPU machine's Python 3.12: keep what fits this one
            skip = [w.name for w in wheels if not wheel_fits(w.name, self.py)]
            wheels = [w for w in wheels if w.name not in skip]
            if skip:
                inst["not_for_this_python"] = skip
        rec["install"] = inst
        if wheels and not self.a.no_install:
            self.site = Path(self.a.site)
            cmd = [self.py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                   "--upgrade", "--target", str(self.site), *map(str, wheels)]
            inst["cmd"] = shlex.join(cmd)
            if self.dry:
                print(f"DRY-RUN [env: wheel install] (timeout 60s): {inst['cmd']}", flush=True)
            else:
                t = time.time()
                try:
                    r = subprocess.run(cmd, capture_output=True, text=True, timeout=min(60, max(5, self.left())),
                                       env=self.env("env"))
                    inst.update(rc=r.returncode, output_tail=(r.stdout + r.stderr)[-1500:])
                except subprocess.TimeoutExpired:
                    inst.update(rc=None, timed_out=True)
                inst["wall_s"] = round(time.time() - t, 2)
                self.log(f"env: installed {len(wheels)} wheels into {self.site}: rc {inst.get('rc')}")
        else:
            inst["skipped"] = "--no-install" if wheels else f"no wheels in {self.a.wheels} (fetch_wheels.sh)"
        self.child("env", "env", {"device": "cuda" if self.cuda else "cpu"})
        if not self.dry and inst.get("rc") not in (None, 0) and rec["status"] == "ok":
            rec["status"] = "failed"
        if not self.dry and inst.get("timed_out"):
            rec["status"] = "failed"

    def base_spec(self) -> dict:
        return {"device": "cuda" if self.cuda else "cpu", "backend": "nccl" if self.cuda else "gloo",
                "param_dtype": "bf16" if self.cuda else "fp32"}

    def ipc_spec(self) -> dict:
        return {**self.base_spec(), "ipc_model": IPC_MODEL[self.mode], "ipc_dtype": "bfloat16" if self.cuda else "float32",
                "greedy_tokens": 16, "bucket_bytes": (64 << 20) if self.cuda else (256 << 10), "ipc_wait_s": 45}

    def gpu_tests(self) -> None:
        files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
                       if "mark.gpu" in p.read_text(errors="replace"))
        rec = self.stage("gpu_tests")
        rec["files"] = files
        cmd = [self.py, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-o", "timeout=45",
               "--continue-on-collection-errors", *files]
        self.run("gpu_tests", cmd)
        if self.dry or rec.get("status") == "skipped":
            return
        text = Path(rec["log"]).read_text(errors="replace") if Path(rec["log"]).exists() else ""
        counts = parse_pytest(text)
        rec["counts"] = counts
        rec["output_tail"] = "\n".join(text.splitlines()[-40:])
        good = rec["rc"] in (0, 5) and counts["failed"] == 0 and counts["errors"] == 0
        rec["status"] = "timed_out" if rec.get("timed_out") else "ok" if good else "failed"

    def start_model(self):
        rec = self.stage("model")
        spec = dict(MODEL[self.mode])
        path = self.work / "model"
        cmd = [self.py, "-m", "rlhforge.cli.main", "tiny-model", "--out", path, "--seed", "0", "--arch", spec.pop("arch")]
        for k, v in spec.items():
            cmd += [f"--spec.{k}", v]
        rec.update(path=str(path), spec=MODEL[self.mode], cmd=shlex.join(str(c) for c in cmd),
                   timeout_s=self.caps["model"])
        if self.dry:
            print(f"DRY-RUN [model] (in the background, timeout {self.caps['model']}s): {rec['cmd']}", flush=True)
            rec["status"] = "dry-run"
            return None
        if path.exists():
            shutil.rmtree(path)
        rec.update(status="running", log=str(self.work / "model.log"))
        self.log("model: building in the background")
        return (self.start("model", cmd, self.work / "model.log"), time.time())

    def wait_model(self, handle) -> Path | None:
        rec = self.stage("model")
        if self.dry:
            return self.work / "model"
        p, t = handle
        try:
            rc = p.wait(timeout=max(1.0, min(t + self.caps["model"], self.deadline) - time.time()))
        except subprocess.TimeoutExpired:
            self.stop(p)
            rc, rec["timed_out"] = p.returncode, True
        rec.update(rc=rc, wall_s=round(time.time() - t, 1))
        if rc == 0:
            rec.update(status="ok", **safetensors_params(Path(rec["path"])))
            self.log(f"model: {rec['num_params'] / 1e6:.1f}M parameters in {rec['wall_s']} s")
            return Path(rec["path"])
        rec["status"] = "timed_out" if rec.get("timed_out") else "failed"
        log = Path(rec["log"])
        rec["output_tail"] = "\n".join(log.read_text(errors="replace").splitlines()[-30:]) if log.exists() else ""
        return None

    def rl_flags(self, model: Path, run: Path, strategy: str, kl: str = "0") -> list[str]:
        return rl_flags(self.mode, model, run, self.work / "reward.py", strategy, self.a.steps, kl)

    def grpo(self, strategy: str, model: Path | None) -> None:
        name = f"grpo_{strategy}"
        rec = self.stage(name)
        if model is None:
            rec.update(status="skipped", why="the model was not built (see stage model)")
            return
        run = self.work / "runs" / name
        if run.exists() and not self.dry:
            shutil.rmtree(run)
        flags = self.rl_flags(model, run, strategy)
        if strategy == "deepspeed":
            flags += DEEPSPEED_FLAGS
            rec["ds_flags"] = DEEPSPEED_FLAGS
        rec["equivalent_cli"] = shlex.join(["python", "-m", "rlhforge.cli.train_ppo_ray", *flags])
        rec["shape"] = SHAPE[self.mode]
        self.child(name, "grpo", {**self.base_spec(), "flags": flags, "run_dir": str(run), "steps": self.a.steps})

    def grpo_vllm(self, model: Path | None) -> None:  # issue 44: the seed's hybrid engine, through Ray
        rec = self.stage("grpo_vllm")
        if model is None:
            rec.update(status="skipped", why="the model was not built (see stage model)")
            return
        run = self.work / "runs" / "grpo_vllm"
        if run.exists() and not self.dry:
            shutil.rmtree(run)
        flags = self.rl_flags(model, run, "deepspeed", kl=HYBRID_KL)
        flags += HYBRID_FLAGS + (HYBRID_GPU_FLAGS if self.cuda else [])
        rec.update(equivalent_cli=shlex.join(["python", "-m", "rlhforge.cli.train_ppo_ray", *flags]),
                   shape=SHAPE[self.mode])
        # the models and the engine live in Ray workers: the driver keeps off the GPU (no CUDA peaks per phase)
        spec = {**self.base_spec(), "flags": flags, "run_dir": str(run), "steps": self.a.steps, "needs_vllm": True,
                "driver_cuda": False}
        self.child("grpo_vllm", "grpo", spec)
        if self.cuda and not self.dry and out_of_memory(rec):  # issue 39's F1 seen for real: record it, rerun at 0.5
            first = {k: rec.pop(k) for k in ("status", "rc", "wall_s", "result", "output_tail", "timed_out") if k in rec}
            shutil.rmtree(run, ignore_errors=True)
            spec["flags"] = flags + ["--vllm.gpu_memory_utilization", HYBRID_RETRY_UTIL]
            self.child("grpo_vllm", "grpo", spec)
            rec["at_default_utilization"] = first
            rec["why"] = (f"out of memory (or refused for memory at start-up) at the default "
                          f"--vllm.gpu_memory_utilization; rerun at {HYBRID_RETRY_UTIL}")

    def vllm_engine(self, model: Path | None) -> None:  # issue 44: generate, sleep, wake, the same tokens
        if model is None:
            return self.stage("vllm_engine").update(status="skipped", why="the model was not built (see stage model)")
        sh = SHAPE[self.mode]
        self.child("vllm_engine", "vllm_engine", {
            **self.base_spec(), "model": str(model), "prompts": sh["prompts"], "samples": sh["samples"],
            "new_tokens": sh["new_tokens"], "max_len": sh["max_len"], "rounds": 3 if self.cuda else 1,
            "gpu_memory_utilization": 0.5})

    def trl(self, model: Path | None, name: str = "trl") -> None:
        rec = self.stage(name)
        if model is None:
            rec.update(status="skipped", why="the model was not built (see stage model)")
            return
        run = self.work / "runs" / name
        if run.exists() and not self.dry:
            shutil.rmtree(run)
        rec["shape"] = SHAPE[self.mode]
        vllm = {"use_vllm": True, "vllm_gpu_memory_utilization": TRL_VLLM_UTIL} if name == "trl_vllm" else {}
        self.child(name, "trl", {**self.base_spec(), "model": str(model), "run_dir": str(run), "steps": self.a.steps,
                                 "shape": SHAPE[self.mode], "dtype": "bf16" if self.cuda else "fp32",
                                 "trl_optional": not self.cuda, **vllm})

    def hf_decode(self, model: Path | None) -> None:  # issue 42 item 2: eager vs graphs decode, the GRPO shape
        sh = SHAPE[self.mode]
        if model is None:
            return self.stage("hf_decode").update(status="skipped", why="the model was not built (see stage model)")
        self.child("hf_decode", "hf_decode", {**self.base_spec(), "model": str(model), "new_tokens": sh["new_tokens"],
                                              "rows": sh["prompts"] * sh["samples"], "rounds": 3 if self.cuda else 1})

    # ------------------------------------------------------------------ all
    def main(self) -> int:
        try:
            if not self.dry:
                self.work.mkdir(parents=True, exist_ok=True)
                from gpu_rl import REWARD_PY  # (standard library only at import)

                (self.work / "reward.py").write_text(REWARD_PY)
            self.log(f"mode {self.res['mode']}; python {self.py}; budget {self.a.budget_s:.0f} s; work {self.work}; "
                     f"results {self.out if not self.dry else '(none: dry run)'}")
            only = set(self.a.only.split(",")) if self.a.only else set(ORDER)
            if "env" not in only and Path(self.a.site).is_dir() and not self.a.no_install:
                self.site = Path(self.a.site)  # installed by an earlier run
            if "env" in only:
                self.env_stage()
                self.save()
            needs_model = {"model", "hf_decode", "trl", *VLLM_STAGES} | {f"grpo_{s}" for s in STRATEGIES}
            handle = self.start_model() if only & needs_model else None
            self.save()
            for name in ("bug1", "nccl_group", "ipc_sync"):
                if name in only:
                    self.child(name, name, self.ipc_spec() if name == "ipc_sync" else self.base_spec())
                    self.save()
            model = self.wait_model(handle) if handle is not None or (self.dry and only & needs_model) else None
            self.save()
            runs = {"vllm_engine": self.vllm_engine, "grpo_vllm": self.grpo_vllm,
                    "trl_vllm": lambda m: self.trl(m, "trl_vllm"), "hf_decode": self.hf_decode, "trl": self.trl,
                    **{f"grpo_{s}": functools.partial(self.grpo, s) for s in STRATEGIES}}
            for name in ORDER:
                if name in only and name in runs:
                    runs[name](model)
                    self.save()
            if "gpu_tests" in only:
                self.gpu_tests()
                self.save()
        except Exception:  # noqa: BLE001 - the JSON must still be written
            self.res["crash"] = traceback.format_exc()[-2000:]
            print(self.res["crash"], file=sys.stderr)
        return self.finalize()

    def finalize(self) -> int:
        stages = self.res["stages"]
        bad = [k for k, v in stages.items() if v.get("status") not in ("ok", "n/a", "dry-run")]
        code = 1 if bad or self.res.get("crash") else 0
        self.res.update(finished_at=now(), ok=code == 0, exit_code=code, failed_stages=bad)
        self.res["summary"] = ([headline(k, stages[k]) for k in ORDER if k in stages] + generation_line(stages)
                               + vllm_line(stages, self.cuda))
        self.save()
        if self.dry:
            print("DRY-RUN: nothing was run; the results would go to", self.out)
            return 0
        out_dir = os.environ.get("OUT")
        if out_dir and Path(out_dir).is_dir() and self.mode == "gpu":  # every stage's log and result, for the record
            dest = Path(out_dir) / "gpu_check_stages"
            dest.mkdir(exist_ok=True)
            for f in [*self.work.glob("*.log"), *self.work.glob("*.result.json")]:
                if f.name != "check_rl.log" and f.stat().st_size < (4 << 20):
                    shutil.copy(f, dest / f.name)
        print("\n".join(["[check_rl] summary:"] + [f"  {line}" for line in self.res["summary"]]), flush=True)
        verdict = "OK" if code == 0 else f"FAILED ({', '.join(bad) or 'crash'})"
        print(f"[check_rl] {verdict} in {time.time() - self.t0:.0f} s; results: {self.out}", flush=True)
        return code


def parse(argv: list[str]):
    p = argparse.ArgumentParser(prog="check_rl.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="print every command, run none")
    p.add_argument("--cpu-smoke", action="store_true", help="the same stages on CPU (gloo, tiny model); writes to /tmp")
    p.add_argument("--budget-s", type=float, default=None, help="the whole check (default 510; cpu-smoke 420)")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default 3; cpu-smoke 2)")
    p.add_argument("--only", default=None, help=f"comma-separated stages to run, of: {','.join(ORDER)}")
    p.add_argument("--python", default=None, help="the Python of the children (default: this one)")
    p.add_argument("--wheels", default=str(REPO / ".whl"), help="wheels to install first (fetch_wheels.sh)")
    p.add_argument("--site", default=None, help="where they go (default /tmp/site; cpu-smoke WORK/site)")
    p.add_argument("--no-install", action="store_true", help="install no wheels (use what the Python has)")
    p.add_argument("--work", default=None, help="work folder (default /tmp/rlhforge_gpu_check[_smoke])")
    p.add_argument("--out", default=None, help=f"results JSON (default {DEFAULT_OUT.relative_to(REPO)}; "
                                               "cpu-smoke: WORK/gpu_check_cpu_smoke.json)")
    a = p.parse_args(argv)
    a.work = a.work or ("/tmp/rlhforge_gpu_check_smoke" if a.cpu_smoke else "/tmp/rlhforge_gpu_check")
    a.budget_s = a.budget_s or (420.0 if a.cpu_smoke else 510.0)
    a.steps = a.steps or (2 if a.cpu_smoke else 3)
    a.site = a.site or (str(Path(a.work) / "site") if a.cpu_smoke else "/tmp/site")
    a.out = a.out or (str(Path(a.work) / "gpu_check_cpu_smoke.json") if a.cpu_smoke else str(DEFAULT_OUT))
    if a.cpu_smoke and Path(a.out).resolve().is_relative_to((REPO / "benchmarks" / "results").resolve()):
        p.error("--cpu-smoke never writes to benchmarks/results/ (smoke numbers must not pass for GPU ones)")
    if a.only:
        unknown = set(a.only.split(",")) - set(ORDER)
        if unknown:
            p.error(f"--only: unknown stage(s) {sorted(unknown)}; valid: {', '.join(ORDER)}")
    return a


def main(argv: list[str] | None = None) -> int:
    return Check(parse(list(sys.argv[1:] if argv is None else argv))).main()


if __name__ == "__main__":
    sys.exit(main())
