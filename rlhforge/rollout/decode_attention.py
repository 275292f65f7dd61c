"""Grouped-query attention without copying the KV cache, for the HF engine's decoding steps on CPU.

transformers' SDPA attention repeats each key/value head for its query heads (``repeat_kv``: a copy of
the whole cache, every layer, every step) whenever an attention mask is given on a device it does not
trust with PyTorch's native GQA - which includes the CPU, although there the fused kernel takes
``enable_gqa=True`` with a mask and returns the same bits. :func:`decode_attention` swaps the
model's decoder attention, for the duration of one forward, to :func:`_cpu_decode_sdpa`: a
one-token query (a decoding step) on CPU goes to ``scaled_dot_product_attention(..., enable_gqa=True)``
(no copy, ~10-30% off a tiny model's step), everything else (the prefill, other devices, dropout,
position biases) to transformers' own SDPA function unchanged.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from rlhforge.models.segment_attention import masked_gqa_sdpa

__all__ = ["NAME", "decode_attention"]

NAME = "rlhforge_cpu_decode_sdpa"
"""The attention implementation's registered name (its masks are SDPA's)."""


def _cpu_decode_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, position_bias: torch.Tensor | None = None, **kwargs):
    """SDPA attention; a decoding step's query on CPU attends to the un-repeated KV heads. Keys and values
    of another dtype than the query's (a bf16 model's fp32 KV cache, :class:`rlhforge.rollout.hf_engine.HFEngine`)
    are attended in theirs, and the output comes back in the query's."""
    if key.dtype != query.dtype and query.device.type == "cpu":
        out, weights = _cpu_decode_sdpa(module, query.to(key.dtype), key, value.to(key.dtype), attention_mask,
                                        dropout, scaling, is_causal, position_bias, **kwargs)
        return out.to(query.dtype), weights
    groups = getattr(module, "num_key_value_groups", 1)
    if (query.shape[2] == 1 and query.device.type == "cpu" and groups > 1 and dropout == 0.0
            and position_bias is None and not kwargs.get("output_attentions", False) and "cache" not in kwargs):
        return masked_gqa_sdpa(query, key, value, attention_mask, 0.0, scaling), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, position_bias=position_bias, **kwargs)


AttentionInterface.register(NAME, _cpu_decode_sdpa)
AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


@contextlib.contextmanager
def decode_attention(model: torch.nn.Module):
    """Within the block, ``model``'s decoder uses :func:`_cpu_decode_sdpa` if it used ``sdpa`` (else as is)."""
    config = model.config.get_text_config(decoder=True)
    before = getattr(config, "_attn_implementation_internal", None)
    if before != "sdpa":
        yield
        return
    config._attn_implementation_internal = NAME
    try:
        yield
    finally:
        config._attn_implementation_internal = before
