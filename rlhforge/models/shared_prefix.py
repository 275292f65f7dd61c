"""A prompt shared by several samples is computed once: GRPO groups, RLOO groups, n samples per prompt.

The samples of one prompt repeat its tokens in every row of a micro-batch, and a causal LM computes
the same hidden states for them each time: with 4 samples of a 46-token prompt and 64-token
responses, 40% of the log-prob forward and of the training forward/backward is that repetition.
:func:`shared_prefix_layout` lays a batch out as one row in which each group's common prefix appears
once, followed by each member's own tokens; :func:`rlhforge.models.segment_attention.segment_attention`
then attends every member's tokens to the shared prefix and causally to themselves (one SDPA call per
span, the prefix's keys and values read, not copied per member), and :meth:`SharedPrefixLayout.to_batch`
hands every position of the original batch the output computed for it. The outputs are those of the
original batch (same positions, same attention, float noise apart); the gradients of the shared tokens
are the sums over their members, as in the original.

Groups are found from the tokens alone (:func:`prefix_groups`: sorted samples, longest common prefix
with a group's first member), so nothing has to say which samples share a prompt; a prefix shorter than
``min_prefix`` tokens, or one saving under :data:`MIN_SAVED` of the group's tokens (a DPO pair's short
prompt before long answers), is not worth a group. CPU sdpa only (the same conditions as the packed rows'
sample-by-sample attention, :func:`rlhforge.models.segment_attention.segments_apply`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from rlhforge.data.packing import packed_lengths
from rlhforge.models.segment_attention import SPANS_KEY

__all__ = ["SharedPrefixLayout", "prefix_groups", "shared_prefix_layout", "SPANS_KEY", "MIN_PREFIX"]


MIN_PREFIX = 8
"""Shorter common prefixes are not shared (the saving would not pay for the extra attention calls)."""

MIN_SAVED = 0.05
"""A group is shared only if its prefix, computed once, saves at least this share of the group's tokens. Below it
the members' masked attention costs about what the prefix saves: DPO pairs at max_len 512 (~3% saved) ran 1.41 s
a step shared and 1.39-1.42 s whole; GRPO 16 x 8 x 64 (a 16-token prompt, ~18% saved) trained 1.20-1.23 s a step
shared, 1.42-1.44 s whole, and the benchmark's DPO pairs (b8 len128) 0.257 s against 0.279 (1 thread, this
repository's CPU; docs/performance.md)."""


@dataclass
class SharedPrefixLayout:
    input_ids: Tensor
    """[1, M] each group's shared prefix once, then each member's own tokens."""
    position_ids: Tensor
    """[1, M] every token's position in its own sample."""
    spans: list[tuple[int, int, int, int, Tensor | None]]
    """(start, end, prefix start, prefix end, mask) tiling ``[0, M)``: the tokens ``start:end`` attend to the
    prefix (all of it) and causally to themselves; without a prefix, causal alone (mask None)."""
    source: Tensor
    """[B * T] the position of ``input_ids`` whose output each position of the original batch gets (M: zeros)."""

    def to_batch(self, x: Tensor, shape: Sequence[int]) -> Tensor:
        """Per-token outputs ``[1, M, ...]`` -> the original batch's ``[*shape, ...]`` (differentiable)."""
        flat = torch.cat([x[0], x.new_zeros((1, *x.shape[2:]))])
        return flat.index_select(0, self.source).view(*shape, *x.shape[2:])


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def prefix_groups(seqs: Sequence[Sequence[int]], min_prefix: int = MIN_PREFIX) -> list[tuple[int, list[int]]]:
    """``(shared prefix length, members)`` covering every sample once; singletons have prefix 0.

    A prefix always leaves each member at least one token of its own. Samples are visited in sorted
    order; one joins the current group when its common prefix with the group's first member is at least
    ``min_prefix`` and lowering the group's prefix to it (if it is shorter) loses fewer tokens than it saves.
    """
    groups: list[tuple[int, list[int]]] = []
    for i in sorted(range(len(seqs)), key=lambda i: list(seqs[i])):
        if groups:
            shared, members = groups[-1]
            common = min(_common(seqs[members[0]], seqs[i]), len(seqs[i]) - 1,
                         *(len(seqs[m]) - 1 for m in members))
            if common >= min_prefix and (len(members) == 1 or common >= shared
                                         or (shared - common) * len(members) < common):
                groups[-1] = (common if len(members) == 1 else min(shared, common), members + [i])
                continue
        groups.append((0, [i]))
    return groups


