"""Progress bar on rank 0 (tqdm): loss, lr, tokens/s and ETA; quiet in CI and when not a TTY."""

from __future__ import annotations

import os
import sys


def progress_enabled(mode: str, is_rank0: bool) -> bool:
    if not is_rank0 or mode == "off":
        return False
    if mode == "on":
        return True
    return sys.stderr.isatty() and not os.environ.get("CI") and not os.environ.get("TQDM_DISABLE")


def _terminal_size() -> tuple[int, int]:
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):  # not a terminal: tqdm falls back by itself
        return (-1, -1)
    return (size.columns, size.lines)


class Progress:
    def __init__(self, total: int, initial: int = 0, *, enabled: bool, desc: str = "train"):
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            # a pseudo-terminal that never set its size reports 0 x 0: tqdm then draws nothing (a bar 0 wide, on
            # a row past the screen's 0 rows), so such a terminal is taken as 80 x 24
            sized = _terminal_size() != (0, 0)
            self._bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=sized, leave=True,
                             **({} if sized else {"ncols": 80, "nrows": 24}))

    def update(self, n: int = 1, **postfix) -> None:
        if self._bar is not None:
            self._bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in postfix.items()},
                                  refresh=False)
            self._bar.update(n)

    def write(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
