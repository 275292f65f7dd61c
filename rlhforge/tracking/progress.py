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


class Progress:
    def __init__(self, total: int, initial: int = 0, *, enabled: bool, desc: str = "train"):
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, leave=True)

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
