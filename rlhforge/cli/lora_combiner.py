"""Merge a LoRA adapter into its base model (``rlhforge merge-lora``; OpenRLHF's ``lora_combiner``).

Bad paths are found before anything is loaded and end the command with exit status 2 and one line
naming the flag and the path (no traceback).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class MergeArgs:
    """Merge a PEFT LoRA adapter into its base model and save a plain HF folder."""

    model_path: str
    """Base model folder or hub id."""
    lora_path: str
    """Adapter folder (adapter_config.json + adapter_model.safetensors)."""
    output_path: str
    """Where the merged model is written."""
    param_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Precision of the merged weights."""


def check_merge_paths(args: MergeArgs) -> None:
    """Refuse missing or wrong folders up front (:class:`ConfigError` naming the flag and the path)."""
    from rlhforge.config.parsing import ConfigError
    from rlhforge.config.paths import local_hint, looks_local

    base = Path(args.model_path).expanduser()
    if base.exists():
        if not base.is_dir() or not (base / "config.json").is_file():
            raise ConfigError(f"--model_path {args.model_path}: not an HF model folder (no config.json)")
    elif looks_local(args.model_path):  # absolute, ./ ../ ~, a/b/c, or runs/x with runs/ here: not a hub id
        raise ConfigError(f"--model_path {args.model_path}: folder not found{local_hint(args.model_path)}")
    lora = Path(args.lora_path).expanduser()
    if lora.exists():
        if not lora.is_dir() or not (lora / "adapter_config.json").is_file():
            raise ConfigError(f"--lora_path {args.lora_path}: not a LoRA adapter folder (no adapter_config.json; "
                              "`rlhforge sft --ds.lora.rank N` writes one)")
    elif looks_local(args.lora_path):
        raise ConfigError(f"--lora_path {args.lora_path}: folder not found{local_hint(args.lora_path)}")
    out = Path(args.output_path).expanduser()
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output_path {args.output_path}: exists and is not a folder")
    if out.resolve() in (base.resolve(), lora.resolve()):
        raise ConfigError(f"--output_path {args.output_path}: is the base model or adapter folder; write the merged "
                          "model elsewhere")
    parent = next((p for p in out.resolve().parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ConfigError(f"--output_path {args.output_path}: {parent} is a file, not a folder")


def main(argv: list[str] | None = None, prog: str = "rlhforge merge-lora") -> int:
    import tyro

    from rlhforge.cli.errors import user_errors
    from rlhforge.config.parsing import ConfigError

    args = tyro.cli(MergeArgs, args=argv, prog=prog, use_underscores=True)
    with user_errors(prog):
        check_merge_paths(args)
        from rlhforge.models.hub import check_model_sources

        check_model_sources([("--model_path", args.model_path), ("--lora_path", args.lora_path)])  # hub ids: hub reachable?
        from rlhforge.models.export import merge_lora

        try:
            out = merge_lora(args.model_path, args.lora_path, args.output_path, args.param_dtype)
        except (OSError, ValueError, RuntimeError, KeyError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(f"merging --lora_path {args.lora_path} into --model_path {args.model_path} failed: "
                              f"{type(err).__name__}: {first}") from None
    print(f"[rlhforge] merged model written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
