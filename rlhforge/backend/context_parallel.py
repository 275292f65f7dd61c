"""Context parallelism: ring groups, slicing a packed batch per ring rank, gathering log-probs back.

World layout (as OpenRLHF): ``world = dp x ring``; consecutive ranks form a ring
(ranks ``d*R .. d*R + R-1`` are data-parallel replica ``d``). Every rank of one ring holds the same
packed micro-batch; :func:`slice_packed` pads its row to a multiple of ``R`` and keeps slice
``ring_rank``; the model runs on the slice with ring attention (:mod:`.ring_attention`);
:func:`ring_token_logprobs` gathers the per-token log-probs of all slices, so every ring rank gets
exactly what :func:`rlhforge.models.forward.token_logprobs` gives on one rank.

Gradients: the gather's backward keeps this rank's slice of the incoming gradient (every ring rank
computes the same loss on the same gathered values), and the ring attention backward returns the
K/V gradients to their owners, so the sum over a ring of the parameter gradients is the gradient of
the whole row. A strategy that averages gradients over all ``world`` ranks therefore needs each
rank's loss normalised as if the world had ``world`` ranks but only ``dp`` distinct batches: divide
by the token count of the ``dp`` distinct batches and multiply by ``world`` (what
:func:`rlhforge.algorithms.aggregation.aggregate_token_mean` does with ``dp_size=world``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from rlhforge.backend.ring_attention import RING_ATTN_IMPL, RingLayout, ring_layout_active
from rlhforge.backend.strict_device import place

__all__ = [
    "RingTopology",
    "ring_topology",
    "RingGroup",
    "new_ring_group",
    "single_ring",
    "padded_length",
    "packed_sequence_ids",
    "RingSlice",
    "slice_packed",
    "gather_ring",
    "use_ring_attention",
    "ring_token_logprobs",
    "ring_sequence_rewards",
]


@dataclass(frozen=True)
class RingTopology:
    """``world_size`` ranks as ``dp_size`` rings of ``ring_size`` consecutive ranks."""

    world_size: int
    ring_size: int

    @property
    def dp_size(self) -> int:
        return self.world_size // self.ring_size

    def dp_rank(self, rank: int) -> int:
        return rank // self.ring_size

    def ring_rank(self, rank: int) -> int:
        return rank % self.ring_size

    def rings(self) -> list[list[int]]:
        """The ranks of every ring, data-parallel replica by replica."""
        r = self.ring_size
        return [list(range(d * r, (d + 1) * r)) for d in range(self.dp_size)]


def ring_topology(world_size: int, ring_size: int) -> RingTopology:
    if ring_size < 1 or world_size % ring_size:
        raise ValueError(f"ds.ring_attn_size {ring_size} must divide the {world_size} training ranks "
                         f"(world = data-parallel size x ring size)")
    return RingTopology(world_size, ring_size)


@dataclass(frozen=True)
class RingGroup:
    """This rank's ring: its process group and where this rank sits."""

    group: Any
    ring_rank: int
    ring_size: int
    dp_rank: int
    dp_size: int
    head_stride: int = 1


def new_ring_group(ring_size: int, head_stride: int = 1) -> RingGroup:
    """Create every ring's process group (collective: all ranks call it) and return this rank's."""
    topo = ring_topology(dist.get_world_size(), ring_size)
    rank = dist.get_rank()
    mine = None
    for ranks in topo.rings():
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return RingGroup(mine, topo.ring_rank(rank), ring_size, topo.dp_rank(rank), topo.dp_size, head_stride)


def single_ring(group=None, head_stride: int = 1) -> RingGroup:
    """All ranks of ``group`` (default: the world) as one ring (dp 1)."""
    return RingGroup(group, dist.get_rank(group), dist.get_world_size(group), 0, 1, head_stride)


def padded_length(total: int, ring_size: int) -> int:
    """The row length after padding ``total`` tokens to a multiple of the ring size."""
    return -(-total // ring_size) * ring_size


def packed_sequence_ids(position_ids: Tensor, seq_lens: Sequence[int] | None = None) -> Tensor:
    """[N] int64 sample index of every token of a one-row packed batch (from ``seq_lens`` or position resets)."""
    if seq_lens is not None:
        lens = torch.as_tensor(list(seq_lens), dtype=torch.long)
        return torch.repeat_interleave(torch.arange(len(lens)), lens).to(position_ids.device)
    pos = position_ids.reshape(-1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    return torch.cumsum(starts.long(), 0) - 1


@dataclass
class RingSlice:
    """This ring rank's part of a packed batch (:func:`slice_packed`)."""

    input_ids: Tensor
    """[1, L] the slice's token ids."""
    position_ids: Tensor
    """[1, L] their position ids (within their sample)."""
    layout: RingLayout
    total: int
    """Real tokens in the row (before padding)."""
    extras: dict[str, Tensor] = field(default_factory=dict)
    """[1, L] slices of the other per-token fields asked for (padding 0)."""


def slice_packed(batch: Mapping[str, Any], ring: RingGroup, keys: Sequence[str] = ()) -> RingSlice:
    """Pad the packed row to a multiple of the ring size and keep this rank's contiguous slice.

    The pad tokens (id 0) form one extra sample with positions ``0..pad-1``: no real token sees
    them (a different sample) and they see only each other.
    """
    input_ids, position_ids = batch["input_ids"], batch["position_ids"]
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"ring attention needs a packed batch of one row (got input_ids {tuple(input_ids.shape)})")
    total = input_ids.shape[1]
    padded = padded_length(total, ring.ring_size)
    pad = padded - total
    seq = packed_sequence_ids(position_ids, batch.get("seq_lens"))
    if pad:
        seq = torch.cat([seq, torch.full((pad,), int(seq[-1]) + 1, dtype=seq.dtype, device=seq.device)])
    def padded_row(x: Tensor, fill: Tensor | None = None) -> Tensor:
        tail = fill if fill is not None else x.new_zeros(1, pad)
        return torch.cat([x, tail.to(x.dtype)], dim=1) if pad else x
    n = padded // ring.ring_size
    part = slice(ring.ring_rank * n, (ring.ring_rank + 1) * n)
    ids = padded_row(input_ids)[:, part]
    pos = padded_row(position_ids, torch.arange(pad, device=position_ids.device)[None])[:, part]
    extras = {k: padded_row(batch[k])[:, part] for k in keys}
    layout = RingLayout(ring.group, ring.ring_rank, ring.ring_size, seq, ring.head_stride)
    return RingSlice(ids, pos, layout, total, extras)


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, ring_rank, ring_size):
        parts = [torch.empty_like(x) for _ in range(ring_size)]
        dist.all_gather(parts, place(x.contiguous(), x.device), group=group)  # (marks it in strict mode)
        ctx.ring_rank, ctx.width = ring_rank, x.shape[1]
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        a = ctx.ring_rank * ctx.width
        return grad[:, a : a + ctx.width].contiguous(), None, None, None


