"""``--logger.progress_bar on`` under a pseudo-terminal that never set its size (issue 47, item 9): such a
terminal reports 0 x 0, and tqdm drew nothing at all; the bar now shows (80 x 24 assumed)."""

import os
import pty
import subprocess
import sys


def test_the_bar_shows_on_a_pseudo_terminal_of_size_zero():
    code = ("from rlhforge.tracking.progress import Progress\n"
            "bar = Progress(4, enabled=True, desc='train')\n"
            "for _ in range(4):\n    bar.update(1, loss=0.5)\n"
            "bar.close()\n")
    leader, follower = pty.openpty()  # a fresh pty: 0 columns, 0 rows, as `script` or a CI runner's pty
    assert os.get_terminal_size(follower) == os.terminal_size((0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "CI")}
    proc = subprocess.run([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=follower, env=env, timeout=120)
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    assert proc.returncode == 0
    assert b"train: 100%" in out and b"4/4" in out, out[-500:]
