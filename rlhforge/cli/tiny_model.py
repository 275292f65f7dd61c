"""``rlhforge tiny-model --out DIR``: a tiny Llama + locally trained tokenizer that loads offline."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from rlhforge.models.tiny import TinyModelSpec


@dataclass(frozen=True)
class TinyModelArgs:
    """Build a tiny causal LM and tokenizer without a hub."""

    out: str
    """Output folder (loadable with AutoModelForCausalLM/AutoTokenizer.from_pretrained)."""
    seed: int = 0
    """Seed for the weights and the tokenizer corpus; the same seed gives the same files."""
    spec: TinyModelSpec = field(default_factory=TinyModelSpec)


def main(argv: list[str] | None = None, prog: str = "rlhforge tiny-model") -> int:
    import tyro

    from rlhforge.models.tiny import build_tiny_model

    args = tyro.cli(TinyModelArgs, args=argv, prog=prog, use_underscores=True)
    path = build_tiny_model(args.out, args.spec, seed=args.seed)
    print(f"[rlhforge] tiny model written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