def _worth_sharing(groups: list[tuple[int, list[int]]], seqs) -> list[tuple[int, list[int]]]:
    """Groups whose prefix saves under :data:`MIN_SAVED` of their tokens become singletons: their members
    would attend through an explicit mask (every block computed) instead of the causal kernel's half."""
    out: list[tuple[int, list[int]]] = []
    for shared, members in groups:
        if shared and shared * (len(members) - 1) >= MIN_SAVED * sum(len(seqs[m]) for m in members):
            out.append((shared, members))
        else:
            out.extend((0, [m]) for m in members)
    return out


def _rows(batch: Mapping[str, Any]) -> tuple[list[list[int]], list[Tensor]] | None:
    """Each sample's tokens and their flat positions in the batch, or None if the layout is not plain."""
    ids = batch["input_ids"]
    width = ids.shape[1]
    if batch.get("attention_mask") is None:  # packed: one row, positions restarting at 0
        lengths, flat, seqs, at = packed_lengths(batch), [], [], 0
        row = ids[0].tolist()
        for n in lengths:
            seqs.append(row[at: at + n])
            flat.append(torch.arange(at, at + n))
            at += n
        return seqs, flat
    mask = batch["attention_mask"].bool()
    counts = mask.sum(1).tolist()
    starts = mask.int().argmax(1).tolist()
    position_ids = batch.get("position_ids")
    seqs, flat = [], []
    for b, (start, n) in enumerate(zip(starts, counts)):
        if n == 0 or not bool(mask[b, start: start + n].all()):
            return None  # an empty row or a hole in the mask
        if position_ids is not None and not torch.equal(position_ids[b, start: start + n].cpu(), torch.arange(n)):
            return None  # positions of their own (e.g. M-RoPE): not ours to rebuild
        seqs.append(ids[b, start: start + n].tolist())
        flat.append(torch.arange(b * width + start, b * width + start + n))
    return seqs, flat


def shared_prefix_layout(batch: Mapping[str, Any], min_prefix: int = MIN_PREFIX) -> SharedPrefixLayout | None:
    """The layout of a padded or packed ``batch`` with every shared prefix once; None when none is shared."""
    found = _rows(batch)
    if found is None:
        return None
    seqs, flat = found
    groups = _worth_sharing(prefix_groups(seqs, min_prefix), seqs)
    if all(shared == 0 for shared, _ in groups):
        return None
    device = batch["input_ids"].device
    tokens: list[int] = []
    positions: list[Tensor] = []
    spans: list[tuple[int, int, int, int, Tensor | None]] = []
    total = batch["input_ids"].numel()
    where = [torch.empty(0, dtype=torch.long)] * len(seqs)  # each sample's tokens in the new row
    for shared, members in groups:
        prefix = len(tokens)
        if shared:
            tokens += seqs[members[0]][:shared]
            positions.append(torch.arange(shared))
            spans.append((prefix, prefix + shared, prefix, prefix, None))
        for m in members:
            own = len(seqs[m]) - shared
            start = len(tokens)
            tokens += seqs[m][shared:]
            positions.append(torch.arange(shared, shared + own))
            mask = None
            if shared:
                mask = torch.ones(own, shared + own, dtype=torch.bool)
                mask[:, shared:] = torch.ones(own, own, dtype=torch.bool).tril()
                mask = mask.to(device)
            spans.append((start, start + own, prefix, prefix + shared, mask))
            where[m] = torch.cat([torch.arange(prefix, prefix + shared), torch.arange(start, start + own)])
    source = torch.full((total,), len(tokens), dtype=torch.long)
    source[torch.cat(flat)] = torch.cat(where)
    return SharedPrefixLayout(torch.tensor(tokens, dtype=torch.long, device=device)[None],
                              torch.cat(positions).to(device)[None], spans, source.to(device))
