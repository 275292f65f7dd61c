"""Tiny causal LMs of the common model families and locally trained BPE tokenizers, built without a hub.

``build_tiny_model(out_dir, arch=NAME)`` writes a folder that ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load offline: a byte-level BPE tokenizer trained with
``tokenizers`` on a deterministic built-in corpus (so every byte is encodable), a ChatML chat
template with ``{% generation %}`` markers (assistant-token masks for multi-turn SFT), ``<pad>`` as
pad token and ``<|im_end|>`` as eos, and randomly initialised weights. The defaults give
head_dim 32, the smallest vLLM's CPU attention accepts. The same seed gives the same files.

``arch`` (:data:`ARCHS`) picks the transformers config class, and with it what makes the family
different: ``qwen2`` (bias on q/k/v), ``qwen3`` (RMSNorm on q and k), ``gemma3_text`` (tied
embeddings, final-logit soft-capping, sandwich norms, GELU, embeddings scaled by sqrt(hidden)),
``mistral``, ``phi3`` (fused ``qkv_proj`` and ``gate_up_proj``), and the mixture-of-experts
``qwen3_moe`` and ``mixtral`` (``spec.num_experts`` experts, top-``spec.num_experts_per_tok``
routing, every layer sparse). Sizes come from :class:`TinyModelSpec` for every family.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

PAD, BOS, EOS, IM_START = "<pad>", "<|endoftext|>", "<|im_end|>", "<|im_start|>"
SPECIAL_TOKENS = [PAD, BOS, IM_START, EOS]

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORDS = (
    "the a an of to and in is it that for on with as was be by this are or his from at which but "
    "not have had they you were their one all we can her has there been if more when will would who "
    "so no what out up into do than time only could new some these two may first then any like "
    "other how years our over such many well most where after between much through because just "
    "user assistant system answer question solve compute add sum plus minus times equals number "
    "result what is the value of think step final reverse sort count letters word list yes no true "
    "false good bad correct wrong hello world please thanks python code print return def import"
).split()


def _corpus(seed: int, n_lines: int = 4000) -> list[str]:
    """Deterministic text: words, arithmetic, digit strings, chat markup and every byte value."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        kind = rng.random()
        if kind < 0.4:
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12))).capitalize() + ".")
        elif kind < 0.8:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice("+-*")
            value = a + b if op == "+" else a - b if op == "-" else a * b
            lines.append(f"What is {a} {op} {b}? The answer is {value}.")
        else:
            lines.append("".join(rng.choice("0123456789 abcdefghijklmnopqrstuvwxyz") for _ in range(20)))
    lines.append("".join(chr(i) for i in range(32, 127)))
    return lines


def build_tokenizer(vocab_size: int = 1024, seed: int = 0, padding_side: str = "left"):
    """Train a byte-level BPE tokenizer and wrap it as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        bos_token=BOS,
        unk_token=None,
        padding_side=padding_side,
        chat_template=CHATML_TEMPLATE,
        model_max_length=2048,
    )


@dataclass(frozen=True)
class TinyModelSpec:
    """Size of a tiny Llama. Defaults: ~0.4M parameters with a 1k vocabulary, head_dim 32."""

    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    num_experts: int = 4
    """MoE families only: experts per layer."""
    num_experts_per_tok: int = 2
    """MoE families only: experts each token is routed to."""
    moe_intermediate_size: int = 128
    """MoE families only: hidden size of each expert's MLP."""
    model_vocab_size: int | None = None
    """Rows of the model's embedding and head (None: the tokenizer's size). Real models pad theirs beyond
    the tokenizer (Qwen3: 151,936 rows for 151,669 tokens); the logits' size follows this number."""
    head_dim_override: int | None = None
    """Attention head size when it is not ``hidden_size / num_attention_heads`` (Qwen3-0.6B: 128)."""

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        head_dim = self.head_dim_override or self.hidden_size // self.num_attention_heads
        if head_dim < 32:
            raise ValueError(
                f"head_dim = hidden_size / num_attention_heads = {self.hidden_size} / "
                f"{self.num_attention_heads} = {head_dim}; vLLM's CPU attention needs head_dim >= 32"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} must be in 1..num_experts "
                             f"({self.num_experts})")

    @property
    def head_dim(self) -> int:
        return self.head_dim_override or self.hidden_size // self.num_attention_heads


