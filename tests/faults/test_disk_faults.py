"""Disk and write failures (docs/reliability.md): a checkpoint that cannot be written stops the run
with a message naming the folder and the operating system's cause (exit 6), removes its partial
``step_N.tmp`` and leaves the earlier checkpoints and ``latest`` untouched; config.yaml is written
atomically and leaves no ``.tmp`` behind.

How the failure is made real as root (where chmod does not stop writes and no tmpfs can be
mounted): the child process runs under ``ulimit -f`` (RLIMIT_FSIZE, the largest file a process may
write, enforced for root too), so writing the checkpoint fails in the kernel with EFBIG ("File too
large") exactly where a full disk fails with ENOSPC: in the middle of the write, after the file
was created. Reading (loading the earlier checkpoint) is not limited.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlhforge.cli.train_sft import main as sft_main
from tests.trainers.sft_helpers import sft_args, write_sft_data

ROOT = Path(__file__).parents[2]


def _limited(argv: list[str], kib: int) -> subprocess.CompletedProcess:
    """``argv`` (a Python module and its arguments) in a child whose files may not exceed ``kib`` KiB."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    cmd = f"ulimit -f {kib} && exec {shlex.quote(sys.executable)} -m {' '.join(map(shlex.quote, argv))}"
    return subprocess.run(["bash", "-c", cmd], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_failed_checkpoint_write_stops_naming_path_and_cause(tiny_model_dir, tmp_path):
    data = write_sft_data(tmp_path / "train.jsonl", n=48)
    run = tmp_path / "run"
    common = ["--ckpt.save_steps", "2", "--logger.progress_bar", "off"]
    assert sft_main(sft_args(tiny_model_dir, data, run, *common)) == 0
    ckpts = run / "ckpts"
    # the run as it stood after its step-2 checkpoint
    for later in ("step_4", "step_6"):
        shutil.rmtree(ckpts / later)
    (ckpts / "latest").write_text("step_2")
    kept = _digest(ckpts / "step_2")
    # resume with files limited to 1 MiB: steps 3 and 4 train, the step-4 checkpoint (~8 MB) cannot be written
    proc = _limited(["rlhforge.cli.train_sft", *sft_args(tiny_model_dir, data, run, *common, "--ckpt.load_enable")],
                    kib=1024)
    assert proc.returncode == 6, proc.stderr[-3000:]
    line = next(x for x in proc.stderr.splitlines() if "could not write checkpoint" in x)
    assert str(ckpts / "step_4.tmp") in line and "File too large [EFBIG]" in line and "torch_state.pt" in line
    assert "latest still names step_2" in line
    assert "Traceback" not in proc.stderr and "unexpected pos" not in proc.stderr
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_2"]  # no step_4.tmp left
    assert (ckpts / "latest").read_text() == "step_2" and _digest(ckpts / "step_2") == kept
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_torch_writers_errno_less_failure_gets_its_cause(tmp_path):
    """A strategy that saves with ``torch.save(obj, path)`` (DeepSpeed does) fails with torch's
    "unexpected pos" and no errno; the message still names the cause, found by a test write."""
    root = tmp_path / "ckpts"
    (root / "step_1").mkdir(parents=True)
    (root / "step_1" / "trainer_state.json").write_text('{"global_step": 1}')
    (root / "latest").write_text("step_1")
    proc = _limited(["tests.faults.disk_worker", "ckpt", str(root)], kib=512)
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result["error"] == "CheckpointWriteError", proc.stderr[-2000:]
    assert str(root / "step_2.tmp") in result["message"] and "File too large [EFBIG]" in result["message"]
    assert "unexpected pos" in result["message"]  # what torch said, kept after the cause
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1"]
    assert (root / "latest").read_text() == "step_1"


def test_config_yaml_write_is_atomic_and_cleans_up(tmp_path):
    path = tmp_path / "run" / "config.yaml"
    path.parent.mkdir()
    path.write_text("previous: config\n")
    proc = _limited(["tests.faults.disk_worker", "yaml", str(path)], kib=1)  # the SFT config is ~2 KiB
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result["errno"] == 27 and "config.yaml.tmp" in result["message"], result  # EFBIG, naming the file
    assert path.read_text() == "previous: config\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["config.yaml"]


def test_an_unwritable_run_dir_is_one_line_and_exit_6(tiny_model_dir, tmp_path, capsys):
    """The run directory cannot be made (its parent is a regular file: a real NotADirectoryError, root
    or not): the CLI ends with one line naming config.yaml and the cause, exit 6, no traceback."""
    from rlhforge.cli.train_sft import main as sft_main
    from tests.trainers.sft_helpers import sft_args, write_sft_data

    blocker = tmp_path / "afile"
    blocker.write_text("not a folder\n")
    data = write_sft_data(tmp_path / "sft.jsonl", n=8)
    with pytest.raises(SystemExit) as stop:
        sft_main(sft_args(tiny_model_dir, data, blocker / "run", "--train.max_steps", "1"))
    assert stop.value.code == 6
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(blocker / "run" / "config.yaml") in err[0] and "Not a directory" in err[0], err
    assert "Traceback" not in "\n".join(err)
