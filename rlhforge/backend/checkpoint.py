"""Resumable checkpoints: ``<ckpt.path>/step_<N>/`` holding the strategy's model/optimizer/scheduler
state, every rank's RNG state, the trainer's counters (``trainer_state.json``) and optionally an HF
export (``hf/``) and the run's resolved config (``config.json``, compared on resume). Written into
``step_<N>.tmp`` and renamed once complete, then ``latest`` is replaced atomically, so an
interrupted save never damages the previous checkpoint. A save that fails (no space, permission,
file too large) removes its ``step_<N>.tmp`` and raises :class:`CheckpointWriteError` naming the
path and the operating system's cause; earlier checkpoints and ``latest`` stay as they were.
Rotation keeps the newest ``max_num`` (plus any protected, e.g. the best one)."""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

_STEP_DIR = re.compile(r"^step_(\d+)$")
_PARTIAL = re.compile(r"^(step_\d+\.tmp|\.latest\.tmp\d+)$")
CONFIG_FILE = "config.json"


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the message names the folder and the cause."""


def os_error_in(err: BaseException | None) -> OSError | None:
    """The first :class:`OSError` in ``err``'s chain (torch's writer hides it behind a RuntimeError)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError) and err.errno is not None:
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def describe_os_error(err: OSError) -> str:
    name = errno.errorcode.get(err.errno, str(err.errno))
    where = f" ({err.filename})" if err.filename else ""
    return f"{err.strerror or err} [{name}]{where}"


