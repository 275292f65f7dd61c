"""Merge a LoRA adapter into its base model (``rlhforge merge-lora``; OpenRLHF's ``lora_combiner``)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
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


def main(argv: list[str] | None = None, prog: str = "rlhforge merge-lora") -> int:
    import tyro

    from rlhforge.models.export import merge_lora

    args = tyro.cli(MergeArgs, args=argv, prog=prog, use_underscores=True)
    out = merge_lora(args.model_path, args.lora_path, args.output_path, args.param_dtype)
    print(f"[rlhforge] merged model written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
