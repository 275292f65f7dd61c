"""Non-finite steps (docs/reliability.md): a step whose loss or gradient norm is NaN/inf changes
nothing (weights, optimizer state, learning-rate schedule) in every strategy, is counted in
``train/skipped_steps`` with its batch in ``skipped_steps.jsonl``, and too many in a row stop the
run with exit code 5 naming the last good checkpoint. Non-finite metrics are written and warned."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlhforge.cli.train_sft import main as sft_main
from rlhforge.trainers.sft import SFTTrainer
from tests.trainers.sft_helpers import sft_args, write_sft_data

ROOT = Path(__file__).parents[2]


def test_every_strategy_skips_nonfinite_steps_without_a_trace():
    """Per strategy: the NaN steps report skipped = 1 and leave the weights bitwise as they were; the
    lr does not move on them; the run's final weights equal those of a run of the good steps only
    (so Adam's moments and step count, and the scheduler, were untouched)."""
    specs = ["torch", "fsdp2", "deepspeed:0", "deepspeed:2", "deepspeed:3"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.faults.nonfinite_worker", *specs], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    for spec in specs:
        steps, ref = result[spec]["steps"], result[spec]["reference"]
        bad = [s for s in steps if s["kind"] != "good"]
        assert [s["skipped"] for s in steps] == [0.0] + [1.0] * len(bad) + [0.0], spec
        assert all(s["unchanged"] for s in bad) and not steps[0]["unchanged"] and not steps[-1]["unchanged"], spec
        # the schedule stood still on the skipped steps: the second good step uses the reference's second lr
        assert [s["lr"] for s in steps] == [ref[0]["lr"]] + [ref[1]["lr"]] * (len(bad) + 1), spec
        assert ref[0]["lr"] != ref[1]["lr"]
        assert result[spec]["final_equals_reference"], spec


def _nan_at(monkeypatch, steps: set[int]):
    """The SFT loss becomes NaN at the given (1-based) optimizer steps: the per-token NLL is multiplied
    by NaN, so the loss and every gradient are NaN. Records the weights before/after each step."""
    real_nll, real_step = SFTTrainer._token_nll, SFTTrainer.train_step
    seen: dict[int, tuple[dict, dict]] = {}

    def token_nll(self, samples, **kwargs):
        nll, mask, *aux = real_nll(self, samples, **kwargs)  # (+ the MoE aux loss when asked)
        return (nll * float("nan"), mask, *aux) if self.state.global_step + 1 in steps else (nll, mask, *aux)

    def train_step(self, indices):
        before = {k: v.clone() for k, v in self.strategy.module.state_dict().items()}
        out = real_step(self, indices)
        seen[self.state.global_step + 1] = (before, {k: v.clone() for k, v in self.strategy.module.state_dict().items()})
        return out

    monkeypatch.setattr(SFTTrainer, "_token_nll", token_nll)
    monkeypatch.setattr(SFTTrainer, "train_step", train_step)
    return seen


def _records(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_sft_skips_a_nan_step_counts_it_and_logs_its_batch(tiny_model_dir, tmp_path, monkeypatch):
    data = write_sft_data(tmp_path / "train.jsonl", n=40)  # 5 steps of 8
    clean = tmp_path / "clean"
    assert sft_main(sft_args(tiny_model_dir, data, clean)) == 0
    seen = _nan_at(monkeypatch, {3})
    out = tmp_path / "nan"
    assert sft_main(sft_args(tiny_model_dir, data, out)) == 0
    a, b = _records(clean), _records(out)
    assert [b[s]["train/skipped_steps"] for s in range(1, 6)] == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert b[3]["train/loss"] == "nan" and b[3]["train/grad_norm"] == "nan"
    before, after = seen[3]
    assert all(torch.equal(before[k], after[k]) for k in before)  # step 3 changed no weight
    assert not all(torch.equal(*[seen[4][i][k] for i in (0, 1)]) for k in before)  # step 4 did
    # the first two steps are the clean run's; the schedule did not move on step 3
    for s in (1, 2):
        assert b[s]["train/loss"] == a[s]["train/loss"]
    assert b[3]["train/lr"] == b[4]["train/lr"] == a[3]["train/lr"] and b[5]["train/lr"] == a[4]["train/lr"]
    (entry,) = [json.loads(x) for x in (out / "skipped_steps.jsonl").read_text().splitlines()]
    assert entry["step"] == 3 and entry["epoch"] == 0 and entry["step_in_epoch"] == 2
    from rlhforge.trainers.common import epoch_order

    assert entry["sample_indices"] == epoch_order(40, 42, 0)[16:24]  # the 8 samples of step 3 (seed 42)


def test_too_many_nan_steps_in_a_row_stop_with_exit_5_naming_the_checkpoint(tiny_model_dir, tmp_path, monkeypatch,
                                                                            capsys):
    data = write_sft_data(tmp_path / "train.jsonl", n=48)
    _nan_at(monkeypatch, {3, 4, 5})
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as stop:
        sft_main(sft_args(tiny_model_dir, data, out, "--ckpt.save_steps", "2", "--train.max_skipped_steps_in_row", "2"))
    assert stop.value.code == 5
    err = capsys.readouterr().err
    # the latest checkpoint is named: step_4 (its weights are step 2's: skipped steps change nothing)
    assert f"Last good checkpoint: {out / 'ckpts' / 'step_4'} (resume with --ckpt.load_enable)" in err
    assert "2 optimizer steps in a row" in err
    assert [r for r in _records(out)] == [1, 2, 3, 4]  # stopped after step 4, before step 5
    assert len((out / "skipped_steps.jsonl").read_text().splitlines()) == 2
    assert not (out / "model.safetensors").exists()


def test_nonfinite_metrics_are_written_and_warned_once(tmp_path, capsys):
    from rlhforge.tracking.metrics import MetricsLogger

    log = MetricsLogger(tmp_path)
    log.log(1, {"rollout/acc": float("nan"), "rollout/x": 1.0, "rollout/big": torch.tensor(float("inf"))})
    log.log(2, {"rollout/acc": float("nan"), "rollout/x": float("-inf")})
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["rollout/acc"], r["rollout/x"]) for r in lines] == [("nan", 1.0), ("nan", "-inf")]
    assert lines[0]["rollout/big"] == "inf"
    warnings = [x for x in capsys.readouterr().err.splitlines() if "non-finite metric" in x]
    assert len(warnings) == 2  # step 1 names acc and big; step 2 only the newly non-finite x
    assert "rollout/acc = nan" in warnings[0] and "rollout/big = inf" in warnings[0]
    assert "rollout/x = -inf" in warnings[1] and "rollout/acc" not in warnings[1]
    assert math.isnan(float(lines[1]["rollout/acc"]))


def test_rl_skips_nan_actor_updates_and_counts_them(tiny_model_dir, tmp_path):
    """GRPO, 3 RL steps of 2 actor updates each; a parameter hook makes the actor's gradients NaN in
    RL step 2: both of its updates are skipped (train/skipped_steps 0, 2, 2), their prompts are in
    skipped_steps.jsonl, and Adam has taken exactly the 4 applied updates."""
    from rlhforge.cli.train_ppo_ray import build_trainer, parse_rl_args
    from tests.rl.helpers import per_step, rl_args

    out = tmp_path / "rl"
    trainer = build_trainer(parse_rl_args(rl_args(tiny_model_dir, out, steps=3)))
    strategy = trainer.actor.local.strategy
    param = next(p for p in strategy.module.parameters() if p.requires_grad)
    param.register_hook(lambda g: g * float("nan") if trainer.state.global_step == 1 else g)
    try:
        trainer.fit()
    finally:
        trainer.logger.close()
    assert per_step(out, "train/skipped_steps") == {1: 0.0, 2: 2.0, 3: 2.0}
    entries = [json.loads(x) for x in (out / "skipped_steps.jsonl").read_text().splitlines()]
    assert [(e["step"], e["model"]) for e in entries] == [(2, "actor"), (2, "actor")]
    assert all(len(e["samples"]) == 4 and all("What is" in s["prompt"] for s in e["samples"]) for e in entries)
    assert int(strategy.optimizer.state[param]["step"]) == 4
