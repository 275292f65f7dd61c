"""Stale build locks of just-in-time built ops (rlhforge/backend/jit_ops.py): a killed build's ``lock`` makes
torch wait forever; an old lock with no build running is removed, a young one or one whose folder a process
is working in is kept."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from rlhforge.backend.jit_ops import clear_stale_build_locks, extension_roots, stale_build_locks


def _lock(folder: Path, age_s: float) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / "lock"
    lock.touch()
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_old_lock_with_no_build_is_removed_young_one_kept(tmp_path, caplog):
    old = _lock(tmp_path / "py311_cpu" / "cpu_adam", age_s=600)  # two levels down (the default root's layout)
    young = _lock(tmp_path / "deepspeed_shm_comm", age_s=5)  # one level (TORCH_EXTENSIONS_DIR's layout)
    with caplog.at_level(logging.WARNING, logger="rlhforge.backend.jit_ops"):
        removed = clear_stale_build_locks([tmp_path], min_age_s=120)
    assert removed == [old]
    assert not old.exists() and young.exists()
    assert str(old) in caplog.text and "10 min old" in caplog.text
    assert stale_build_locks([tmp_path], min_age_s=120) == []
    assert stale_build_locks([tmp_path], min_age_s=1) == [young]


def test_lock_of_a_folder_a_process_works_in_is_kept(tmp_path):
    folder = tmp_path / "cpu_adam"
    lock = _lock(folder, age_s=3600)
    (folder / "build").mkdir()
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=folder / "build")
    try:
        assert clear_stale_build_locks([tmp_path], min_age_s=120) == []
        assert lock.exists()
    finally:
        builder.kill()
        builder.wait()
    assert clear_stale_build_locks([tmp_path], min_age_s=120) == [lock]


def test_roots_follow_torch_extensions_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extension_roots() == [tmp_path]


_BUILD = """
import ctypes, glob, os, sys
import torch.utils.cpp_extension as cpp
if sys.argv[1] == "clear":
    from rlhforge.backend.jit_ops import clear_stale_build_locks
    clear_stale_build_locks()
cpp.load(name="rlh_tiny", sources=[sys.argv[2]], is_python_module=False, verbose=False)
so = glob.glob(os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "rlh_tiny", "*.so"))[0]
print(ctypes.CDLL(so).rlh_tiny_answer())
"""


def test_torch_build_after_a_killed_one_waits_forever_unless_cleared(tmp_path):
    """The real torch path: a lock left in an op's build folder makes ``cpp_extension.load`` wait (killed
    here after 6 s); after :func:`clear_stale_build_locks` the same build runs and loads."""
    source = tmp_path / "tiny.cpp"
    source.write_text('extern "C" int rlh_tiny_answer() { return 42; }\n')
    root = tmp_path / "ext"
    _lock(root / "rlh_tiny", age_s=900)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(root)}
    try:
        subprocess.run([sys.executable, "-c", _BUILD, "plain", str(source)], env=env, timeout=6,
                       capture_output=True)
        waited = False
    except subprocess.TimeoutExpired:
        waited = True
    assert waited, "torch built through a leftover lock: the lock no longer blocks, so jit_ops may be obsolete"
    done = subprocess.run([sys.executable, "-c", _BUILD, "clear", str(source)], env=env, timeout=120,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "42"
    assert "removed a stale build lock" in done.stderr and str(root / "rlh_tiny" / "lock") in done.stderr
    assert not (root / "rlh_tiny" / "lock").exists()
