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
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

# sibling modules (this folder is on sys.path: the file runs as a script)
from check_rl_child import cmd_greedy, cmd_phase
from gpu_env import EnvironmentStage
from gpu_metrics import GpuMemSampler, missing, now, read_metrics, safetensors_params, summarize

REPO = Path(__file__).resolve().parents[2]
THIS = Path(__file__).resolve()
DEFAULT_OUT = REPO / "benchmarks" / "results" / "gpu_rl.json"
SCHEMA = "rlhforge.gpu_check_rl/1"

# ~105M parameters: 12 layers x (attention 1.57M + MLP 7.08M) + 1024 x 768 tied embeddings; head_dim 64
SPEC_GPU = {"vocab_size": 1024, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
            "num_attention_heads": 12, "num_key_value_heads": 4}
SPEC_SMOKE: dict = {}  # rlhforge tiny-model's defaults (~0.4M parameters)

# a deterministic, varied reward (by response length) so GRPO advantages are non-zero on a random model
# and the weights really change between syncs (otherwise "greedy after sync" would compare initial weights)
REWARD_PY = '''
def reward_func(queries, prompts, labels, **kwargs):
    rewards = [(len(r) % 3) / 2.0 for r in kwargs["responses"]]
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
'''

# --------------------------------------------------------------------------------------------- orchestrator


class Check(EnvironmentStage):
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
