"""DeepSpeed's just-in-time built ops (``cpu_adam``, ``deepspeed_shm_comm``): stale build locks cleared, and a
prebuild for the test suite.

DeepSpeed builds these C++ ops with ``torch.utils.cpp_extension.load`` the first time a process needs them (a
ZeRO engine on CPU: ``shm_comm`` in ``init_distributed``; ``--ds.adam_offload``: ``cpu_adam``). torch guards
each build with a ``lock`` file in the op's build folder and waits, with no timeout, for as long as that file
exists. A build that is killed (a timeout, Ctrl-C, an OOM kill) leaves the file behind, so every later run
that needs the op would wait forever.

:func:`clear_stale_build_locks` removes such files, each with one line naming it. A lock counts as stale only
when it is older than ``min_age_s`` and no process on this machine has its working directory in that build
folder (torch runs ``ninja`` there while it builds), so a build in progress is left alone.
:func:`prebuild` builds the ops once, outside any time limit (``scripts/test.sh`` runs it before the suite:
torch's build hash includes the venv's paths, so a fresh venv rebuilds them, which takes minutes).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

logger = logging.getLogger(__name__)

# the ops a CPU run builds: ZeRO's shared-memory collectives on CPU, and the offloaded Adam
CPU_OPS = ("ShareMemCommBuilder", "CPUAdamBuilder")
STALE_AFTER_S = 120.0


def extension_roots() -> list[Path]:
    """The folders torch builds extensions under: ``TORCH_EXTENSIONS_DIR``, else its default root (whose
    sub-folders, e.g. ``py311_cpu``, hold one folder per op)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return [Path(root)]
    from torch.utils.cpp_extension import get_default_build_root

    return [Path(get_default_build_root())]


def _working_dirs() -> set[Path]:
    """The working directories of this machine's processes that can be read (Linux ``/proc``; empty elsewhere)."""
    found: set[Path] = set()
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                found.add(Path(os.readlink(entry / "cwd")))
            except OSError:
                continue
    return found


def stale_build_locks(roots: list[Path] | None = None, min_age_s: float = STALE_AFTER_S) -> list[Path]:
    """The ``lock`` files in the op folders under ``roots`` (one or two levels down) that are older than
    ``min_age_s`` seconds and whose folder no process is working in."""
    now = time.time()
    locks = []
    for root in roots if roots is not None else extension_roots():
        if root.is_dir():
            locks += list(root.glob("*/lock")) + list(root.glob("*/*/lock"))
    if not locks:
        return []
    busy = _working_dirs()
    stale = []
    for lock in locks:
        try:
            age = now - lock.stat().st_mtime
        except FileNotFoundError:  # released meanwhile
            continue
        folder = lock.parent.resolve()
        in_use = any(d == folder or folder in d.parents for d in busy)
        if age >= min_age_s and not in_use:
            stale.append(lock)
    return stale


def clear_stale_build_locks(roots: list[Path] | None = None, min_age_s: float = STALE_AFTER_S) -> list[Path]:
    """Remove the stale build locks (:func:`stale_build_locks`), logging one warning line per file; return them."""
    removed = []
    for lock in stale_build_locks(roots, min_age_s):
        try:
            age_min = (time.time() - lock.stat().st_mtime) / 60
            lock.unlink()
        except FileNotFoundError:
            continue
        logger.warning("removed a stale build lock %s (%.0f min old, no build running in its folder): a build of "
                       "this op was killed; torch would have waited for it forever", lock, age_min)
        removed.append(lock)
    return removed


def prebuild(names: tuple[str, ...] = CPU_OPS) -> dict[str, str]:
    """Build (or load, where already built) DeepSpeed's ops ``names`` after clearing stale locks. Returns each
    op's outcome: ``"built or loaded in N s"``, ``"not compatible"``, or ``"failed: "`` and the error's first line
    (an op that fails to build is reported here and again by the run that needs it, never raised)."""
    clear_stale_build_locks()
    from deepspeed.accelerator import get_accelerator

    outcome = {}
    for name in names:
        start = time.perf_counter()
        try:
            builder = get_accelerator().create_op_builder(name)
            if builder is None or not builder.is_compatible(verbose=False):
                outcome[name] = "not compatible"
                continue
            builder.load(verbose=False)
            outcome[name] = f"built or loaded in {time.perf_counter() - start:.0f} s"
        except Exception as exc:  # noqa: BLE001 - reported, and the run that needs the op fails with it
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            outcome[name] = f"failed: {type(exc).__name__}: {first}"
    return outcome


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed: no "unable to detect" warning
    for name, result in prebuild().items():
        print(f"deepspeed op {name}: {result}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
