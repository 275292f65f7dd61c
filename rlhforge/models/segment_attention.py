"""Attention of a packed row, sample by sample, on CPU: no padding, no N x N mask.

A packed micro-batch is one row of N tokens holding several samples. On sdpa (every CPU run)
transformers attends it with a dense block-diagonal mask (N^2 work and memory), and
:func:`rlhforge.models.forward.packed_rows` avoids that by cutting the row into rows of the longest
sample's length - which pads every row to the longest. :func:`segment_attention` removes that padding
too: for the duration of one forward the model's attention is :func:`_segment_sdpa`, which runs
``scaled_dot_product_attention(..., is_causal=True)`` once per sample (``cu_seq_lens_q``, the same
boundaries transformers hands flash-attention's varlen kernel) and concatenates the results. The
linear layers see exactly the real tokens and attention costs the sum of the samples' squares.

It applies (:func:`segments_apply`) to a packed batch on CPU with sdpa attention, plain causal layers
(no sliding window, no soft-capping) and no gradient checkpointing (a recomputed layer would run
outside this forward's attention). Elsewhere the bounded rows are used, and on GPU flash-attention's
varlen kernel does the same job. Inside the block, a call without ``cu_seq_lens_q`` is sdpa unchanged
(its masks are sdpa's whenever an ``attention_mask`` is given).

**bf16 on CPU.** Under bf16 autocast (``--ds.param_dtype bf16``) or with bf16 weights, every attention
call of the block runs in fp32 (:func:`_in_fp32`): CPU's SDPA kernels are about 3x slower in bf16 than
in fp32, the matmuls around them about 4x faster in bf16 (AVX512-BF16). The block is then also entered
for padded batches of such forwards, which otherwise would not need it.

**Padded batches of a grouped-query model on CPU.** transformers gives sdpa ``enable_gqa`` only when there is no
mask (CUDA's kernels need that); with a padding mask it repeats every key/value head to the number of query heads
first, copies that the backward then sums back per group. The block is also entered for such forwards
(:func:`_padded_gqa_cpu`) and their masked attention runs with ``enable_gqa`` (:func:`masked_gqa_sdpa`): the same
outputs bit for bit, and a GRPO training step at 16 x 8 x 64 about 4% faster with ~0.1 GB less peak memory.
"""

from __future__ import annotations

import contextlib
from typing import Any, Mapping

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

__all__ = ["NAME", "segment_attention", "segments_apply", "segment_kwargs", "plain_causal", "masked_gqa_sdpa"]

SPANS_KEY = "rlhforge_attention_spans"
"""The forward keyword of a shared-prefix layout's spans (:class:`rlhforge.models.shared_prefix.SharedPrefixLayout`)."""

NAME = "rlhforge_segment_sdpa"
"""The attention implementation's registered name."""


def _segment_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                  is_causal: bool | None = None, **kwargs):
    """Causal SDPA within each sample of a one-row packed batch (``cu_seq_lens_q``), or over the spans of a
    shared-prefix layout (:mod:`rlhforge.models.shared_prefix`); else plain sdpa."""
    spans = kwargs.get(SPANS_KEY)
    if spans is not None and attention_mask is None and query.shape[0] == 1:
        return _in_fp32(_spans_sdpa, query, key, value, spans, dropout, scaling), None
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or attention_mask is not None or query.shape[0] != 1:
        def plain(q, k, v):
            mask = attention_mask
            if mask is not None and mask.is_floating_point() and mask.dtype != q.dtype:
                mask = mask.to(q.dtype)  # an additive mask built in the model's bf16, queries now in fp32
            if _masked_gqa(module, q, mask, kwargs):
                return masked_gqa_sdpa(q, k, v, mask, dropout, scaling)
            return sdpa_attention_forward(module, q, k, v, mask, dropout=dropout, scaling=scaling,
                                          is_causal=is_causal, **kwargs)[0]
        return _in_fp32(plain, query, key, value), None
    return _in_fp32(_per_sample_sdpa, query, key, value, cu.tolist(), dropout, scaling), None


