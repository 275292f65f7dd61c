"""A run folder holds one run: the start-up rule for ``--ckpt.output_dir`` (issue 47).

A fresh run (no ``--ckpt.load_enable``) into an output folder that already holds another run's
``metrics.jsonl`` or checkpoints would append its steps to the old curve (steps 1, 2, ... after 125) and
rotate its checkpoints among the other run's. It is refused at start-up (exit 2) naming the folder and the
two flags: ``--ckpt.load_enable`` resumes that run, ``--ckpt.overwrite`` deletes its metrics and
checkpoints first. A resume that finds no checkpoint starts cleanly: its stale metrics are set aside
(:func:`rlhforge.trainers.common.resume_trainer_state`, ``metrics.discarded.jsonl``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from rlhforge.backend.checkpoint import list_checkpoints
from rlhforge.config.parsing import ConfigError

__all__ = ["RUN_FILES", "check_run_folder", "logged_steps", "finished_line", "announce_finished"]

#: what a run appends to in its output folder (deleted by --ckpt.overwrite)
RUN_FILES = ("metrics.jsonl", "metrics.discarded.jsonl", "samples.jsonl", "skipped_steps.jsonl")


def logged_steps(metrics: Path) -> list[int]:
    """The steps recorded in a ``metrics.jsonl`` (unreadable lines are skipped)."""
    if not metrics.is_file():
        return []
    steps = []
    for line in metrics.read_text().splitlines():
        try:
            steps.append(int(json.loads(line).get("step", 0)))
        except (ValueError, AttributeError):
            continue
    return steps


def _describe(out: Path, steps: list[int], ckpts: list[tuple[int, Path]], ckpt_dir: Path) -> str:
    parts = []
    if steps:
        parts.append(f"metrics.jsonl with {len(steps)} record(s) up to step {max(steps)}")
    if ckpts:
        names = ", ".join(p.name for _, p in ckpts[-3:])
        parts.append(f"checkpoint(s) {names} in {ckpt_dir}")
    return "; ".join(parts)


def check_run_folder(ckpt_cfg, *, is_rank0: bool | None = None, log=print) -> None:
    """Refuse (ConfigError) a fresh run into a folder holding another run, or with ``--ckpt.overwrite``
    delete that run's metrics and checkpoints (rank 0). Nothing to do when resuming (``load_enable``)."""
    if ckpt_cfg.load_enable:
        return
    out, ckpt_dir = Path(ckpt_cfg.output_dir), Path(ckpt_cfg.checkpoint_dir)
    steps = logged_steps(out / "metrics.jsonl")
    ckpts = list_checkpoints(ckpt_dir)
    if not steps and not ckpts:
        return
    held = _describe(out, steps, ckpts, ckpt_dir)
    if not ckpt_cfg.overwrite:
        raise ConfigError(f"--ckpt.output_dir {out} already holds a run ({held}): --ckpt.load_enable resumes it, "
                          "--ckpt.overwrite deletes it and starts over, or choose another --ckpt.output_dir")
    if is_rank0 is None:
        is_rank0 = int(os.environ.get("RANK", "0")) == 0
    if not is_rank0:
        return
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    for _, path in ckpts:
        shutil.rmtree(path, ignore_errors=True)
    for name in ("latest", "best"):
        (ckpt_dir / name).unlink(missing_ok=True)
    log(f"[rlhforge] --ckpt.overwrite: deleted the earlier run in {out} ({held})")


def finished_line(command: str, ckpt_cfg) -> str | None:
    """The one line a training command ends with (rank 0; None elsewhere): where the final model, the metrics
    and the checkpoints are."""
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    out = Path(ckpt_cfg.output_dir)
    parts = [f"final model (HF folder) in {out}", f"metrics in {out / 'metrics.jsonl'}"]
    ckpts = list_checkpoints(ckpt_cfg.checkpoint_dir)
    if ckpts:
        parts.append(f"{len(ckpts)} resumable checkpoint(s) in {ckpt_cfg.checkpoint_dir} (latest {ckpts[-1][1].name})")
    return f"[rlhforge] {command} finished: " + "; ".join(parts)


def announce_finished(command: str, ckpt_cfg) -> None:
    """Print :func:`finished_line` (rank 0)."""
    line = finished_line(command, ckpt_cfg)
    if line:
        print(line, flush=True)
