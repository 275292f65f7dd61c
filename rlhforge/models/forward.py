"""Per-token log-probabilities of a causal LM on padded or packed batches.

``token_logprobs(model, batch)`` returns ``[B, T]`` where position ``t`` holds
``log p(input_ids[t] | tokens < t of the same sample)`` and positions without a prediction (the
first token of each sample, padding) hold 0. It lines up with the ``loss_mask`` of
:mod:`rlhforge.data.packing` batches (``loss_mask[t] = 1``: token ``t`` is a target).

Layouts (see :mod:`rlhforge.data.packing`):

- padded: ``attention_mask`` [B, T] present (right or left padding both work);
- packed: one row, no ``attention_mask``, ``position_ids`` restarting at 0 for every sample
  (``cu_seqlens``/``seq_lens`` optional; the resets define the samples).

How attention stays inside each packed sample:

- ``sdpa``/``eager``/``flex_attention`` (CPU and GPU): transformers (>= 4.5x, verified on 5.19,
  ``masking_utils.find_packed_sequence_indices``) detects resets in ``position_ids`` when
  ``attention_mask`` is None *and no cache is passed*, and builds a block-diagonal causal mask.
  A causal LM creates a ``DynamicCache`` by default (``config.use_cache``), which silently turns
  the detection off and lets samples attend to each other, so every call here passes
  ``use_cache=False``. Where that detection is missing (older transformers) or
  ``block_mask="explicit"`` is asked for, a 4-D additive block-diagonal causal mask is built here
  (:func:`packed_causal_mask`) and passed as ``attention_mask`` (eager and sdpa accept it).
- ``flash_attention_2``/``3`` (GPU): the varlen kernel gets the sample boundaries, as
  ``cu_seq_lens_q/k`` and ``max_length_q/k`` from the batch's ``cu_seqlens``/``max_seqlen`` when
  present, else transformers derives them from the ``position_ids`` resets (one row only). No
  mask is materialised. Not tested here (no GPU, no flash-attn).
"""

from __future__ import annotations

from typing import Any, Literal, Mapping, Sequence

import torch
from torch import Tensor

__all__ = [
    "token_logprobs",
    "sequence_logprob_sums",
    "is_packed",
    "packed_causal_mask",
    "prediction_mask",
    "hf_detects_packed_sequences",
]

_HF_PACKING_IMPLS = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


def _logprobs_from_logits(logits: Tensor, labels: Tensor, temperature: float) -> Tensor:
    from rlhforge.algorithms.logprobs import logprobs_from_logits

    return logprobs_from_logits(logits, labels, temperature=temperature)


def is_packed(batch: Mapping[str, Any]) -> bool:
    """A packed batch has no ``attention_mask`` (or ``None``) and carries ``position_ids``."""
    return batch.get("attention_mask") is None and batch.get("position_ids") is not None


def hf_detects_packed_sequences() -> bool:
    """Whether this transformers builds block-diagonal masks from resetting ``position_ids``."""
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - very old transformers
        return False
    return hasattr(masking_utils, "find_packed_sequence_indices")


