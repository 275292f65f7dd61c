"""Turn expected user errors into one clear line and a non-zero exit (no traceback)."""

from __future__ import annotations

import sys
from contextlib import contextmanager


@contextmanager
def user_errors(prog: str):
    from rlhforge.config.parsing import ConfigError

    try:
        from rlhforge.data.errors import DataError
    except ImportError:  # pragma: no cover
        DataError = ConfigError  # noqa: N806
    try:
        yield
    except (ConfigError, DataError, FileNotFoundError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