def _in_fp32(attend, query, key, value, *args):
    """``attend(query, key, value, *args)``, in fp32 where the inputs are bf16/fp16 on CPU, cast back.

    CPU's flash SDPA kernels are several times slower in bf16 than in fp32 (measured with torch 2.13
    on this repository's CPU, a packed SFT step under bf16 autocast: attention backward 2.6 ms a call
    in bf16, 0.38 ms in fp32), while the matmuls around them are the other way round; the attention's
    share of a step's FLOPs is small, so it runs in fp32 (more precise too) and the rest stays bf16.
    Under autocast the inputs may be of mixed precision (rotary embeddings promote the queries and keys
    to fp32, the values stay bf16) and autocast would cast them all down: it is off inside, and the
    output has the dtype autocast would have given it."""
    if query.device.type != "cpu":
        return attend(query, key, value, *args)
    autocast = torch.is_autocast_enabled("cpu")
    dtypes = {query.dtype, key.dtype, value.dtype}
    if not autocast and not dtypes & {torch.bfloat16, torch.float16}:
        return attend(query, key, value, *args)
    out_dtype = torch.get_autocast_dtype("cpu") if autocast else query.dtype
    with torch.autocast("cpu", enabled=False):
        return attend(query.float(), key.float(), value.float(), *args).to(out_dtype)


def _masked_gqa(module, query, mask, kwargs) -> bool:
    """A masked CPU call of a grouped-query layer that transformers would give sdpa with the key/value heads
    repeated (its ``use_gqa_in_sdpa`` allows ``enable_gqa`` only without a mask, for CUDA's sake)."""
    return (mask is not None and query.device.type == "cpu" and getattr(module, "num_key_value_groups", 1) > 1
            and kwargs.get("position_bias") is None and kwargs.get("cache") is None)


def masked_gqa_sdpa(query, key, value, mask, dropout: float, scaling: float | None) -> torch.Tensor:
    """sdpa with the mask and ``enable_gqa``: the outputs equal those of the repeated heads bit for bit (each query
    head reads its group's key/value head either way); the key/value gradients differ in the order of the group's
    sum. At 128 rows x 80 tokens (8 heads, 4 kv, head_dim 32) a layer's forward + backward took 48 ms against 67-72
    with the heads repeated (their copies, and the backward's sum over each group, are gone), and the copies are
    not kept for the backward. Returns ``[B, L, H, D]`` contiguous, as transformers' attention functions do (the
    HF engine's decoding steps use it too, :mod:`rlhforge.rollout.decode_attention`)."""
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                                           scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


def _per_sample_sdpa(query, key, value, bounds: list[int], dropout: float, scaling: float | None) -> torch.Tensor:
    """Causal SDPA within each sample of a one-row packed batch (``bounds``: the samples' offsets)."""
    gqa = query.shape[1] != key.shape[1]
    outs = [torch.nn.functional.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
        for q, k, v in zip(*(_pieces(x, bounds) for x in (query, key, value)))]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def _pieces(x: torch.Tensor, bounds: list[int]) -> tuple[torch.Tensor, ...]:
    """``x[:, :, a:b]`` for consecutive ``bounds`` as one ``split``: its backward is one concatenation,
    where a slice per piece would each add a zero-filled gradient of the whole row (quadratic in the
    number of pieces). The bounds cover the row (0 to its length)."""
    if bounds[0] != 0 or bounds[-1] != x.shape[2]:
        raise ValueError(f"attention pieces {bounds[0]}..{bounds[-1]} must cover the row of {x.shape[2]} tokens")
    return x.split([b - a for a, b in zip(bounds[:-1], bounds[1:])], dim=2)


