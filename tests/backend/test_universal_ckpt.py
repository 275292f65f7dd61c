"""--ds.use_universal_ckpt: a ZeRO run saved on 2 gloo ranks resumes on 1 rank with the same fp32
weights, Adam moments, schedule and next-step losses as the 2-rank run that carried on."""

import os
import sys
from pathlib import Path

import pytest
import torch
from tests.torchrun import free_port, run_torchrun

WORKER = Path(__file__).with_name("universal_ckpt_worker.py")


def _run(tiny_model_dir, root, out, stages, mode, nproc):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    args = [str(WORKER), str(tiny_model_dir), str(root), str(out), stages, mode]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(free_port()), *args]
    else:
        cmd = [sys.executable, *args]
    proc = run_torchrun(cmd, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(out, weights_only=False)


@pytest.mark.slow
def test_two_rank_zero_checkpoints_resume_on_one_rank(tiny_model_dir, tmp_path):
    root = tmp_path / "ckpt"
    saved_runs = _run(tiny_model_dir, root, tmp_path / "train.pt", "2,3", "train", 2)
    resumed_runs = _run(tiny_model_dir, root, tmp_path / "resume.pt", "2,3", "resume", 1)
    for stage in (2, 3):
        saved, resumed = saved_runs[stage], resumed_runs[stage]
        step = root / f"zero{stage}" / "step_2"
        assert (step / "deepspeed_universal" / "zero").is_dir()  # converted once, beside the native shards
        names = {p.name for p in step.iterdir()}
        assert {"deepspeed", "deepspeed_universal", "rng_state_rank0.pt", "rng_state_rank1.pt"} <= names
        assert not [n for n in names if ".tmp" in n] and "latest_universal" not in names
        assert resumed["trainer_state"] == {"global_step": 2, "samples_seen": 16}
        assert set(resumed["state"]) == set(saved["state"])
        for name, ref in saved["state"].items():
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(resumed["state"][name][key], ref[key], rtol=0, atol=0,
                                           msg=f"ZeRO-{stage} {name} {key}")
        assert all(float(s["exp_avg_sq"].abs().max()) > 0 for s in saved["state"].values())  # real moments
        assert resumed["lr"] == pytest.approx(saved["lr"], rel=1e-12)  # the schedule carried on
        assert 3.0 < saved["losses"][0] < 10.0  # a real NLL of a small random model (vocab 1000: ln 1000 = 6.9)
        assert resumed["losses"] == pytest.approx(saved["losses"], rel=1e-5, abs=1e-6), f"ZeRO-{stage}"
    assert saved_runs[2]["losses"] == pytest.approx(saved_runs[3]["losses"], rel=1e-5)  # the two stages agree


def test_unchanged_world_size_loads_the_native_shards(tmp_path):
    from rlhforge.backend import universal_ckpt

    native = tmp_path / "step_1" / "deepspeed"
    native.mkdir(parents=True)
    for r in range(2):
        (native / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"")
    (native / "mp_rank_00_model_states.pt").write_bytes(b"")
    assert universal_ckpt.saved_dp_world_size(native) == 2
    assert not universal_ckpt.needs_universal(tmp_path / "step_1", 2)
    assert universal_ckpt.needs_universal(tmp_path / "step_1", 1)
    assert universal_ckpt.needs_universal(tmp_path / "step_1", 4)
    assert universal_ckpt.load_tag(tmp_path / "step_1", 2, True, lambda: None) == "deepspeed"
    (native / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    (native / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert universal_ckpt.saved_dp_world_size(native) is None  # ZeRO-0: one optimizer state, any world size