def torch_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` through a Python file, so a failed write raises the operating system's
    ``OSError`` (errno, path) instead of torch's ``unexpected pos`` RuntimeError."""
    path = Path(path)
    try:
        with open(path, "wb") as f:
            torch.save(obj, f)
    except (OSError, RuntimeError) as err:
        found = os_error_in(err)
        if found is None:
            raise
        raise OSError(found.errno, found.strerror, str(path)) from err


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it over ``path``; on failure
    the temporary file is removed and ``path`` is untouched."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def remove_partial_saves(root: str | Path) -> list[str]:
    """Remove what interrupted saves left in ``root`` (``step_N.tmp`` folders, ``.latest.tmpPID``);
    returns their names. Never touches a complete ``step_N`` or ``latest``."""
    root = Path(root)
    if not root.is_dir():
        return []
    removed = []
    for child in sorted(root.iterdir()):
        if _PARTIAL.match(child.name):
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)
            removed.append(child.name)
    return removed


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and (child / "trainer_state.json").is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    root = Path(root)
    marker = root / "latest"
    if marker.is_file():
        candidate = root / marker.read_text().strip()
        if (candidate / "trainer_state.json").is_file():
            return candidate
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def save_checkpoint(
    strategy,
    root: str | Path,
    step: int,
    trainer_state: dict[str, Any],
    *,
    max_num: int = 3,
    max_mem_gb: float | None = None,
    protected: tuple[str, ...] = (),
    export_hf=None,
    config: dict[str, Any] | None = None,
) -> Path:
    """All ranks call this. ``export_hf(dir)`` (optional) writes an HF folder from rank 0; ``config``
    (the run's resolved config as a plain dict) is kept as ``config.json`` for the resume check.
    Raises :class:`CheckpointWriteError` on every rank when any rank's write failed."""
    root = Path(root)
    final = root / f"step_{step}"
    tmp = root / f"step_{step}.tmp"
    failure: BaseException | None = None
    if strategy.is_rank0:
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        except OSError as err:
            failure = err
    if not _any_failed(strategy, failure is not None):
        try:
            strategy.save_state(tmp)
            torch_save(rng_state(), tmp / f"rng_state_rank{strategy.rank}.pt")
            if export_hf is not None:
                export_hf(tmp / "hf")
        except (OSError, RuntimeError) as err:  # RuntimeError: torch's writer, a worker group's error
            failure = err
    if not _any_failed(strategy, failure is not None) and strategy.is_rank0:
        try:
            (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
            if config is not None:
                (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=1, default=str))
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            write_text_atomic(root / "latest", final.name)
        except OSError as err:
            failure = err
    if _any_failed(strategy, failure is not None):
        raise _write_error(strategy, root, tmp, failure)
    if strategy.is_rank0:  # never the one just written (a folder may hold higher steps of an earlier run)
        rotate_checkpoints(root, max_num, protected=protected, max_mem_gb=max_mem_gb, current=final.name)
    strategy.barrier()
    return final


def _any_failed(strategy, failed: bool) -> bool:
    """Whether any rank failed (an all-reduce of the flag where the strategy has one, else a barrier)."""
    reduce = getattr(strategy, "all_reduce", None)
    if reduce is None or getattr(strategy, "world_size", 1) <= 1:
        strategy.barrier()
        return failed
    flag = torch.tensor(1.0 if failed else 0.0, device=getattr(strategy, "device", None))
    return float(reduce(flag, op="max")) > 0


def _cause(err: BaseException | None, tmp: Path, root: Path) -> str:
    """The operating system's reason: from the error's chain, else from a 1 MiB test write."""
    if err is None:
        return "another rank's write failed (see its message)"
    found = os_error_in(err)
    if found is not None:
        return describe_os_error(found)
    probe_dir = tmp if tmp.is_dir() else root if root.is_dir() else None
    if probe_dir is not None:
        probe = probe_dir / f".write_probe{os.getpid()}"
        try:
            with open(probe, "wb") as f:
                f.write(b"\0" * 2**20)
                f.flush()
                os.fsync(f.fileno())
        except OSError as probe_err:
            return f"{describe_os_error(probe_err)}; the writer said: {str(err)[:200]}"
        finally:
            probe.unlink(missing_ok=True)
    free = shutil.disk_usage(probe_dir).free / 2**20 if probe_dir is not None else float("nan")
    return f"{type(err).__name__}: {str(err)[:300]} ({free:.0f} MiB free there)"


def _write_error(strategy, root: Path, tmp: Path, err: BaseException | None) -> CheckpointWriteError:
    cause = _cause(err, tmp, root)
    if strategy.is_rank0:
        shutil.rmtree(tmp, ignore_errors=True)
    marker = root / "latest"
    kept = marker.read_text().strip() if marker.is_file() else None
    left = f"latest still names {kept}" if kept else "no earlier checkpoint exists"
    failed = CheckpointWriteError(f"could not write checkpoint {tmp}: {cause}; the partial folder was removed and "
                                  f"earlier checkpoints are untouched ({left})")
    failed.path = tmp  # type: ignore[attr-defined]
    return failed


def _size_gb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**30


def rotate_checkpoints(
    root: Path, max_num: int, protected: tuple[str, ...] = (), max_mem_gb: float | None = None,
    current: str | None = None,
) -> None:
    """Keep the newest ``max_num`` unprotected checkpoints, then drop the oldest while the total size
    exceeds ``max_mem_gb``. The newest checkpoint is never removed, nor ``current`` (the one just written,
    which counts toward ``max_num``: a folder may hold higher steps of an earlier run)."""
    found = [p for _, p in list_checkpoints(root) if p.name not in protected and p.name != current]
    keep = max_num - (current is not None and (root / current).is_dir())
    if max_num > 0:
        for path in (found[:-keep] if keep > 0 else found):
            shutil.rmtree(path, ignore_errors=True)
        found = found[-keep:] if keep > 0 else []
    if max_mem_gb is not None:
        sizes = [_size_gb(p) for p in found]
        kept = _size_gb(root / current) if current is not None and (root / current).is_dir() else 0.0
        least = 0 if current is not None else 1  # the newest (or the current one, kept aside) always stays
        while len(found) > least and sum(sizes) + kept > max_mem_gb:
            shutil.rmtree(found.pop(0), ignore_errors=True)
            sizes.pop(0)


def checkpoint_config(directory: str | Path) -> dict[str, Any] | None:
    """The resolved config a checkpoint was written with (None for checkpoints without one)."""
    path = Path(directory) / CONFIG_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def load_checkpoint(strategy, directory: str | Path) -> dict[str, Any]:
    """Restore strategy state and this rank's RNG; returns the trainer state dict."""
    directory = Path(directory)
    state_file = directory / "trainer_state.json"
    if not state_file.is_file():
        raise FileNotFoundError(f"{directory}: not a complete checkpoint (no trainer_state.json)")
    strategy.load_state(directory)
    rng_file = directory / f"rng_state_rank{strategy.rank}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return json.loads(state_file.read_text())
