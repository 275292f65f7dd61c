"""Tinker-compatible training server. ``rlhforge serve-tinker`` (docs/tinker.md).

Binds 127.0.0.1 by default. The ``tinker`` SDK then needs only ``TINKER_BASE_URL`` and ``TINKER_API_KEY``.
"""

from __future__ import annotations

import sys

from rlhforge.config.parsing import parse_args
from rlhforge.config.serve_tinker import ServeTinkerConfig

CONFIG_CLASS = ServeTinkerConfig


def main(argv: list[str] | None = None, prog: str = "python -m rlhforge.cli.serve_tinker") -> int:
    from rlhforge.cli.errors import user_errors
    from rlhforge.tinker_server.server import serve

    with user_errors(prog):
        cfg = parse_args(ServeTinkerConfig, argv, prog=prog, description=ServeTinkerConfig.__doc__)
        serve(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
