"""Resume edge cases (docs/reliability.md): nothing to resume starts fresh with one notice line (and
removes what interrupted saves left); a checkpoint at an epoch boundary resumes into the next epoch
and trains it exactly as the straight run; a config that differs from the checkpoint's is printed,
and changes that break exact resumption are refused (exit 2) unless --ckpt.allow_config_change."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rlhforge.cli.train_sft import main as sft_main
from tests.trainers.sft_helpers import sft_args, write_sft_data

KEYS = ("train/loss", "train/grad_norm", "train/lr", "train/epoch")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def straight(tiny_model_dir, tmp_path_factory):
    """2 epochs of 6 steps, a checkpoint at step 6 (the end of epoch 1) and at the end."""
    root = tmp_path_factory.mktemp("edges")
    data = write_sft_data(root / "train.jsonl", n=48)
    run = root / "straight"
    assert sft_main(sft_args(tiny_model_dir, data, run, "--train.max_epochs", "2", "--ckpt.save_steps", "6")) == 0
    return data, run


def _curve(run: Path) -> dict[int, dict]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: r[k] for k in KEYS} for r in lines}


def _from_epoch_end(straight_run: Path, run: Path) -> Path:
    """A new run directory holding only the straight run's step-6 checkpoint."""
    (run / "ckpts").mkdir(parents=True)
    shutil.copytree(straight_run / "ckpts" / "step_6", run / "ckpts" / "step_6")
    (run / "ckpts" / "latest").write_text("step_6")
    return run


def test_missing_or_empty_checkpoint_folder_starts_fresh_with_one_notice(tiny_model_dir, straight, tmp_path, capsys):
    data, ref = straight
    missing = tmp_path / "missing"
    assert sft_main(sft_args(tiny_model_dir, data, missing, "--train.max_epochs", "2", "--ckpt.save_steps", "6",
                             "--ckpt.load_enable")) == 0
    out = capsys.readouterr().out
    notices = [x for x in out.splitlines() if "--ckpt.load_enable" in x]
    assert notices == [f"[rlhforge] --ckpt.load_enable: {missing / 'ckpts'} does not exist; starting from step 0"]
    assert _curve(missing) == _curve(ref)
    # a folder with only what interrupted saves leave: removed, one notice, a fresh start
    empty = tmp_path / "empty"
    (empty / "ckpts" / "step_3.tmp").mkdir(parents=True)
    (empty / "ckpts" / "step_3.tmp" / "torch_state.pt").write_bytes(b"")
    (empty / "ckpts" / ".latest.tmp4242").write_text("")
    assert sft_main(sft_args(tiny_model_dir, data, empty, "--train.max_steps", "2", "--ckpt.load_enable")) == 0
    notices = [x for x in capsys.readouterr().out.splitlines() if "--ckpt.load_enable" in x]
    assert len(notices) == 1 and "holds no complete checkpoint" in notices[0]
    assert "removed interrupted save(s) .latest.tmp4242, step_3.tmp" in notices[0]
    assert not list((empty / "ckpts").glob("*tmp*")) and not list(empty.glob("*.tmp"))


def test_checkpoint_at_an_epoch_boundary_resumes_into_the_next_epoch(tiny_model_dir, straight, tmp_path, capsys):
    data, ref = straight
    run = _from_epoch_end(ref, tmp_path / "resumed")
    assert sft_main(sft_args(tiny_model_dir, data, run, "--train.max_epochs", "2", "--ckpt.save_steps", "6",
                             "--ckpt.load_enable")) == 0
    out = capsys.readouterr().out
    assert (f"[rlhforge] resuming from {run / 'ckpts' / 'step_6'}: steps 1-6 of 12 are done; next is step 7 "
            "(epoch 2, step 1 of 6 in it)") in out.splitlines()
    got, want = _curve(run), _curve(ref)
    assert sorted(got) == list(range(7, 13))  # epoch 2 was trained, step by step
    assert all(1.0 < got[s]["train/epoch"] <= 2.0 for s in got)
    assert got == {s: want[s] for s in range(7, 13)}
    assert (run / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()
    # only the output folders differ from the checkpoint's config: printed, not refused
    (diff,) = [x for x in out.splitlines() if "differ from" in x]
    assert "ckpt.output_dir" in diff and "ckpt.path" in diff and "train." not in diff


def test_changes_that_break_exact_resumption_are_refused_unless_allowed(tiny_model_dir, straight, tmp_path, capsys):
    data, ref = straight
    run = _from_epoch_end(ref, tmp_path / "changed")
    base = sft_args(tiny_model_dir, data, run, "--train.max_epochs", "2", "--ckpt.save_steps", "6", "--ckpt.load_enable")
    changed = [*base, "--train.batch_size", "4", "--train.seed", "7", "--data.max_len", "48"]
    with pytest.raises(SystemExit) as refused:
        sft_main(changed)
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert "3 change(s) would break exact resumption" in err
    for item in ("data.max_len: 64 -> 48", "train.batch_size: 8 -> 4", "train.seed: 42 -> 7"):
        assert item in err, item
    assert "--ckpt.allow_config_change" in err
    assert not (run / "metrics.jsonl").exists() and (run / "ckpts" / "latest").read_text() == "step_6"
    # a performance knob is printed and allowed; the curve is the same up to float rounding
    assert sft_main([*base, "--train.micro_batch_size", "2"]) == 0
    out = capsys.readouterr().out
    assert "train.micro_batch_size: 4 -> 2" in out and "break exact" not in out
    got, want = _curve(run), _curve(ref)
    for s in range(7, 13):
        assert got[s]["train/loss"] == pytest.approx(want[s]["train/loss"], abs=1e-5)
    # the refused change goes through when the user says so
    shutil.rmtree(run)
    _from_epoch_end(ref, run)
    assert sft_main([*changed, "--ckpt.allow_config_change"]) == 0
    out = capsys.readouterr().out
    assert "--ckpt.allow_config_change: resuming with data.max_len, train.batch_size, train.seed changed" in out


def test_resume_after_the_last_step_says_nothing_is_left(tiny_model_dir, straight, tmp_path, capsys):
    data, ref = straight
    run = tmp_path / "finished"
    (run / "ckpts").mkdir(parents=True)
    shutil.copytree(ref / "ckpts" / "step_12", run / "ckpts" / "step_12")
    (run / "ckpts" / "latest").write_text("step_12")
    assert sft_main(sft_args(tiny_model_dir, data, run, "--train.max_epochs", "2", "--ckpt.save_steps", "6",
                             "--ckpt.load_enable")) == 0
    out = capsys.readouterr().out
    assert (f"[rlhforge] resume: {run / 'ckpts' / 'step_12'} is the run's last step (12 of 12): nothing left to "
            "train") in out
    assert not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip()
    assert (run / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()