def _spans_sdpa(query, key, value, spans, dropout: float, scaling: float | None) -> torch.Tensor:
    """Each span's queries attend to its prefix (all of it) and causally to the span itself."""
    gqa = query.shape[1] != key.shape[1]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    # the layout's spans tile the row in order and every prefix is a span of its own: one split serves all
    bounds = [span[0] for span in spans] + [spans[-1][1]]
    if any(span[1] != nxt for span, nxt in zip(spans, bounds[1:])):
        raise ValueError("attention spans must tile the row in order")
    qs, ks, vs = (_pieces(x, bounds) for x in (query, key, value))
    prefix_piece = {span[0]: i for i, span in enumerate(spans) if span[1] > span[0]}  # (a member may be empty)
    outs = []
    for i, (start, end, p_start, p_end, mask) in enumerate(spans):
        if p_start == p_end:
            outs.append(sdpa(qs[i], ks[i], vs[i], dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa))
            continue
        j = prefix_piece[p_start]  # the prefix's own span
        k, v = torch.cat([ks[j], ks[i]], dim=2), torch.cat([vs[j], vs[i]], dim=2)
        outs.append(sdpa(qs[i], k, v, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=gqa))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def _mask(*args, **kwargs):
    """No mask for a packed call (no ``attention_mask``: the samples are cut by ``cu_seq_lens_q``); sdpa's otherwise."""
    if kwargs.get("attention_mask") is None:
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)


AttentionInterface.register(NAME, _segment_sdpa)
AttentionMaskInterface.register(NAME, _mask)


def _text_config(model):
    config = getattr(model, "config", None)
    if config is None:
        return None
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def segments_apply(model, input_ids: torch.Tensor) -> bool:
    """Whether a packed forward of ``model`` on ``input_ids`` can attend sample by sample (module docstring)."""
    config = _text_config(model)
    if config is None or input_ids.device.type != "cpu":
        return False
    if getattr(config, "_attn_implementation_internal", None) != "sdpa":
        return False
    if getattr(model, "is_gradient_checkpointing", False):
        return False
    return plain_causal(config)


def plain_causal(config) -> bool:
    """Whether every layer of a (text) config attends causally to all earlier tokens and nothing else
    shapes its mask or scores (no sliding window, chunked attention or soft-capping)."""
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return False
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return False
    return not any(getattr(config, k, None) for k in ("attn_logit_softcapping", "attention_chunk_size"))


def segment_kwargs(lengths: list[int], device: torch.device) -> dict[str, Any]:
    """The sample boundaries as the model's forward takes them (flash-attention's varlen names)."""
    cu = torch.tensor([0] + lengths, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
    longest = max(lengths)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def _low_precision_cpu(model, kwargs: Mapping[str, Any]) -> bool:
    """A text-only forward in bf16/fp16 (autocast or such weights) where the sample-by-sample attention
    would apply (:func:`segments_apply`: CPU, sdpa, plain causal layers, no gradient checkpointing): its
    attention is better in fp32."""
    ids = kwargs.get("input_ids")
    if ids is None or kwargs.get("pixel_values") is not None or not segments_apply(model, ids):
        return False
    if torch.is_autocast_enabled("cpu"):
        return True
    param = next(model.parameters(), None)
    return param is not None and param.dtype in (torch.bfloat16, torch.float16)


def _padded_gqa_cpu(model, kwargs: Mapping[str, Any]) -> bool:
    """A text-only padded forward (an ``attention_mask``) of a grouped-query model where the sample-by-sample
    attention would apply: its masked attention runs with ``enable_gqa`` (:func:`masked_gqa_sdpa`)."""
    ids = kwargs.get("input_ids")
    if ids is None or kwargs.get("attention_mask") is None or kwargs.get("pixel_values") is not None:
        return False
    config = _text_config(model)
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    return bool(heads and kv and kv < heads) and segments_apply(model, ids)


@contextlib.contextmanager
def segment_attention(model, kwargs: Mapping[str, Any]):
    """Within the block, ``model`` attends with :func:`_segment_sdpa` if ``kwargs`` carry sample boundaries,
    if the forward is a low-precision one on CPU (padded batches then attend through sdpa in fp32), or if it is
    a padded CPU forward of a grouped-query model (masked sdpa then reads the key/value heads unrepeated)."""
    config = _text_config(model)
    if config is None or ("cu_seq_lens_q" not in kwargs and SPANS_KEY not in kwargs
                          and not _low_precision_cpu(model, kwargs) and not _padded_gqa_cpu(model, kwargs)):
        yield
        return
    before = config._attn_implementation_internal
    config._attn_implementation_internal = NAME
    try:
        yield
    finally:
        config._attn_implementation_internal = before
