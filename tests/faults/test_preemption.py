"""Preemption (docs/reliability.md): SIGTERM / SIGINT make a trainer save a checkpoint at the next
step boundary and exit 143 / 130; the resumed run continues the uninterrupted run's curve exactly;
a step that does not end within ``--train.preempt_grace_s`` exits without saving.

The signalled runs are real CLI processes on a tiny model. Where the signal lands is made certain
without timing: the SFT process is frozen with SIGSTOP as soon as its first metrics line appears,
signalled, then continued (it stops at whichever step boundary comes next, and the test reads which);
the RL run's reward function waits (at most 60 s) during step 2 until the test has seen the
"SIGTERM received" line, so RL stops after step 2. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhforge.cli.train_ppo_ray import main as rl_main
from rlhforge.cli.train_sft import main as sft_main
from rlhforge.trainers.faults import Preempted, RunGuard
from tests.rl.helpers import metrics, rl_args
from tests.trainers.sft_helpers import sft_args, write_sft_data

ROOT = Path(__file__).parents[2]

GATED_REWARD = '''
import os, pathlib, time

def reward_func(queries, prompts, labels, **kwargs):
    gate = os.environ.get("TEST_GATE_DIR")
    if gate:  # from the second step on, wait (at most 60 s) until the test opens the gate
        gate = pathlib.Path(gate)
        logged = gate.parent / "run" / "metrics.jsonl"
        if logged.is_file() and logged.read_text().strip():
            gate.mkdir(parents=True, exist_ok=True)
            (gate / "waiting").touch()  # the test knows step 2 has started
            for _ in range(6000):
                if (gate / "open").exists():
                    break
                time.sleep(0.01)
    rewards = [(len(r) % 3) / 2.0 for r in kwargs["responses"]]
    return {"rewards": rewards, "scores": rewards}
'''


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _start(module: str, args: list[str], stderr: Path, **env) -> subprocess.Popen:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", **env}
    full = {k: v for k, v in full.items() if v is not None}  # env NAME=None: not inherited
    return subprocess.Popen([sys.executable, "-m", module, *map(str, args)], env=full, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=open(stderr, "w"))


def _wait_for(proc: subprocess.Popen, ready, what: str, limit_s: float = 300) -> None:
    """Poll ``ready()`` (bounded); fail if the process ends first."""
    deadline = time.monotonic() + limit_s
    while not ready():
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} within {limit_s}s"
        time.sleep(0.002)


def _lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def _curve(run: Path, keys) -> dict[int, dict]:
    return {r["step"]: {k: r[k] for k in keys if k in r} for r in _lines(run / "metrics.jsonl")}


def _checkpoint_step(run_ckpts: Path) -> int:
    name = (run_ckpts / "latest").read_text().strip()
    state = json.loads((run_ckpts / name / "trainer_state.json").read_text())
    assert name == f"step_{state['global_step']}"
    return state["global_step"]


def test_sigterm_checkpoints_sft_at_the_step_boundary_and_resume_continues_the_curve(tiny_model_dir, tmp_path):
    data = write_sft_data(tmp_path / "train.jsonl", n=240)  # 30 steps of 8 samples
    keys = ("train/loss", "train/grad_norm", "train/lr", "train/epoch")
    straight = tmp_path / "straight"
    assert sft_main(sft_args(tiny_model_dir, data, straight)) == 0

    run = tmp_path / "run"
    proc = _start("rlhforge.cli.train_sft", sft_args(tiny_model_dir, data, run), tmp_path / "err.txt")
    try:
        _wait_for(proc, lambda: _lines(run / "metrics.jsonl"), "a first metrics line")
        proc.send_signal(signal.SIGSTOP)  # frozen wherever it is, then signalled
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGCONT)
        assert proc.wait(timeout=300) == 143, (tmp_path / "err.txt").read_text()[-3000:]
    finally:
        proc.kill()
    err = (tmp_path / "err.txt").read_text()
    reached = _lines(run / "metrics.jsonl")[-1]["step"]
    assert 1 <= reached < 30
    assert _checkpoint_step(run / "ckpts") == reached  # saved at the step it reached (no --ckpt.save_steps)
    assert f"preempted by SIGTERM after step {reached}: saved {run / 'ckpts' / f'step_{reached}'}" in err
    assert not (run / "model.safetensors").exists()  # the final export did not run

    assert sft_main(sft_args(tiny_model_dir, data, run, "--ckpt.load_enable")) == 0
    a, b = _curve(straight, keys), _curve(run, keys)
    assert sorted(b) == list(range(1, 31))
    assert b == a  # every step, before and after the interruption, equals the uninterrupted run


def _gated_rl(tiny_model_dir, tmp_path, *extra):
    reward = tmp_path / "reward.py"
    reward.write_text(GATED_REWARD)
    (tmp_path / "gate").mkdir(exist_ok=True)
    return rl_args(tiny_model_dir, tmp_path / "run", "--reward.remote_url", reward, *extra, steps=4)


def test_sigterm_checkpoints_rl_and_resume_matches_the_straight_run(tiny_model_dir, tmp_path):
    keys = ("rollout/reward_mean", "rollout/response_length", "actor/policy_loss", "actor/grad_norm", "actor/lr",
            "actor/kl_ref", "rollout/advantage_std", "train/skipped_steps")
    args = _gated_rl(tiny_model_dir, tmp_path)
    straight = tmp_path / "straight"
    straight_args = list(args)
    straight_args[straight_args.index("--ckpt.output_dir") + 1] = str(straight)
    straight_args[straight_args.index("--ckpt.path") + 1] = str(straight / "ckpts")
    assert rl_main(straight_args) == 0  # no TEST_GATE_DIR here: the reward never waits

    run, err = tmp_path / "run", tmp_path / "err.txt"
    proc = _start("rlhforge.cli.train_ppo_ray", args, err, TEST_GATE_DIR=str(tmp_path / "gate"))
    try:
        _wait_for(proc, lambda: (tmp_path / "gate" / "waiting").exists(), "step 2 waiting at the gate")
        proc.send_signal(signal.SIGTERM)  # step 2's reward is waiting at the gate
        _wait_for(proc, lambda: "SIGTERM received" in err.read_text(), "the SIGTERM notice")
        (tmp_path / "gate" / "open").touch()
        assert proc.wait(timeout=300) == 143, err.read_text()[-3000:]
    finally:
        proc.kill()
    assert [r["step"] for r in _lines(run / "metrics.jsonl")] == [1, 2]
    assert _checkpoint_step(run / "ckpts") == 2
    assert "preempted by SIGTERM after step 2" in err.read_text()

    assert rl_main([*args, "--ckpt.load_enable"]) == 0
    a, b = _curve(straight, keys), _curve(run, keys)
    assert sorted(b) == [1, 2, 3, 4] and b == a


def test_a_step_that_outlasts_the_grace_period_exits_without_saving(tiny_model_dir, tmp_path):
    args = _gated_rl(tiny_model_dir, tmp_path, "--ckpt.save_steps", "1", "--train.preempt_grace_s", "1")
    run, err = tmp_path / "run", tmp_path / "err.txt"
    proc = _start("rlhforge.cli.train_ppo_ray", args, err, TEST_GATE_DIR=str(tmp_path / "gate"))
    try:
        _wait_for(proc, lambda: _lines(run / "metrics.jsonl"), "the step-1 metrics line")
        _wait_for(proc, lambda: (run / "ckpts" / "latest").is_file(), "the step-1 checkpoint")
        _wait_for(proc, lambda: (tmp_path / "gate" / "waiting").exists(), "step 2 waiting at the gate")
        proc.send_signal(signal.SIGTERM)  # the gate stays shut: step 2 cannot end
        assert proc.wait(timeout=300) == 143
    finally:
        proc.kill()
    text = err.read_text()
    assert "did not end within --train.preempt_grace_s 1s of SIGTERM: exiting without saving" in text
    assert f"last good checkpoint: {run / 'ckpts' / 'step_1'}" in text
    assert sorted(p.name for p in (run / "ckpts").iterdir()) == ["latest", "step_1"]
    assert [r["step"] for r in _lines(run / "metrics.jsonl")] == [1]


def test_sigint_in_process_saves_at_the_boundary_and_exits_130(tmp_path, capfd):
    """The guard itself: SIGINT during a step; the boundary saves once and raises exit code 130;
    the previous handlers are back afterwards."""
    saved = []
    before = signal.getsignal(signal.SIGINT)
    guard = RunGuard(grace_s=0, max_skipped_in_row=3, run_dir=tmp_path, ckpt_path=tmp_path / "ckpts")
    with pytest.raises(Preempted) as stop:
        with guard:
            guard.after_step(1, lambda: saved.append(1))  # no signal yet: nothing happens
            os.kill(os.getpid(), signal.SIGINT)  # handled in this thread before the next line runs
            guard.after_step(2, lambda: saved.append(2) or tmp_path / "ckpts" / "step_2")
    assert stop.value.code == 130 and saved == [2]
    assert signal.getsignal(signal.SIGINT) is before
    err = capfd.readouterr().err
    assert "SIGINT received" in err and "preempted by SIGINT after step 2" in err


@pytest.mark.slow
def test_sigterm_to_a_ray_driver_checkpoints_through_the_worker_groups(ray_module, tiny_model_dir, tmp_path):
    """The same gated RL run with the actor and reference as Ray workers (a local Ray the CLI starts):
    SIGTERM to the driver saves step 2 through the actor group (its DeepSpeed state) and exits 143."""
    args = _gated_rl(tiny_model_dir, tmp_path, "--train.workers", "ray", "--train.colocate_all",
                     "--ds.strategy", "deepspeed", "--ds.zero_stage", "2")
    run, err = tmp_path / "run", tmp_path / "err.txt"
    proc = _start("rlhforge.cli.train_ppo_ray", args, err, TEST_GATE_DIR=str(tmp_path / "gate"),
                  RAY_ADDRESS=None)  # no cluster address: the driver starts its own Ray
    try:
        _wait_for(proc, lambda: (tmp_path / "gate" / "waiting").exists(), "step 2 waiting at the gate", limit_s=500)
        proc.send_signal(signal.SIGTERM)
        _wait_for(proc, lambda: "SIGTERM received" in err.read_text(), "the SIGTERM notice")
        (tmp_path / "gate" / "open").touch()
        assert proc.wait(timeout=300) == 143, err.read_text()[-3000:]
    finally:
        proc.kill()
    assert _checkpoint_step(run / "ckpts") == 2
    assert (run / "ckpts" / "step_2" / "deepspeed").is_dir()  # written by the Ray actor worker
    assert "preempted by SIGTERM after step 2" in err.read_text()