def _sample_starts(position_ids: Tensor) -> Tensor:
    """[B, N] bool: True where a new sample starts (position does not continue the previous one)."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts


def packed_causal_mask(position_ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """4-D additive mask [B, 1, N, N]: 0 where query and key are in the same sample and key <= query.

    Samples are delimited like transformers does it: a new sample starts wherever a position id
    does not continue the previous one. Masked entries hold ``finfo(dtype).min``.
    """
    sample_id = torch.cumsum(_sample_starts(position_ids).long(), dim=-1)  # [B, N]
    n = position_ids.shape[-1]
    causal = torch.ones(n, n, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (sample_id[:, :, None] == sample_id[:, None, :]) & causal  # [B, N, N]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=position_ids.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def prediction_mask(batch: Mapping[str, Any]) -> Tensor:
    """[B, T] bool: positions that have a prediction (not the first token of a sample, not padding)."""
    if is_packed(batch):
        position_ids = batch["position_ids"]
        return ~_sample_starts(position_ids)
    attention_mask = batch["attention_mask"].bool()
    valid = torch.zeros_like(attention_mask)
    valid[:, 1:] = attention_mask[:, 1:] & attention_mask[:, :-1]
    return valid


def _attn_implementation(model) -> str | None:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) if config is not None else None


def token_logprobs(
    model,
    batch: Mapping[str, Any],
    temperature: float = 1.0,
    *,
    block_mask: Literal["auto", "explicit"] = "auto",
    return_logits: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Per-token log-probs ``[B, T]`` (fp32) of ``batch["input_ids"]`` under ``model``.

    Args:
        model: an HF causal LM (anything returning ``.logits`` [B, T, V]).
        batch: a padded or packed batch (module docstring); only ``input_ids``,
            ``attention_mask`` (padded) and ``position_ids`` are read.
        temperature: logits are divided by it (match the sampling temperature).
        block_mask: packed batches only. ``"auto"`` relies on transformers' packed-sequence
            detection where it exists; ``"explicit"`` always passes a 4-D block-diagonal mask
            (sdpa/eager only).
        return_logits: also return the raw logits.

    Returns:
        ``logprobs`` [B, T] with 0 at the first token of each sample and at padding; with
        ``return_logits``, ``(logprobs, logits)``. Differentiable.
    """
    input_ids = batch["input_ids"]
    position_ids = batch.get("position_ids")
    kwargs: dict[str, Any] = {"use_cache": False}  # a cache would disable packed-sequence masking
    if is_packed(batch):
        impl = _attn_implementation(model)
        explicit = block_mask == "explicit" or not (hf_detects_packed_sequences() and impl in _HF_PACKING_IMPLS)
        if explicit:
            if impl is not None and impl not in ("sdpa", "eager"):
                raise ValueError(
                    f"packed batches with attn_implementation={impl!r} need transformers' packed-sequence "
                    "support; use sdpa, eager or flash_attention_2, or a padded batch"
                )
            kwargs["attention_mask"] = packed_causal_mask(position_ids, dtype=_model_dtype(model))
        elif impl in ("flash_attention_2", "flash_attention_3") and batch.get("cu_seqlens") is not None:
            # hand the varlen kernel the boundaries directly (else transformers derives them from position_ids)
            cu = batch["cu_seqlens"].to(device=input_ids.device, dtype=torch.int32)
            max_len = int(batch.get("max_seqlen") or int((cu[1:] - cu[:-1]).max()))
            kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)
    else:
        attention_mask = batch["attention_mask"]
        kwargs["attention_mask"] = attention_mask
        if position_ids is None:  # also right for left padding
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, position_ids=position_ids, **kwargs)
    logits = out.logits
    # logits[:, t] predicts input_ids[:, t + 1]
    shifted = _logprobs_from_logits(logits[:, :-1], input_ids[:, 1:], temperature)
    logprobs = torch.zeros(input_ids.shape, dtype=shifted.dtype, device=shifted.device)
    logprobs = torch.cat([logprobs[:, :1], shifted], dim=1)
    logprobs = logprobs * prediction_mask(batch).to(logprobs.dtype)
    return (logprobs, logits) if return_logits else logprobs


def _model_dtype(model) -> torch.dtype:
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    try:
        return next(p.dtype for p in model.parameters() if p.dtype.is_floating_point)
    except StopIteration:  # pragma: no cover
        return torch.float32


def sequence_logprob_sums(
    logprobs: Tensor,
    loss_mask: Tensor,
    seq_lens: Sequence[int] | None = None,
    *,
    return_counts: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Sum of ``logprobs * loss_mask`` per sample (the sequence log-likelihood DPO compares).

    Args:
        logprobs: [B, T] from :func:`token_logprobs` (padded) or [1, N] (packed).
        loss_mask: same shape; 1 on the tokens to count.
        seq_lens: packed layout only: the sample lengths (``batch["seq_lens"]``, summing to N).
            ``None`` means padded: one sample per row.
        return_counts: also return the number of counted tokens per sample.

    Returns:
        ``sums`` [num_samples] (fp32, differentiable); with ``return_counts``, ``(sums, counts)``.
    """
    if logprobs.shape != loss_mask.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and loss_mask {tuple(loss_mask.shape)} differ in shape")
    weighted = logprobs * loss_mask.to(logprobs.dtype)
    mask = loss_mask.to(logprobs.dtype)
    if seq_lens is None:
        sums, counts = weighted.sum(-1), mask.sum(-1)
    else:
        if logprobs.shape[0] != 1:
            raise ValueError(f"packed log-probs must have one row (got {logprobs.shape[0]})")
        lens = torch.as_tensor(list(seq_lens), dtype=torch.long, device=logprobs.device)
        if int(lens.sum()) != logprobs.shape[1]:
            raise ValueError(f"seq_lens sum to {int(lens.sum())} but the packed row has {logprobs.shape[1]} tokens")
        segment = torch.repeat_interleave(torch.arange(len(lens), device=logprobs.device), lens)
        sums = torch.zeros(len(lens), dtype=logprobs.dtype, device=logprobs.device).index_add(0, segment, weighted[0])
        counts = torch.zeros(len(lens), dtype=logprobs.dtype, device=logprobs.device).index_add(0, segment, mask[0])
    return (sums, counts) if return_counts else sums
