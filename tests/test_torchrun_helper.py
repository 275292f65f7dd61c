"""tests/torchrun.py reruns a torchrun job only for gloo's teardown abort, never for another failure."""

import subprocess

from tests.torchrun import teardown_abort

ABORT = ("terminate called without an active exception\n"
         "E1202 api.py:1002] failed (exitcode: -6) local_rank: 1 (pid: 3734)\nTraceback (most recent call last):\n"
         "  ChildFailedError\n  exitcode  : -6 (pid: 3734)  (SIGABRT)\n")


def _proc(rc, err):
    return subprocess.CompletedProcess(["torchrun"], rc, "", err)


def test_only_the_teardown_abort_is_rerun():
    assert teardown_abort(_proc(1, ABORT))
    assert teardown_abort(_proc(1, "FutureWarning: all_gather_into_tensor is deprecated\n" + ABORT))
    assert not teardown_abort(_proc(0, ABORT))  # a passing run
    # a Python error on a rank before the abort is a real failure
    assert not teardown_abort(_proc(1, "Traceback (most recent call last):\n  ValueError: bad\n" + ABORT))
    assert not teardown_abort(_proc(1, ABORT.replace("(SIGABRT)", "(SIGSEGV)")))
    assert not teardown_abort(_proc(1, "exitcode  : 1 (pid: 3)\nRuntimeError: mismatch"))
