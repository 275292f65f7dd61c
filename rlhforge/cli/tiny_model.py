"""``rlhforge tiny-model --out DIR [--arch NAME]``: a tiny causal LM of one model family + a locally
trained tokenizer, loadable offline with ``from_pretrained``.

``--arch`` is one of :data:`rlhforge.models.tiny.ARCHS` (llama, qwen2, qwen3, gemma3_text, mistral,
phi3, qwen3_moe, mixtral) or a vision-language family of
:data:`rlhforge.models.tiny_vlm.VLM_ARCHS` (qwen2_vl, qwen2_5_vl, qwen3_vl: model + processor files);
an unknown name exits 2 with the valid names.

``--preset NAME`` builds a real shape with random weights instead (:data:`rlhforge.models.tiny.PRESETS`):
``qwen3-0.6b`` (Qwen3-0.6B's config: hidden 1024, 28 layers, vocabulary 151,936, tied) and
``vocab-real-small`` (hidden 512, 4 layers, the same vocabulary), for measuring memory where the
logits dominate (docs/performance.md). The tokenizer stays the small local one; the model's
vocabulary is the real one.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from rlhforge.models.tiny import TinyModelSpec


@dataclass(frozen=True)
class TinyModelArgs:
    """Build a tiny causal LM and tokenizer without a hub."""

    out: str
    """Output folder (loadable with AutoModelForCausalLM/AutoTokenizer.from_pretrained)."""
    arch: str = "llama"
    """Model family: llama, qwen2, qwen3, gemma3_text, mistral, phi3, qwen3_moe, mixtral; vision-language: qwen2_vl, qwen2_5_vl, qwen3_vl."""
    seed: int = 0
    """Seed for the weights and the tokenizer corpus; the same seed gives the same files."""
    preset: str | None = None
    """A real shape with random weights (family and sizes): qwen3-0.6b, vocab-real-small; overrides --arch and --spec.*."""
    spec: TinyModelSpec = field(default_factory=TinyModelSpec)


def main(argv: list[str] | None = None, prog: str = "rlhforge tiny-model") -> int:
    import tyro

    from rlhforge.models.tiny import PRESETS, build_tiny_model, check_arch

    args = tyro.cli(TinyModelArgs, args=argv, prog=prog, use_underscores=True)
    if args.preset is not None:
        if args.preset not in PRESETS:
            print(f"[rlhforge] error: unknown --preset {args.preset!r}; valid: {', '.join(PRESETS)}", file=sys.stderr)
            return 2
        arch, spec = PRESETS[args.preset]
        path = build_tiny_model(args.out, spec, seed=args.seed, arch=arch)
        size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file()) / 1e9
        print(f"[rlhforge] {args.preset} ({arch}, hidden {spec.hidden_size}, {spec.num_hidden_layers} layers, "
              f"vocabulary {spec.model_vocab_size}, random weights) written to {path}: {size:.2f} GB on disk")
        return 0
    from rlhforge.models.tiny_vlm import build_tiny_vlm, is_vlm_arch

    if is_vlm_arch(args.arch):  # vision-language families (docs/vlm.md); the text spec does not apply
        path = build_tiny_vlm(args.out, arch=args.arch, seed=args.seed)
        print(f"[rlhforge] tiny {args.arch} vision-language model + processor written to {path}")
        return 0
    try:
        check_arch(args.arch)
    except ValueError as err:
        from rlhforge.models.tiny_vlm import VLM_ARCHS

        print(f"[rlhforge] error: {err} (text); vision-language: {', '.join(VLM_ARCHS)}", file=sys.stderr)
        return 2
    path = build_tiny_model(args.out, args.spec, seed=args.seed, arch=args.arch)
    print(f"[rlhforge] tiny {args.arch} model written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
