"""Stage ``env`` of the GPU check (run in a child process): what this machine has.

Versions of Python, torch (CUDA, NCCL), the libraries the check uses and the ones it must do without
(vllm, ray, deepspeed: expected missing on the GPU machine), where the vendored wheels were imported from
(``/tmp/site`` on the GPU machine), the GPU (name, memory, capability; nvidia-smi's driver line) and which
rlhforge is imported. ``ok``: torch imports, CUDA is there when the check wants it, and tyro imports
(rlhforge's flag parsing: without it no RL stage can start).
"""

from __future__ import annotations

import importlib
import importlib.util
import platform
import shutil
import subprocess
import sys

MODULES = ("torch", "transformers", "accelerate", "peft", "triton", "safetensors", "tokenizers", "numpy",
           "pyarrow", "pandas", "huggingface_hub", "fsspec", "typing_extensions", "pytest", "tyro", "typeguard",
           "docstring_parser", "datasets", "dill", "multiprocess", "trl", "vllm", "ray", "deepspeed")


#: present or not, never imported here (seconds each, and vLLM's import can touch the GPU)
NOT_IMPORTED = ("vllm", "ray", "deepspeed")


def probe_module(name: str) -> dict:
    if name in NOT_IMPORTED:
        found = importlib.util.find_spec(name) is not None
        return {"ok": found, **({"note": "installed (not imported by this probe)"} if found else {"error": "not installed"})}
    try:
        mod = importlib.import_module(name)
    except Exception as err:  # noqa: BLE001 - a broken install is a finding, not a crash
        return {"ok": False, "error": f"{type(err).__name__}: {str(err)[:300]}"}
    return {"ok": True, "version": str(getattr(mod, "__version__", "?")), "file": str(getattr(mod, "__file__", ""))}


def run_env(spec: dict, res) -> None:
    res["python"] = {"version": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform()}
    res["modules"] = {}
    for name in MODULES:
        res["modules"][name] = probe_module(name)
        res.save()
    try:
        import torch
    except Exception as err:  # noqa: BLE001
        res.fail(f"torch does not import: {err}")
        return
    gpu: dict = {"cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda,
                 "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu.update(name=props.name, total_memory_gb=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}", bf16_supported=torch.cuda.is_bf16_supported())
        try:
            gpu["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception as err:  # noqa: BLE001
            gpu["nccl"] = f"unknown ({err})"
    if shutil.which("nvidia-smi"):
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            gpu["nvidia_smi"] = (r.stdout or r.stderr).strip()[:500]
        except Exception as err:  # noqa: BLE001
            gpu["nvidia_smi"] = f"failed: {err}"
    res["gpu"] = gpu
    import rlhforge

    res["rlhforge_file"] = rlhforge.__file__
    try:  # the signature the bug-1 stage is written against (the fix under review)
        import inspect

        from rlhforge.backend.strategy import all_reduce_tensor

        res["all_reduce_tensor_signature"] = str(inspect.signature(all_reduce_tensor))
    except Exception as err:  # noqa: BLE001
        res["all_reduce_tensor_signature"] = f"does not import: {type(err).__name__}: {str(err)[:300]}"
    problems = []
    if spec["device"] == "cuda" and not gpu["cuda_available"]:
        problems.append(f"no CUDA device visible to torch {torch.__version__}")
    if not res["modules"]["tyro"]["ok"]:
        problems.append("tyro does not import (rlhforge's flag parsing): carry .whl/ (benchmarks/gpu/fetch_wheels.sh)")
    missing_expected = [m for m in ("vllm", "ray", "deepspeed") if not res["modules"][m]["ok"]]
    res["missing_optional"] = missing_expected
    if problems:
        res.fail("; ".join(problems))
    else:
        res["ok"] = True
