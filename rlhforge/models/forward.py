"""Per-token log-probabilities of a causal LM on padded or packed batches.

``token_logprobs(model, batch)`` returns ``[B, T]`` where position ``t`` holds
``log p(input_ids[t] | tokens < t of the same sample)`` and positions without a prediction (the
first token of each sample, padding) hold 0. It lines up with the ``loss_mask`` of
:mod:`rlhforge.data.packing` batches (``loss_mask[t] = 1``: token ``t`` is a target).

Layouts (see :mod:`rlhforge.data.packing`):

- padded: ``attention_mask`` [B, T] present (right or left padding both work);
- packed: one row, no ``attention_mask``, ``position_ids`` restarting at 0 for every sample
  (``cu_seqlens``/``seq_lens`` optional; the resets define the samples).

Packed batches are *computed* in bounded rows (:func:`packed_rows`): on sdpa/eager/flex the one
packed row of the batch is cut into several rows of about the longest sample's length (first-fit
decreasing, :func:`rlhforge.data.packing.token_budget_batches`), padded to the longest row, and the
results are mapped back to the ``[1, N]`` layout. Attention over one row of N tokens with a dense
block-diagonal mask costs N^2; over rows of length L it costs N * L, so a packed micro-batch never
costs more than the padded one (at most as many rows as samples, none longer than the longest
sample). The padding inside a row gets position id 0 on every token: each pad is a one-token sample
of its own and no real token sees it. ``flash_attention_2``/``3`` keep the single row (varlen
attention is already per sample), and so does CPU sdpa where
:func:`rlhforge.models.segment_attention.segments_apply` (plain causal layers, no gradient
checkpointing): there the attention runs sample by sample inside the row
(:mod:`rlhforge.models.segment_attention`), so no token is padding at all.

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

from dataclasses import dataclass
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
    "PackedRows",
    "packed_rows",
    "packed_model_inputs",
]

_HF_PACKING_IMPLS = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")


def _logprobs_from_logits(logits: Tensor, labels: Tensor, temperature: float) -> Tensor:
    from rlhforge.algorithms.logprobs import logprobs_from_logits

    return logprobs_from_logits(logits, labels, temperature=temperature)


def _entropy_from_logits(logits: Tensor, temperature: float, grad: bool) -> Tensor:
    from rlhforge.algorithms.logprobs import entropy_from_logits

    return entropy_from_logits(logits if grad else logits.detach(), temperature=temperature)


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


def _packed_lengths(batch: Mapping[str, Any]) -> list[int]:
    from rlhforge.data.packing import packed_lengths

    return packed_lengths(batch)


@dataclass
class PackedRows:
    """A one-row packed batch laid out in ``R`` bounded rows of ``L`` tokens (:func:`packed_rows`)."""

    input_ids: Tensor
    """[R, L] the samples, first-fit decreasing into rows; pad id 0 after the last sample of a row."""
    position_ids: Tensor
    """[R, L] the batch's position ids; 0 on every pad (each pad is a one-token sample)."""
    index: Tensor
    """[N] int64: where packed token ``n`` sits in the flattened ``[R * L]`` rows."""

    def to_packed(self, x: Tensor) -> Tensor:
        """Per-row values ``[R, L, ...]`` -> the packed layout ``[1, N, ...]`` (differentiable)."""
        return x.reshape(-1, *x.shape[2:]).index_select(0, self.index).unsqueeze(0)


