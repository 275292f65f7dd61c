"""One run per folder (issue 47): checkpoints follow the output folder, a fresh run into a folder holding
another run is refused (exit 2) unless it resumes or overwrites, and a resume takes its own run's checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhforge.config.parsing import ConfigError, parse_args
from rlhforge.config.sft import SFTConfig


def _fake_run(out: Path, ckpt_dir: Path, steps=(100, 125)) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train/loss": 1.0}) + "\n" for s in (5, 125)))
    (out / "samples.jsonl").write_text("{}\n")
    for s in steps:
        (ckpt_dir / f"step_{s}").mkdir(parents=True)
        (ckpt_dir / f"step_{s}" / "trainer_state.json").write_text(json.dumps({"global_step": s}))
    (ckpt_dir / "latest").write_text(f"step_{steps[-1]}")


def _ckpt(*argv):
    return parse_args(SFTConfig, ["--model.model_name_or_path", "x", "--data.dataset", "builtin:arithmetic",
                                  *argv]).ckpt


def test_checkpoints_follow_the_output_folder_unless_set():
    assert _ckpt().checkpoint_dir == "./ckpt/checkpoints_sft"  # OpenRLHF's default folder
    assert _ckpt("--ckpt.output_dir", "runs/sft_zero3").checkpoint_dir == "runs/sft_zero3/checkpoints_sft"
    assert _ckpt("--ckpt.output_dir", "runs/a", "--ckpt.path", "elsewhere").checkpoint_dir == "elsewhere"
    from rlhforge.config.dpo import DPOConfig
    from rlhforge.config.rl import RLConfig
    from rlhforge.config.rm import RMConfig

    assert [c().ckpt.checkpoint_dir for c in (RMConfig, DPOConfig, RLConfig)] == [
        "./ckpt/checkpoints_rm", "./ckpt/checkpoints_dpo", "./ckpt/checkpoints_ppo_ray"]


def test_a_fresh_run_into_a_folder_holding_another_is_refused_or_overwritten(tmp_path):
    from rlhforge.trainers.run_folder import check_run_folder

    out = tmp_path / "runs" / "sft_tiny"
    _fake_run(out, out / "checkpoints_sft")
    cfg = _ckpt("--ckpt.output_dir", str(out))
    with pytest.raises(ConfigError) as err:
        check_run_folder(cfg)
    assert str(err.value) == (
        f"--ckpt.output_dir {out} already holds a run (metrics.jsonl with 2 record(s) up to step 125; checkpoint(s) "
        f"step_100, step_125 in {out}/checkpoints_sft): --ckpt.load_enable resumes it, --ckpt.overwrite deletes it "
        "and starts over, or choose another --ckpt.output_dir")
    check_run_folder(_ckpt("--ckpt.output_dir", str(out), "--ckpt.load_enable"))  # a resume: allowed, untouched
    assert (out / "metrics.jsonl").is_file() and (out / "checkpoints_sft" / "step_125").is_dir()
    check_run_folder(_ckpt("--ckpt.output_dir", str(tmp_path / "other")))  # a new folder: nothing to say
    lines = []
    check_run_folder(_ckpt("--ckpt.output_dir", str(out), "--ckpt.overwrite"), is_rank0=True, log=lines.append)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints_sft"]
    assert list((out / "checkpoints_sft").iterdir()) == []
    assert lines == [f"[rlhforge] --ckpt.overwrite: deleted the earlier run in {out} (metrics.jsonl with 2 record(s) "
                     f"up to step 125; checkpoint(s) step_100, step_125 in {out}/checkpoints_sft)"]
    check_run_folder(cfg)  # now empty: a fresh run may start


@pytest.mark.timeout(600)
def test_the_readme_sft_commands_back_to_back_then_resumed(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """README's quick SFT (examples/sft_tiny.yaml) and its second command, which overrides only
    --ckpt.output_dir (README runs it under torchrun with ZeRO-3; the folders do not depend on the strategy,
    so both run in one process here), then the second again with --ckpt.load_enable: no checkpoint of
    either run is lost, ``latest`` names a complete folder in each, and the resume takes its own run's
    checkpoint. Before issue 47 both shared runs/sft_tiny/checkpoints and the resume took the first run's."""
    from rlhforge.backend.checkpoint import latest_checkpoint, list_checkpoints
    from rlhforge.cli.train_sft import main

    monkeypatch.chdir(tmp_path)
    root = Path(__file__).resolve().parents[2]
    common = ["--config", str(root / "examples" / "sft_tiny.yaml"), "--model.model_name_or_path", str(tiny_model_dir),
              "--data.dataset", "builtin:arithmetic?n=256", "--eval.dataset", "builtin:arithmetic?n=16@test",
              "--ckpt.save_steps", "2", "--logger.progress_bar", "off"]
    assert main([*common, "--train.max_steps", "4"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (  # the one line a training command ends with
        "[rlhforge] sft finished: final model (HF folder) in runs/sft_tiny; metrics in runs/sft_tiny/metrics.jsonl; "
        "2 resumable checkpoint(s) in runs/sft_tiny/checkpoints_sft (latest step_4)")
    assert main([*common, "--train.max_steps", "2", "--ckpt.output_dir", "runs/sft_zero3"]) == 0
    first, second = Path("runs/sft_tiny/checkpoints_sft"), Path("runs/sft_zero3/checkpoints_sft")
    assert [s for s, _ in list_checkpoints(first)] == [2, 4] and [s for s, _ in list_checkpoints(second)] == [2]
    capsys.readouterr()
    assert main([*common, "--train.max_steps", "4", "--ckpt.output_dir", "runs/sft_zero3", "--ckpt.load_enable",
                 "--ckpt.allow_config_change"]) == 0  # (a longer run: max_steps 2 -> 4)
    assert f"resuming from {second / 'step_2'}" in capsys.readouterr().out
    assert [s for s, _ in list_checkpoints(first)] == [2, 4] and [s for s, _ in list_checkpoints(second)] == [2, 4]
    assert latest_checkpoint(first) == first / "step_4" and latest_checkpoint(second) == second / "step_4"
    steps = [json.loads(x)["step"] for x in Path("runs/sft_zero3/metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == 4  # one curve, resumed in order
    with pytest.raises(SystemExit) as exit_:  # the first command again, as it is: refused, naming both flags
        main([*common, "--train.max_steps", "4"])
    assert exit_.value.code == 2
    assert "--ckpt.output_dir runs/sft_tiny already holds a run" in capsys.readouterr().err
