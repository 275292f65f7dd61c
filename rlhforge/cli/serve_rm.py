"""HTTP reward server. ``python -m rlhforge.cli.serve_rm`` (OpenRLHF's module name) or ``rlhforge serve-rm``.

Binds 127.0.0.1 by default (OpenRLHF: 0.0.0.0); ``--host 0.0.0.0`` exposes it, ideally with
``--api_key`` (or ``RLHFORGE_RM_API_KEY``).
"""

from __future__ import annotations

import sys

from rlhforge.config.parsing import parse_args
from rlhforge.config.serve_rm import ServeRMConfig

CONFIG_CLASS = ServeRMConfig

# OpenRLHF <= 0.9 flat names of serve_rm.
SERVE_RM_LEGACY_ALIASES: dict[str, str] = {
    "--reward_pretrain": "--reward.model_name_or_path",
    "--pretrain": "--reward.model_name_or_path",
    "--normalize_reward": "--reward.normalize_enable",
    "--value_head_prefix": "--ds.value_head_prefix",
    "--max_len": "--data.max_len",
    "--packing_samples": "--ds.packing_samples",
    "--load_in_4bit": "--ds.load_in_4bit",
    "--disable_fast_tokenizer": "--data.disable_fast_tokenizer",
}


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
