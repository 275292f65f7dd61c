"""HTTP reward server. ``python -m rlhforge.cli.serve_rm`` (OpenRLHF's module name) or ``rlhforge serve-rm``.

Binds 127.0.0.1 by default (OpenRLHF: 0.0.0.0); ``--host 0.0.0.0`` exposes it, ideally with
``--api_key`` (or ``RLHFORGE_RM_API_KEY``).
"""

from __future__ import annotations

import sys

from rlhforge.config.parsing import parse_args
from rlhforge.config.serve_rm import ServeRMConfig
from rlhforge.config.aliases import SERVE_RM_LEGACY_ALIASES  # noqa: F401 (re-exported: the tables live in config/aliases.py)

CONFIG_CLASS = ServeRMConfig

def main(argv: list[str] | None = None, prog: str = "python -m rlhforge.cli.serve_rm") -> int:
    from rlhforge.cli.errors import user_errors
    from rlhforge.config.paths import model_paths

    with user_errors(prog):
        cfg = parse_args(ServeRMConfig, argv, prog=prog, description=ServeRMConfig.__doc__,
                         legacy=SERVE_RM_LEGACY_ALIASES)
        from rlhforge.models.hub import check_model_sources

        check_model_sources(model_paths(cfg))  # a missing folder or an unreachable hub: exit 2 before loading
        from rlhforge.rewards.server import serve

        serve(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
