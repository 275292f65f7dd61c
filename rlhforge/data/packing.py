"""Collation (padded or packed) and micro-batching.

A *sample* is anything with ``input_ids`` and ``loss_mask`` (lists of ints of equal length),
given as attributes (:class:`rlhforge.data.sft.SFTSample`) or mapping keys (``{"input_ids":
..., "loss_mask": ...}``); reward-model and DPO code reuse these functions for chosen/rejected
sequences.

Two batch layouts, both consumed by :func:`rlhforge.models.forward.token_logprobs`:

Padded (:func:`collate_padded`, right padding)::

    input_ids       [B, T] int64   pad_id after each sample
    attention_mask  [B, T] int64   1 on real tokens
    position_ids    [B, T] int64   0..len-1 on real tokens, 0 on padding
    loss_mask       [B, T] float32 the samples' loss_mask, 0 on padding

Packed (:func:`collate_packed`, padding-free: samples concatenated into one row)::

    input_ids       [1, N] int64   N = sum of sample lengths
    position_ids    [1, N] int64   restart at 0 at every sample
    loss_mask       [1, N] float32
    cu_seqlens      [S + 1] int32  cumulative sample lengths, starting at 0 (flash-attn varlen)
    max_seqlen      int            longest sample
    seq_lens        list[int]      the S sample lengths

The packed batch has no ``attention_mask``: the model must be called with
``attention_mask=None`` so that the position-id resets define the sample boundaries (see
:mod:`rlhforge.models.forward`).

Micro-batching: :func:`split_into_micro_batches` cuts a list of indices into fixed-size chunks;
:func:`token_budget_batches` groups samples so that each micro-batch holds at most
``max_tokens`` tokens (first-fit decreasing; see its docstring).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

__all__ = ["collate_padded", "collate_packed", "token_budget_batches", "split_into_micro_batches",
           "packed_lengths"]


def _field(sample: Any, name: str) -> Sequence[int]:
    value = sample[name] if isinstance(sample, dict) else getattr(sample, name)
    return value.tolist() if isinstance(value, torch.Tensor) else value


def _ids_and_mask(samples: Sequence[Any]) -> tuple[list[Sequence[int]], list[Sequence[int]]]:
    if len(samples) == 0:
        raise ValueError("cannot collate an empty list of samples")
    ids = [_field(s, "input_ids") for s in samples]
    masks = [_field(s, "loss_mask") for s in samples]
    for i, (a, m) in enumerate(zip(ids, masks)):
        if len(a) != len(m):
            raise ValueError(f"sample {i}: input_ids has {len(a)} tokens but loss_mask has {len(m)}")
        if len(a) == 0:
            raise ValueError(f"sample {i} is empty")
    return ids, masks


def collate_padded(samples: Sequence[Any], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad ``samples`` to the longest one (layout in the module docstring)."""
    ids, masks = _ids_and_mask(samples)
    batch, width = len(ids), max(len(a) for a in ids)
    input_ids = torch.full((batch, width), int(pad_id), dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    position_ids = torch.zeros((batch, width), dtype=torch.long)
    loss_mask = torch.zeros((batch, width), dtype=torch.float32)
    for row, (a, m) in enumerate(zip(ids, masks)):
        n = len(a)
        input_ids[row, :n] = torch.as_tensor(a, dtype=torch.long)
        attention_mask[row, :n] = 1
        position_ids[row, :n] = torch.arange(n)
        loss_mask[row, :n] = torch.as_tensor(m, dtype=torch.float32)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "loss_mask": loss_mask,
    }


def collate_packed(samples: Sequence[Any]) -> dict[str, Any]:
    """Concatenate ``samples`` into one row with per-sample position ids (layout in the module docstring)."""
    ids, masks = _ids_and_mask(samples)
    seq_lens = [len(a) for a in ids]
    input_ids = torch.tensor([t for a in ids for t in a], dtype=torch.long).unsqueeze(0)
    loss_mask = torch.tensor([float(t) for m in masks for t in m], dtype=torch.float32).unsqueeze(0)
    position_ids = torch.cat([torch.arange(n) for n in seq_lens]).unsqueeze(0)
    cu_seqlens = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(torch.tensor(seq_lens), 0)
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "loss_mask": loss_mask,
        "cu_seqlens": cu_seqlens,
        "max_seqlen": max(seq_lens),
        "seq_lens": seq_lens,
    }


def packed_lengths(batch: Mapping[str, Any]) -> list[int]:
    """The sample lengths of a one-row packed batch (``seq_lens``, else ``cu_seqlens``, else the position resets:
    a sample starts wherever a position id does not continue the previous one)."""
    if batch.get("seq_lens") is not None:
        return [int(n) for n in batch["seq_lens"]]
    if batch.get("cu_seqlens") is not None:
        cu = batch["cu_seqlens"].tolist()
        return [b - a for a, b in zip(cu[:-1], cu[1:])]
    pos = batch["position_ids"][0]
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    at = starts.nonzero()[:, 0].tolist()
    return [b - a for a, b in zip(at, at[1:] + [pos.shape[-1]])]


def split_into_micro_batches(indices: Sequence[int], micro_batch_size: int) -> list[list[int]]:
    """Consecutive chunks of ``micro_batch_size`` indices, in order; the last may be shorter."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1 (got {micro_batch_size})")
    indices = list(indices)
    return [indices[i : i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]


def token_budget_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group sample indices into micro-batches of at most ``max_tokens`` tokens each.

    First-fit decreasing: samples are taken longest first (ties by index) and each goes into the
    first micro-batch that still has room, else opens a new one. A sample longer than
    ``max_tokens`` gets a micro-batch of its own. Deterministic: the result depends only on
    ``lengths`` and ``max_tokens``. Micro-batches come in the order they were opened (the first
    holds the longest sample); indices inside one are sorted ascending. Every index appears exactly
    once. The token count is the packed count (sum of lengths), which is what a packed micro-batch
    costs; a padded one costs ``len(batch) * max(length)``.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1 (got {max_tokens})")
    lengths = [int(n) for n in lengths]
    if any(n < 0 for n in lengths):
        raise ValueError("lengths must be >= 0")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = lengths[i]
        if n > max_tokens:
            bins.append([i])
            room.append(0)
            continue
        for b, free in enumerate(room):
            if free >= n:
                bins[b].append(i)
                room[b] = free - n
                break
        else:
            bins.append([i])
            room.append(max_tokens - n)
    return [sorted(b) for b in bins]