def gather_ring(x: Tensor, ring: RingGroup) -> Tensor:
    """``[1, L, ...]`` per ring rank -> ``[1, R * L, ...]`` in slice order, on every ring rank.

    Differentiable: the backward keeps this rank's slice of the gradient (every ring rank is
    expected to compute the same loss from the gathered values).
    """
    if ring.ring_size == 1:
        return x
    return _GatherTokens.apply(x, ring.group, ring.ring_rank, ring.ring_size)


def use_ring_attention(model) -> None:
    """Switch an HF model's attention layers to ring attention (before wrapping it in a strategy)."""
    config = model.config
    for sub in [config, *(getattr(config, k) for k in getattr(config, "sub_configs", {}) or {})]:
        if sub is not None:
            sub._attn_implementation = RING_ATTN_IMPL


def ring_token_logprobs(model, batch: Mapping[str, Any], ring: RingGroup, temperature: float = 1.0, *,
                        return_logits: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`rlhforge.models.forward.token_logprobs` of a packed batch, computed across the ring.

    Every rank of the ring passes the same packed ``batch`` (one row, ``position_ids`` restarting
    per sample) and gets the same ``[1, N]`` log-probs (0 at the first token of each sample).
    ``model`` must use ring attention (:func:`use_ring_attention`). Differentiable. With
    ``return_logits`` also the raw logits of the whole row, ``[1, N, V]`` (gathered: ``N x V`` per rank).
    """
    from rlhforge.algorithms.logprobs import logprobs_from_logits
    from rlhforge.models.forward import prediction_mask

    part = slice_packed(batch, ring)
    n = part.input_ids.shape[1]
    ids = batch["input_ids"]
    # the target of slice position t is the next token of the padded row (its own sample's or not: masked below)
    targets = torch.cat([ids[:, 1:], ids.new_zeros(1, n * ring.ring_size - ids.shape[1] + 1)], dim=1)
    targets = targets[:, ring.ring_rank * n : (ring.ring_rank + 1) * n]
    with ring_layout_active(part.layout):
        logits = model(input_ids=part.input_ids, position_ids=part.position_ids, use_cache=False).logits
    next_logps = gather_ring(logprobs_from_logits(logits, targets, temperature=temperature), ring)  # [1, Npad]
    logps = torch.cat([torch.zeros_like(next_logps[:, :1]), next_logps[:, : part.total - 1]], dim=1)
    logps = logps * prediction_mask(batch).to(logps.dtype)
    if return_logits:
        return logps, gather_ring(logits, ring)[:, : part.total]
    return logps


def ring_sequence_rewards(model, batch: Mapping[str, Any], ring: RingGroup, prefix: str = "score") -> Tensor:
    """:func:`rlhforge.models.reward.sequence_rewards` of a packed batch, computed across the ring.

    Each rank runs its slice and records the value head's per-token output; the ``[1, L]`` values of
    all slices are gathered (a sample's last token lives on one ring rank) and every ring rank reads
    the same ``[S]`` rewards at the samples' last tokens. Differentiable (the gather's backward keeps
    this rank's slice); ``model`` must use ring attention (:func:`use_ring_attention`).
    """
    from rlhforge.models.reward import last_token_index, value_head

    captured: dict[str, Tensor] = {}

    def hook(_module, _inputs, output):
        captured["values"] = output

    part = slice_packed(batch, ring)
    handle = value_head(model, prefix).register_forward_hook(hook)
    try:
        with ring_layout_active(part.layout):
            model(input_ids=part.input_ids, position_ids=part.position_ids, use_cache=False)
    finally:
        handle.remove()
    values = captured["values"]
    if values.dim() == 3:
        if values.shape[-1] != 1:
            raise ValueError(f"the value head has {values.shape[-1]} outputs; a reward model has one label")
        values = values[..., 0]
    values = gather_ring(values, ring)[:, : part.total]  # [1, N]
    return values[0, last_token_index(batch).to(values.device)]
