"""check_rl.py's stage 1, the environment: probe the Python that holds CUDA torch, make an overlay venv
over it (the machine's torch stays as it is), install what the RL path needs (the project, its core
dependencies, Ray, the vLLM wheel matching that torch) from the index or a wheel folder, and record
every step. :class:`EnvironmentStage` is mixed into :class:`check_rl.Check`, whose ``run`` /
``finish_record`` / ``res`` it uses (standard library only)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

from gpu_metrics import missing

REPO = Path(__file__).resolve().parents[2]

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


class EnvironmentStage:
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
