"""The GPU check (benchmarks/gpu/check_rl.sh) on CPU: its dry run prints every stage's command and runs
none, and its CPU smoke runs every stage (gloo for NCCL, shared memory for CUDA IPC, a tiny model) to a
passing results JSON in the work folder, never in benchmarks/results/."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import optional_deps_required

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu" / "check_rl.sh"
STAGES = ("env", "bug1", "nccl_group", "ipc_sync", "model", "vllm_engine", "grpo_vllm", "trl_vllm", "hf_decode",
          "grpo_torch", "grpo_deepspeed", "trl", "grpo_fsdp2", "gpu_tests")
RUN_ORDER = ["env", "model", "bug1", "nccl_group", "ipc_sync", *STAGES[5:]]  # the model is built beside bug1..ipc_sync


def _load(name: str):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        spec = importlib.util.spec_from_file_location(name, SCRIPT.parent / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(SCRIPT.parent))


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "CHECK_RL_PYTHON": sys.executable}
    env.pop("OUT", None)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=str(REPO))


def test_dry_run_prints_every_stage_and_runs_nothing(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out.json"
    r = _run(["--dry-run", "--work", str(work), "--out", str(out)], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    for stage in STAGES:
        assert f"DRY-RUN [{stage}]" in r.stdout, stage
    lines = r.stdout.splitlines()
    grpo = [ln for ln in lines if ln.strip().startswith("grpo_fsdp2.spec.json:")]
    assert len(grpo) == 1 and '"--ds.strategy", "fsdp2"' in grpo[0] and '"--ds.param_dtype", "bf16"' in grpo[0]
    assert '"--train.device", "cuda"' in grpo[0] and '"nccl"' in grpo[0]
    pytest_cmd = next(ln for ln in lines if ln.startswith("DRY-RUN [gpu_tests]"))
    assert " -m gpu " in pytest_cmd and "tests/rl/test_sleep.py" in pytest_cmd
    assert not out.exists() and not work.exists()  # nothing ran, nothing was written


def test_dry_run_plans_the_hybrid_engine_with_vllm_first(tmp_path):
    """Issue 44, point 3: right after the model, the check runs rlhforge's vLLM engine (sleep/wake), the seed's
    hybrid engine on one GPU (actor, reference and one vLLM engine colocated through Ray, both asleep in turn,
    ZeRO-3, bf16) and TRL with vLLM in colocate mode; the RL CLI accepts the hybrid run's flags as written."""
    work, out = tmp_path / "work", tmp_path / "out.json"
    r = _run(["--dry-run", "--work", str(work), "--out", str(out)], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    stages = [ln.split("]")[0].split("[")[1] for ln in lines if ln.startswith("DRY-RUN [") and ":" not in ln.split("]")[0]]
    assert stages == RUN_ORDER
    spec = lambda name: json.loads(next(ln for ln in lines if ln.strip().startswith(f"{name}.spec.json:")).split(":", 1)[1])
    hybrid = spec("grpo_vllm")
    flags = hybrid["flags"]
    assert hybrid["needs_vllm"] and hybrid["driver_cuda"] is False and hybrid["device"] == "cuda"
    from rlhforge.cli.train_ppo_ray import parse_rl_args

    cfg = parse_rl_args(flags, validate=False)
    cfg.validate()  # the config's own rules (the environment check would refuse the sleep on vLLM's CPU build)
    assert (cfg.train.workers, cfg.train.colocate_all, cfg.vllm.num_engines, cfg.vllm.enable_sleep) == ("ray", True, 1, True)
    assert (cfg.ds.strategy, cfg.ds.zero_stage, cfg.ds.enable_sleep, cfg.ds.param_dtype) == ("deepspeed", 3, True, "bf16")
    assert cfg.algo.kl.init_coef > 0  # so the reference model is built, colocated with the actor and the engine
    assert cfg.vllm.gpu_memory_utilization == 0.95  # the default a user gets (issue 39's F1 was an OOM at it)
    engine = spec("vllm_engine")
    assert (engine["prompts"] * engine["samples"], engine["new_tokens"], engine["rounds"]) == (64, 128, 3)
    trl = spec("trl_vllm")
    assert trl["use_vllm"] and trl["vllm_gpu_memory_utilization"] == 0.3 and trl["shape"] == spec("trl")["shape"]


def test_dry_run_plans_the_deepspeed_stage_from_the_carried_wheel(tmp_path):
    """Issue 39, point 4: the check runs GRPO under DeepSpeed ZeRO-3 with the hybrid engine's sleep and the
    optimizer on the host, on the GPU in bf16, after installing the DeepSpeed wheel carried in .whl/ (built with
    DS_BUILD_OPS=0 by fetch_wheels.sh at requirements/cuda.lock's pin)."""
    import re

    pin = re.search(r"^deepspeed==(\S+)", (REPO / "requirements" / "cuda.lock").read_text(), re.M).group(1)
    wheels = tmp_path / "whl"
    wheels.mkdir()
    ds_wheel = wheels / f"deepspeed-{pin}-py3-none-any.whl"
    ds_wheel.write_bytes(b"")  # the dry run only names it
    work, out = tmp_path / "work", tmp_path / "out.json"
    r = _run(["--dry-run", "--only", "env,model,grpo_deepspeed", "--wheels", str(wheels), "--work", str(work),
              "--out", str(out)], timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    install = next(ln for ln in lines if ln.startswith("DRY-RUN [env: wheel install]"))
    assert str(ds_wheel) in install and "--no-index" in install and "--no-deps" in install
    stage = next(ln for ln in lines if ln.startswith("DRY-RUN [grpo_deepspeed]"))
    assert "(timeout 150s)" in stage and "check_rl_child.py grpo" in stage
    spec = json.loads(next(ln for ln in lines if ln.strip().startswith("grpo_deepspeed.spec.json:")).split(":", 1)[1])
    flags = spec["flags"]
    opt = {f: flags[flags.index(f) + 1] for f in ("--ds.strategy", "--ds.zero_stage", "--ds.param_dtype", "--train.device")}
    assert opt == {"--ds.strategy": "deepspeed", "--ds.zero_stage": "3", "--ds.param_dtype": "bf16",
                   "--train.device": "cuda"}
    assert "--ds.enable_sleep" in flags and "--ds.adam_offload" in flags
    assert spec["device"] == "cuda" and spec["steps"] == 3
    assert not any("[grpo_torch]" in ln or "[trl]" in ln for ln in lines)  # --only
    assert not out.exists() and not work.exists()
    # the RL CLI takes these flags (a refusal would fail the stage on the GPU at its first line)
    from rlhforge.cli.train_ppo_ray import parse_rl_args

    cfg = parse_rl_args(flags)
    assert (cfg.ds.strategy, cfg.ds.zero_stage, cfg.ds.enable_sleep, cfg.ds.adam_offload) == ("deepspeed", 3, True, True)


def test_an_out_of_memory_hybrid_run_is_recognised_for_its_rerun():
    """Stage grpo_vllm reruns at --vllm.gpu_memory_utilization 0.5 when the default one ran out of memory (issue 39's
    F1), keeping the first attempt; other failures are not rerun."""
    check = _load("check_rl")
    oom = {"status": "failed", "result": {"errors": ["RayTaskError: torch.OutOfMemoryError: CUDA out of memory. "
                                                     "Tried to allocate 2.00 GiB"]}}
    assert check.out_of_memory(oom)
    assert check.out_of_memory({"status": "timed_out", "output_tail": "... CUDA out of memory ..."})
    assert check.out_of_memory({"status": "failed", "output_tail": "error: colocated vLLM engines cannot wake their "
                                                                 "KV cache beside the models: ..."})  # refused at start
    assert not check.out_of_memory({"status": "failed", "result": {"errors": ["ConfigError: --vllm.num_engines"]}})
    assert not check.out_of_memory({"status": "ok", "output_tail": "out of memory"})
    assert check.HYBRID_RETRY_UTIL == "0.5"


def test_cpu_smoke_refuses_to_write_into_benchmarks_results(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT.parent / "check_rl.py"), "--cpu-smoke", "--work", str(tmp_path),
                        "--out", str(REPO / "benchmarks" / "results" / "gpu_check_smoke.json")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "never writes to benchmarks/results/" in r.stderr


def test_pytest_summary_and_wheel_tags_are_parsed():
    metrics = _load("gpu_metrics")
    out = ("SKIPPED [1] tests/rl/test_vllm_vlm.py:201: vllm is not importable here\n"
           "FAILED tests/rl/test_sleep.py::test_x - AssertionError\n"
           "== 1 failed, 2 passed, 3 skipped, 14 deselected, 1 error in 3.20s ==\n")
    c = metrics.parse_pytest(out)
    assert (c["passed"], c["failed"], c["skipped"], c["errors"], c["deselected"]) == (2, 1, 3, 1, 14)
    assert c["skip_reasons"] == ["SKIPPED [1] tests/rl/test_vllm_vlm.py:201: vllm is not importable here"]
    assert c["failed_tests"] == ["FAILED tests/rl/test_sleep.py::test_x - AssertionError"]
    check = _load("check_rl")
    here = f"{sys.version_info.major}{sys.version_info.minor}"
    assert check.wheel_fits("tyro-1.0.17-py3-none-any.whl", sys.executable)
    assert check.wheel_fits(f"multiprocess-0.70.19-py{here}-none-any.whl", sys.executable)
    assert not check.wheel_fits("multiprocess-0.70.19-py39-none-any.whl", sys.executable)


@pytest.mark.slow
def test_cpu_smoke_runs_every_stage_to_a_passing_json(tmp_path):
    results = REPO / "benchmarks" / "results" / "gpu_check.json"
    before = results.stat().st_mtime if results.exists() else None
    work = tmp_path / "work"
    r = _run(["--cpu-smoke", "--no-install", "--work", str(work)], timeout=560)
    data = json.loads((work / "gpu_check_cpu_smoke.json").read_text())
    assert r.returncode == 0, (data.get("failed_stages"), r.stdout[-4000:], r.stderr[-2000:])
    assert data["mode"] == "cpu-smoke" and data["ok"] and data["exit_code"] == 0
    st = data["stages"]
    assert list(st) == RUN_ORDER
    for name, rec in st.items():
        assert rec["status"] in ("ok", "n/a"), (name, rec)
    assert st["trl"]["status"] == ("ok" if importlib.util.find_spec("trl") else "n/a")
    assert st["trl_vllm"]["status"] == "n/a"  # TRL's vLLM colocation needs a GPU
    if importlib.util.find_spec("vllm") or optional_deps_required():  # CI installs vLLM's CPU build
        engine = st["vllm_engine"]["result"]  # no sleep mode on CPU: the same requests twice, the same tokens
        assert engine["tokens_identical"] and engine["greedy_rows_equal"] == engine["sampled_rows_equal"] == 8
        assert "no sleep mode" in engine["sleep"] and engine["tokens_per_s_median"] > 0
        hybrid = st["grpo_vllm"]["result"]
        assert hybrid["summary"]["steps"] == 2 and hybrid["weight_sync"] == "collective (gloo)"
        probe = [r["sync/probe_logprob_diff_max"] for r in hybrid["summary"]["per_step"]]
        assert len(probe) == 2 and max(probe) < 1e-3  # fp32 engine and trainer: the synced weights are in effect
        assert all(r["sync/probe_policy_change"] > 0 for r in hybrid["summary"]["per_step"])  # ... and they moved
    bug1 = st["bug1"]["result"]
    assert bug1["group"]["backend"] == "gloo" and bug1["bug_reproduced"] is False  # the bug is NCCL-only
    assert bug1["fixed"]["has_device_parameter"] and all(s["ok"] for s in bug1["strategies"].values())
    assert set(bug1["strategies"]) == {"torch", "fsdp2"}
    assert st["nccl_group"]["result"]["buckets"] >= 1
    ipc = st["ipc_sync"]["result"]
    assert ipc["fingerprints_equal"] and ipc["fingerprint_differs_before_sync"]
    assert ipc["greedy"]["equal_prompts"] == ipc["greedy"]["prompts"] == 16
    assert st["gpu_tests"]["counts"]["failed"] == 0 and st["gpu_tests"]["counts"]["skipped"] >= 1
    assert st["grpo_deepspeed"]["ds_flags"] == ["--ds.zero_stage", "3", "--ds.enable_sleep", "--ds.adam_offload"]
    assert st["grpo_deepspeed"]["result"]["deepspeed"]["version"] == importlib.metadata.version("deepspeed")
    for name in ("grpo_torch", "grpo_fsdp2", "grpo_deepspeed"):
        summary = st[name]["result"]["summary"]
        assert summary["steps"] == 2 and summary["per_step"][0]["generated_tokens"] > 0, name
        assert {"generation", "training", "sync"} <= set(summary["phase_s_mean"]), name
    decode = st["hf_decode"]["result"]  # the static step runs eagerly on CPU: the eager loop's greedy tokens
    assert decode["greedy_rows_equal"] == decode["greedy_rows"] == 8 and not decode["graphs_captured"]
    assert decode["graphs"]["tokens_per_s_median"] > 0 and decode["eager"]["tokens_per_s_median"] > 0
    assert len(data["summary"]) == len(STAGES) + 1 and data["summary"][-1].startswith("generation: HF engine graphs")
    assert (results.stat().st_mtime if results.exists() else None) == before  # the smoke never writes there
