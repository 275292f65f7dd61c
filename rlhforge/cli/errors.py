"""Turn expected user errors into one clear line and a non-zero exit (no traceback)."""

from __future__ import annotations

import sys
from contextlib import contextmanager


@contextmanager
def user_errors(prog: str):
    from rlhforge.cli.env import setup_cli_environment
    from rlhforge.config.parsing import ConfigError

    setup_cli_environment()

    from rlhforge.config.parsing import RunFileWriteError
    from rlhforge.data.errors import DataError
    try:
        yield
    except RunFileWriteError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        raise SystemExit(6) from None
    except (ConfigError, DataError, FileNotFoundError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