def packed_rows(batch: Mapping[str, Any], row_tokens: int | None = None) -> PackedRows | None:
    """Cut a one-row packed batch into rows of at most ``max(longest sample, row_tokens)`` tokens.

    Samples go into rows first-fit decreasing (:func:`rlhforge.data.packing.token_budget_batches`);
    rows are right-padded to the longest row. A sample never spans two rows, so there are at most
    as many rows as samples and no row is longer than the padded layout's width when
    ``row_tokens`` is None. Returns None when everything fits in one row anyway.
    """
    from rlhforge.data.packing import token_budget_batches

    input_ids, position_ids = batch["input_ids"], batch["position_ids"]
    if input_ids.shape[0] != 1:
        raise ValueError(f"a packed batch has one row (got {input_ids.shape[0]})")
    lengths = _packed_lengths(batch)
    total = sum(lengths)
    if total != input_ids.shape[1]:
        raise ValueError(f"sample lengths sum to {total} but the packed row has {input_ids.shape[1]} tokens")
    budget = max(max(lengths), int(row_tokens or 0))
    bins = token_budget_batches(lengths, budget)
    if len(bins) == 1:
        return None
    width = max(sum(lengths[i] for i in b) for b in bins)
    packed_start, flat_start = [0] * len(lengths), [0] * len(lengths)
    for i in range(1, len(lengths)):
        packed_start[i] = packed_start[i - 1] + lengths[i - 1]
    for r, members in enumerate(bins):
        at = r * width
        for i in members:
            flat_start[i] = at
            at += lengths[i]
    shift = torch.tensor(flat_start, dtype=torch.long) - torch.tensor(packed_start, dtype=torch.long)
    index = (torch.repeat_interleave(shift, torch.tensor(lengths, dtype=torch.long)) + torch.arange(total))
    index = index.to(input_ids.device)
    ids = input_ids.new_zeros(len(bins) * width).index_copy_(0, index, input_ids[0])
    pos = position_ids.new_zeros(len(bins) * width).index_copy_(0, index, position_ids[0])
    return PackedRows(ids.view(len(bins), width), pos.view(len(bins), width), index)


