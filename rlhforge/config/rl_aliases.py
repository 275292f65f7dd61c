"""OpenRLHF's older names of ``train_ppo_ray`` flags and the argv rewriting that maps them to today's
dotted names, with one deprecation line each: 0.9's flat names (``--pretrain``, ``--remote_rm_url``...)
and 0.10's IS-correction pair (``--algo.advantage.is_correction_enable/type``)."""

from __future__ import annotations

import sys

from rlhforge.config.deadline import DEADLINE_ALIASES
from rlhforge.config.parsing import ConfigError, rewrite_aliases
from rlhforge.config.rl_losses import POLICY_LOSS_FLAG_ALIASES
from rlhforge.config.aliases import RL_LEGACY_ALIASES, RL_LEGACY_SWITCHES  # noqa: F401 (re-exported: the tables live in config/aliases.py)

__all__ = ["RL_LEGACY_ALIASES", "RL_LEGACY_SWITCHES", "IS_CORRECTION_TYPES", "rewrite_rl_argv"]

#: OpenRLHF 0.10's ``--algo.advantage.is_correction_type`` -> 0.11.2's level / mode / gating.
IS_CORRECTION_TYPES = {"tis": ("token", "clip", "ratio"), "icepop": ("token", "mask", "ratio"),
                       "seq-mask-tis": ("seq", "mask", "ratio")}


def _rewrite_is_correction(argv: list[str], warn) -> list[str]:
    """``--algo.advantage.is_correction_enable [--algo.advantage.is_correction_type T]`` (OpenRLHF 0.10)
    -> ``--algo.advantage.is_correction_{level,mode,gating}`` (0.11.2). The type alone does nothing,
    as in 0.10."""
    enable_flag, type_flag = "--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type"
    if enable_flag not in argv and type_flag not in argv:
        return argv
    out, enabled, kind, i = [], False, "tis", 0
    while i < len(argv):
        if argv[i] == enable_flag:
            enabled, i = True, i + 1
        elif argv[i] == type_flag:
            if i + 1 >= len(argv) or argv[i + 1] not in IS_CORRECTION_TYPES:
                got = argv[i + 1] if i + 1 < len(argv) else "nothing"
                raise ConfigError(f"{type_flag} must be one of {', '.join(IS_CORRECTION_TYPES)} (got {got})")
            kind, i = argv[i + 1], i + 2
        else:
            out.append(argv[i])
            i += 1
    if enabled:
        level, mode, gating = IS_CORRECTION_TYPES[kind]
        warn(f"[rlhforge] {enable_flag} / {type_flag} {kind} are OpenRLHF 0.10 names; use "
             f"--algo.advantage.is_correction_level {level} --algo.advantage.is_correction_mode {mode} "
             f"--algo.advantage.is_correction_gating {gating}")
        out += ["--algo.advantage.is_correction_level", level, "--algo.advantage.is_correction_mode", mode,
                "--algo.advantage.is_correction_gating", gating]
    return out


def rewrite_rl_argv(argv: list[str], warn=lambda msg: print(msg, file=sys.stderr)) -> list[str]:
    """OpenRLHF 0.9 flat names and 0.10 IS-correction names -> current dotted ones (one deprecation
    line each)."""
    argv = _rewrite_is_correction(list(argv), warn)
    out: list[str] = []
    for token in argv:
        if token in RL_LEGACY_SWITCHES:
            warn(f"[rlhforge] {token} is deprecated; use {' '.join(RL_LEGACY_SWITCHES[token])}")
            out.extend(RL_LEGACY_SWITCHES[token])
        else:
            out.append(token)
    return rewrite_aliases(out, current={**DEADLINE_ALIASES, **POLICY_LOSS_FLAG_ALIASES}, legacy=RL_LEGACY_ALIASES,
                           warn=warn)