#: ``rlhforge tiny-model --preset NAME``: real shapes with random weights, ``(arch, spec)``
PRESETS: dict[str, tuple[str, TinyModelSpec]] = {
    # Qwen3-0.6B's config: hidden 1024, 28 layers, 16 query / 8 key-value heads of 128, MLP 3072, tied
    "qwen3-0.6b": ("qwen3", TinyModelSpec(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                          num_attention_heads=16, num_key_value_heads=8, head_dim_override=128,
                                          max_position_embeddings=40960, tie_word_embeddings=True,
                                          model_vocab_size=151936)),
    # a small body with the real vocabulary: the logits dominate memory as they do at 0.5-8B
    "vocab-real-small": ("qwen3", TinyModelSpec(hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                                                num_attention_heads=8, num_key_value_heads=4,
                                                tie_word_embeddings=True, model_vocab_size=151936)),
}


#: --arch NAME -> transformers config class name (the model class follows from AutoModelForCausalLM)
ARCHS: dict[str, str] = {
    "llama": "LlamaConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
    "gemma3_text": "Gemma3TextConfig",
    "mistral": "MistralConfig",
    "phi3": "Phi3Config",
    "qwen3_moe": "Qwen3MoeConfig",
    "mixtral": "MixtralConfig",
}
MOE_ARCHS = ("qwen3_moe", "mixtral")


def check_arch(arch: str) -> str:
    """``arch`` itself, or ValueError listing the valid names."""
    if arch not in ARCHS:
        raise ValueError(f"unknown --arch {arch!r}; valid: {', '.join(ARCHS)}")
    return arch


def _family_fields(arch: str, spec: TinyModelSpec) -> dict:
    """The config fields that make ``arch`` itself (beyond the shared sizes)."""
    if arch == "gemma3_text":
        # tied embeddings, soft-capped logits; query scaling by head_dim; one sliding + one full layer
        # with a window longer than any test sequence (the masks of both kinds must agree with vLLM's)
        return dict(tie_word_embeddings=True, final_logit_softcapping=30.0, query_pre_attn_scalar=spec.head_dim,
                    sliding_window=512,
                    layer_types=["full_attention" if i % 2 else "sliding_attention"
                                 for i in range(spec.num_hidden_layers)])
    if arch == "phi3":
        return dict(original_max_position_embeddings=spec.max_position_embeddings)
    if arch == "qwen3_moe":
        return dict(num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                    moe_intermediate_size=spec.moe_intermediate_size, decoder_sparse_step=1, mlp_only_layers=[],
                    norm_topk_prob=True)
    if arch == "mixtral":
        return dict(num_local_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                    intermediate_size=spec.moe_intermediate_size)
    return {}


def build_tiny_model(out_dir: str | Path, spec: TinyModelSpec = TinyModelSpec(), seed: int = 0,
                     arch: str = "llama") -> Path:
    """Write a tiny causal LM of family ``arch`` (:data:`ARCHS`) + tokenizer to ``out_dir``; return the path."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    check_arch(arch)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size, seed=seed)
    fields = dict(
        vocab_size=max(len(tokenizer), spec.model_vocab_size or 0),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    if arch != "llama" or spec.head_dim_override:  # Llama derives head_dim unless told; the others are told it
        fields["head_dim"] = spec.head_dim
    fields.update(_family_fields(arch, spec))
    config = getattr(transformers, ARCHS[arch])(**fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM._model_mapping[type(config)](config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