def packed_model_inputs(
    model,
    batch: Mapping[str, Any],
    *,
    block_mask: Literal["auto", "explicit"] = "auto",
    row_tokens: int | None = None,
    segments: bool = False,
) -> tuple[dict[str, Any], PackedRows | None]:
    """The keyword arguments for ``model(**kwargs)`` on a packed batch, and the row layout used.

    With a :class:`PackedRows` back, the model's per-token outputs are ``[R, L, ...]``: map them
    to the packed ``[1, N, ...]`` layout with ``rows.to_packed``. With None (flash attention, one
    row is enough, or sample-by-sample attention), they are already ``[1, N, ...]``.

    ``segments=True`` (and no ``row_tokens``): on CPU sdpa the one row is kept and the kwargs carry
    the sample boundaries; the call must then run inside
    :func:`rlhforge.models.segment_attention.segment_attention` (else it attends with transformers'
    block-diagonal mask: the same result, N^2 cost).
    """
    input_ids, position_ids = batch["input_ids"], batch["position_ids"]
    kwargs: dict[str, Any] = {"use_cache": False}  # a cache would disable packed-sequence masking
    impl = _attn_implementation(model)
    explicit = block_mask == "explicit" or not (hf_detects_packed_sequences() and impl in _HF_PACKING_IMPLS)
    if explicit and impl is not None and impl not in ("sdpa", "eager"):
        raise ValueError(
            f"packed batches with attn_implementation={impl!r} need transformers' packed-sequence "
            "support; use sdpa, eager or flash_attention_2, or a padded batch"
        )
    rows = None
    if segments and not explicit and row_tokens is None and impl == "sdpa":
        from rlhforge.models.segment_attention import segment_kwargs, segments_apply

        if segments_apply(model, input_ids):
            kwargs.update(segment_kwargs(_packed_lengths(batch), input_ids.device),
                          input_ids=input_ids, position_ids=position_ids)
            return kwargs, None
    if not explicit and impl in ("flash_attention_2", "flash_attention_3"):
        if batch.get("cu_seqlens") is not None:
            # hand the varlen kernel the boundaries directly (else transformers derives them from position_ids)
            cu = batch["cu_seqlens"].to(device=input_ids.device, dtype=torch.int32)
            max_len = int(batch.get("max_seqlen") or int((cu[1:] - cu[:-1]).max()))
            kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)
    else:
        rows = packed_rows(batch, row_tokens)
        if rows is not None:
            input_ids, position_ids = rows.input_ids, rows.position_ids
        if explicit:
            kwargs["attention_mask"] = packed_causal_mask(position_ids, dtype=_model_dtype(model))
    kwargs.update(input_ids=input_ids, position_ids=position_ids)
    return kwargs, rows


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
    row_tokens: int | None = None,
    return_aux_loss: bool = False,
    packed_layout: Literal["auto", "rows"] = "auto",
    share_prefixes: bool = False,
    return_entropy: bool = False,
    entropy_grad: bool = True,
    needed: Tensor | None = None,
) -> Tensor | tuple[Tensor, ...]:
    """Per-token log-probs ``[B, T]`` (fp32) of ``batch["input_ids"]`` under ``model``.

    Args:
        model: an HF causal LM (anything returning ``.logits`` [B, T, V]).
        batch: a padded or packed batch (module docstring); only ``input_ids``,
            ``attention_mask`` (padded), ``position_ids`` and ``routed_experts`` (MoE routing
            replay, :mod:`rlhforge.models.routing`) are read; a vision-language batch (with
            ``pixel_values``, ``image_grid_thw``, ``mm_token_type_ids``) goes through
            :func:`rlhforge.models.vlm.vlm_model_inputs` (padded only).
        temperature: logits are divided by it (match the sampling temperature).
        block_mask: packed batches only. ``"auto"`` relies on transformers' packed-sequence
            detection where it exists; ``"explicit"`` always passes a 4-D block-diagonal mask
            (sdpa/eager only).
        return_logits: also return the raw logits (``[1, N, V]`` for a packed batch).
        return_aux_loss: MoE models: also return the router's load-balancing loss (a scalar,
            :func:`rlhforge.models.moe.load_balancing_loss` over the real tokens only; the forward
            asks for ``output_router_logits``). It comes last in the returned tuple.
        row_tokens: packed batches on sdpa/eager only: compute in rows of at most
            ``max(longest sample, row_tokens)`` tokens (:func:`packed_rows`; None: the longest
            sample, which never costs more than padding). The result does not depend on it.
        packed_layout: packed batches: ``"auto"`` attends sample by sample in the one packed row
            where :func:`rlhforge.models.segment_attention.segments_apply` (CPU sdpa, plain causal
            layers, no ``row_tokens``), else the bounded rows; ``"rows"`` always the rows.
        share_prefixes: compute a prefix shared by several samples (a GRPO group's prompt) once
            (:mod:`rlhforge.models.shared_prefix`) where the sample-by-sample attention applies and the
            batch has no images, routing records or aux loss; the results are those of the batch as is.

        return_entropy: also return the entropy ``[B, T]`` of the distribution that predicted each token
            (0 where the log-probs are 0), differentiable unless ``entropy_grad`` is False.
        needed: ``[B, T]`` (packed: ``[1, N]``) mask of the tokens whose log-prob (and entropy) the caller
            reads, e.g. RL's action mask: the lm_head runs on those positions only (a GRPO prompt is
            often longer than its response) and every other position is 0. Ignored with
            ``return_logits`` and in the bounded-rows packed layout. The values it keeps are unchanged.

    Without ``return_logits`` the full-vocabulary logits are never materialised: the lm_head runs
    chunk by chunk with recomputation in the backward (:mod:`rlhforge.models.chunked_head`; models
    whose forward adds a soft-cap or a scale after the head keep the full logits).

    Returns:
        ``logprobs`` [B, T] with 0 at the first token of each sample and at padding; then, as asked,
        ``logits``, ``entropy``, the aux loss, in that order. Differentiable.
    """
    from rlhforge.models.chunked_head import deferred_head, head_logprobs

    input_ids = batch["input_ids"]
    rows = layout = None
    if batch.get("pixel_values") is not None:  # a VLM batch: padded, positions from the model (M-RoPE)
        from rlhforge.models.vlm import vlm_model_inputs

        kwargs = vlm_model_inputs(model, batch)
    elif share_prefixes and (shared := _shared_prefix_inputs(model, batch, return_aux_loss)) is not None:
        kwargs, layout = shared
    elif is_packed(batch):
        kwargs, rows = packed_model_inputs(model, batch, block_mask=block_mask, row_tokens=row_tokens,
                                           segments=packed_layout == "auto")
    else:
        attention_mask = batch["attention_mask"]
        position_ids = batch.get("position_ids")
        if position_ids is None:  # also right for left padding
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
                  "use_cache": False}
    from rlhforge.models.segment_attention import segment_attention

    with _routing_replay(model, batch, rows), segment_attention(model, kwargs), \
            deferred_head(model, enabled=not return_logits) as head:
        if return_aux_loss:
            kwargs["output_router_logits"] = True
        outputs = model(**kwargs)
        logits = outputs.logits  # the last hidden states where the head is deferred
    if layout is not None:  # back to the batch's own positions
        logits, kwargs["input_ids"] = layout.to_batch(logits, input_ids.shape), input_ids
    ids = kwargs["input_ids"]
    # position t predicts ids[:, t + 1]
    if head is not None and needed is not None and rows is None:
        keep = needed[:, 1:].bool()  # position t predicts token t + 1
        lp, ent = head_logprobs(head, logits[:, :-1][keep], ids[:, 1:][keep], temperature, entropy=return_entropy,
                                entropy_grad=entropy_grad)
        zero = logits.new_zeros(keep.shape, dtype=torch.float32)
        shifted = zero.masked_scatter(keep, lp)
        ent = zero.masked_scatter(keep, ent) if return_entropy else None
    elif head is not None:
        shifted, ent = head_logprobs(head, logits[:, :-1], ids[:, 1:], temperature, entropy=return_entropy,
                                     entropy_grad=entropy_grad)
    else:
        shifted = _logprobs_from_logits(logits[:, :-1], ids[:, 1:], temperature)
        ent = _entropy_from_logits(logits[:, :-1], temperature, entropy_grad) if return_entropy else None
    logprobs = torch.cat([torch.zeros_like(shifted[:, :1]), shifted], dim=1)
    entropy = torch.cat([torch.zeros_like(ent[:, :1]), ent], dim=1) if return_entropy else None
    if rows is not None:
        logprobs = rows.to_packed(logprobs)
        entropy = rows.to_packed(entropy) if return_entropy else None
        if return_logits:
            logits = rows.to_packed(logits)
    predicted = prediction_mask(batch).to(logprobs.dtype)
    if needed is not None and not return_logits:
        predicted = predicted * needed.to(predicted.dtype)
    logprobs = logprobs * predicted
    if return_entropy:  # 0 where nothing is predicted (a sample's first token, padding), as the log-probs
        entropy = entropy * predicted
    out = [logprobs] + ([logits] if return_logits else []) + ([entropy] if return_entropy else [])
    if return_aux_loss:
        from rlhforge.models.moe import load_balancing_loss, moe_routing, token_mask_for_router

        num_experts, top_k = moe_routing(model)
        mask = token_mask_for_router(None if is_packed(batch) else batch["attention_mask"], rows)
        out.append(load_balancing_loss(outputs.router_logits, num_experts, top_k, mask))
    return out[0] if len(out) == 1 else tuple(out)


def _shared_prefix_inputs(model, batch: Mapping[str, Any], aux: bool):
    """(model kwargs, layout) of the batch with its shared prefixes once, or None where that does not apply."""
    from rlhforge.models.segment_attention import segments_apply
    from rlhforge.models.shared_prefix import SPANS_KEY, shared_prefix_layout

    if aux or batch.get("routed_experts") is not None or not segments_apply(model, batch["input_ids"]):
        return None
    layout = shared_prefix_layout(batch)
    if layout is None:
        return None
    return {"input_ids": layout.input_ids, "position_ids": layout.position_ids, "use_cache": False,
            SPANS_KEY: layout.spans}, layout


def _routing_replay(model, batch: Mapping[str, Any], rows: PackedRows | None):
    """Replay the rollout's MoE routing when the batch carries one (``routed_experts``)."""
    import contextlib

    routing = batch.get("routed_experts")
    if routing is None:
        return contextlib.nullcontext()
    from rlhforge.models.routing import replay_routing, routing_for_rows

    return replay_routing(model, routing_for_rows(routing, rows))


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
