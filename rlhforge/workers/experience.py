"""The experience batch: trajectories -> per-token training tensors.

Per sample (:class:`ExperienceSample`), every per-token field is a 1-D float tensor as long as the
sample's ``input_ids``; position ``t`` belongs to token ``t`` (the same convention as
:func:`rlhforge.models.forward.token_logprobs`: ``logprob[t] = log p(token_t | tokens < t)``), and
only positions with ``action_mask[t] = 1`` (tokens the model generated) carry meaning.

A micro-batch (:func:`collate_experience`) is a dict of tensors, padded or packed:

=================  ==============  ======================================================
``input_ids``      [B, T] / [1, N]  int64; right-padded, or all samples in one packed row
``attention_mask`` [B, T]           padded layout only (packed rows have ``position_ids`` resets)
``position_ids``   [B, T] / [1, N]
``loss_mask``      [B, T] / [1, N]  float: the action mask (1 on generated tokens)
``old_logprobs``   same             actor log-probs at experience time (pi_old of the PPO ratio)
``rollout_logprobs`` same           the engine's sampling log-probs
``ref_logprobs``   same             reference-policy log-probs (zeros without a reference)
``values``         same             critic values V(s_t) of the state before token t (zeros without a critic)
``advantages``     same             per-token advantages
``returns``        same             per-token returns (critic targets)
``is_weights``     same             rollout-vs-trainer importance weights (ones when off)
``seq_lens``       list[int]        packed layout only
``routed_experts`` [B, T, L, K] / [1, N, L, K]  int16, only with ``routing=True`` (MoE routing replay;
                                    -1 = no record, on padding too)
``pixel_values``   [P, D]           a vision-language actor's samples with images (padded layout only):
``image_grid_thw`` [I, 3]           every image of the micro-batch in sample order, and
``mm_token_type_ids`` [B, T]        1 on the image tokens (:func:`rlhforge.data.images.vision_batch`)
=================  ==============  ======================================================

On-policy distillation's ``forward_kl_topk`` mode adds two sample tensors that are not per-token fields:
``teacher_topk_ids`` and ``teacher_topk_logprobs``, ``[len, k]`` each; the actor lays them out like its
micro-batch itself (:func:`rlhforge.workers.distill.topk_batch`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from rlhforge.agents.types import Trajectory

__all__ = ["ExperienceSample", "TOKEN_FIELDS", "samples_from_trajectories", "collate_experience", "pad_rows",
           "unpad_rows"]

TOKEN_FIELDS = ("old_logprobs", "rollout_logprobs", "ref_logprobs", "values", "advantages", "returns", "is_weights")


@dataclass
class ExperienceSample:
    input_ids: list[int]
    loss_mask: list[int]
    """The action mask."""
    reward: float
    """Shaped scalar reward."""
    score: float
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    routing: torch.Tensor | None = None
    """MoE routing replay: the rollout's experts per token, ``[len, layers, top_k]`` (-1: none)."""
    vision: Any = None
    """The sample's images (``data.images.VisionInput`` without the PIL images), the pixels the engine saw."""

    def __len__(self) -> int:
        return len(self.input_ids)


def samples_from_trajectories(trajs: Sequence[Trajectory], rewards: Sequence[float]) -> list[ExperienceSample]:
    out = []
    for t, r in zip(trajs, rewards):
        mask = t.action_mask()
        rollout = torch.zeros(len(t.token_ids))
        positions = [i for i, m in enumerate(mask) if m]
        if len(positions) != len(t.rollout_logprobs):
            raise ValueError(f"trajectory has {len(positions)} action tokens but {len(t.rollout_logprobs)} log-probs")
        if positions:
            rollout[positions] = torch.tensor(t.rollout_logprobs, dtype=torch.float32)
        s = ExperienceSample(list(t.token_ids), mask, float(r), float(t.score if t.score is not None else r))
        s.tensors["rollout_logprobs"] = rollout
        if t.routed_experts is not None:
            s.routing = _fit_routing(torch.as_tensor(t.routed_experts), len(t.token_ids))
        if t.vision is not None:
            s.vision = t.vision.without_images()  # the pixels travel to the workers, not the PIL images
        out.append(s)
    return out


def _fit_routing(routing: torch.Tensor, length: int) -> torch.Tensor:
    """A routing record cut or extended (-1) to ``length`` tokens."""
    if len(routing) >= length:
        return routing[:length].to(torch.int16)
    extra = torch.full((length - len(routing), *routing.shape[1:]), -1, dtype=torch.int16)
    return torch.cat([routing.to(torch.int16), extra])


def pad_rows(rows: Sequence[torch.Tensor], width: int | None = None) -> torch.Tensor:
    """1-D tensors -> right-padded [B, T] (zeros)."""
    width = width or max(len(r) for r in rows)
    out = torch.zeros((len(rows), width), dtype=rows[0].dtype if rows else torch.float32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def unpad_rows(x: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    return [x[i, :n].clone() for i, n in enumerate(lengths)]


def collate_experience(samples: Sequence[ExperienceSample], pad_id: int, packed: bool,
                       fields: Sequence[str] = TOKEN_FIELDS, routing: bool = False,
                       image_token_id: int | None = None) -> dict:
    """A micro-batch (layout in the module docstring). Missing per-token fields become zeros
    (``is_weights``: ones). ``routing``: add ``routed_experts`` when every sample has a record (the
    actor's passes under ``--train.routing_replay``; never the reference's). Samples with images add
    their pixel inputs (``image_token_id``: the model's image token; such batches are padded)."""
    from rlhforge.data.packing import collate_packed, collate_padded

    has_images = any(s.vision is not None for s in samples)
    if has_images and (packed or image_token_id is None):
        raise ValueError("samples with images need padded batches and the model's image token "
                         f"(packed={packed}, image_token_id={image_token_id})")

    items = [{"input_ids": s.input_ids, "loss_mask": s.loss_mask} for s in samples]
    batch = collate_packed(items) if packed else collate_padded(items, pad_id)
    for name in fields:
        default = torch.ones if name == "is_weights" else torch.zeros
        rows = [s.tensors.get(name) if s.tensors.get(name) is not None else default(len(s)) for s in samples]
        if packed:
            batch[name] = torch.cat(rows)[None, :]
        else:
            batch[name] = pad_rows(rows, batch["input_ids"].shape[1])
    if routing and samples and all(s.routing is not None for s in samples):
        recs = [s.routing for s in samples]
        if packed:
            batch["routed_experts"] = torch.cat(recs)[None]
        else:
            out = torch.full((len(recs), batch["input_ids"].shape[1], *recs[0].shape[1:]), -1, dtype=torch.int16)
            for i, r in enumerate(recs):
                out[i, : len(r)] = r
            batch["routed_experts"] = out
    if has_images:
        from rlhforge.data.images import vision_batch

        batch.update(vision_batch(batch["input_ids"], [s.vision for s in samples], image_token_id))
    return batch


def split_packed(x: torch.Tensor, seq_lens: Sequence[int]) -> list[torch.Tensor]:
    """[1, N] packed per-token values -> one 1-D tensor per sample."""
    return list(torch.split(x[0], list(seq_lens)))
