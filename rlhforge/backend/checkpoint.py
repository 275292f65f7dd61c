"""Resumable checkpoints: ``<ckpt.path>/step_<N>/`` holding the strategy's model/optimizer/scheduler
state, every rank's RNG state, the trainer's counters (``trainer_state.json``) and optionally an HF
export (``hf/``). Written into ``step_<N>.tmp`` and renamed once complete, then ``latest`` is
replaced atomically, so an interrupted save never damages the previous checkpoint. Rotation keeps
the newest ``max_num`` (plus any protected, e.g. the best one)."""

from __future__ import annotations

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
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


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
) -> Path:
    """All ranks call this. ``export_hf(dir)`` (optional) writes an HF folder from rank 0."""
    root = Path(root)
    final = root / f"step_{step}"
    tmp = root / f"step_{step}.tmp"
    if strategy.is_rank0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    strategy.barrier()
    strategy.save_state(tmp)
    torch.save(rng_state(), tmp / f"rng_state_rank{strategy.rank}.pt")
    if export_hf is not None:
        export_hf(tmp / "hf")
    strategy.barrier()
    if strategy.is_rank0:
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state, indent=2))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        write_text_atomic(root / "latest", final.name)
        rotate_checkpoints(root, max_num, protected=protected, max_mem_gb=max_mem_gb)
    strategy.barrier()
    return final


def _size_gb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**30


def rotate_checkpoints(
    root: Path, max_num: int, protected: tuple[str, ...] = (), max_mem_gb: float | None = None
) -> None:
    """Keep the newest ``max_num`` unprotected checkpoints, then drop the oldest while the total size
    exceeds ``max_mem_gb``. The newest checkpoint is never removed."""
    found = [p for _, p in list_checkpoints(root) if p.name not in protected]
    if max_num > 0:
        for path in found[:-max_num]:
            shutil.rmtree(path, ignore_errors=True)
        found = found[-max_num:]
    if max_mem_gb is not None:
        sizes = [_size_gb(p) for p in found]
        while len(found) > 1 and sum(sizes) > max_mem_gb:
            shutil.rmtree(found.pop(0), ignore_errors=True)
            sizes.pop(0)


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
