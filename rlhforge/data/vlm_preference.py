"""Preference pairs with images (DPO): the pairs of :mod:`rlhforge.data.preference` plus the prompt's images.

Conversational formats only (``apply_chat_template``; the template places the images): with
``prompt_key`` the images go into the prompt messages (a string prompt becomes one user message),
without it into both whole conversations alike, by :func:`rlhforge.data.images.place_images`. Both
sides see the same images; each side's image tokens are expanded to the images' feature counts.
:func:`collate_vlm_pairs` stacks chosen then rejected rows (as :func:`~rlhforge.data.preference.collate_pairs`)
with the pixels in the same order: every pair's images for the chosen rows, then again for the rejected.

Truncation to ``max_len`` keeps the first tokens of each side; cutting image tokens is an error, a pair
with a side left without targets is dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch

from rlhforge.data.images import expand_image_tokens, pixel_inputs, place_images, record_images
from rlhforge.data.preference import PreferenceSample, collate_pairs, preference_sample_from_record
from rlhforge.data.records import check_truncation_drops, get_field, record_ref

__all__ = ["VLMPreferenceSample", "build_vlm_preference_samples", "collate_vlm_pairs"]

logger = logging.getLogger(__name__)


@dataclass
class VLMPreferenceSample(PreferenceSample):
    """A :class:`PreferenceSample` with the prompt's images (None for a text-only pair)."""

    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None


def _with_images(record: Mapping[str, Any], n: int, ref, prompt_key, chosen_key, rejected_key) -> dict:
    rec = dict(record)
    if prompt_key is not None:
        prompt = get_field(record, prompt_key, ref)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if isinstance(messages, list):
            rec[prompt_key] = place_images(messages, n, ref, prompt_key)
        return rec
    for key in (chosen_key, rejected_key):
        conversation = get_field(record, key, ref)
        if isinstance(conversation, list):
            rec[key] = place_images(conversation, n, ref, key)
    return rec


def build_vlm_preference_samples(dataset: Iterable[Mapping[str, Any]], processor, *, prompt_key: str | None = None,
                                 chosen_key: str = "chosen", rejected_key: str = "rejected",
                                 image_key: str = "images", max_images: int = 0,
                                 max_len: int = 512) -> list[VLMPreferenceSample]:
    """Every record as a :class:`VLMPreferenceSample` (module docstring); DataError on a bad record."""
    tokenizer, image_id = processor.tokenizer, processor.image_token_id
    samples, dropped = [], []
    for position, record in enumerate(dataset):
        ref = record_ref(record, position)
        images = record_images(record, image_key, ref, max_images)
        rec = _with_images(record, len(images), ref, prompt_key, chosen_key, rejected_key)
        pair = preference_sample_from_record(rec, tokenizer, ref=ref, prompt_key=prompt_key, chosen_key=chosen_key,
                                             rejected_key=rejected_key, apply_chat_template=True)
        sides = [(pair.chosen_ids, pair.chosen_mask), (pair.rejected_ids, pair.rejected_mask)]
        pixels = grid = None
        if images:
            pixels, grid, counts = pixel_inputs(processor.image_processor, images)
            try:
                sides = [expand_image_tokens(ids, mask, image_id, counts) for ids, mask in sides]
            except ValueError as err:
                raise ref.error(str(err), field=image_key) from None
        for ids, _ in sides:
            if image_id in ids[max_len:]:
                raise ref.error(f"a side has {len(ids)} tokens with its images; truncating it to max_len={max_len} "
                                "would cut image tokens (raise --data.max_len or use smaller images)", field=image_key)
        (c_ids, c_mask), (r_ids, r_mask) = [(ids[:max_len], mask[:max_len]) for ids, mask in sides]
        if not any(c_mask) or not any(r_mask):
            dropped.append(ref)
            continue
        samples.append(VLMPreferenceSample(c_ids, c_mask, r_ids, r_mask, prompt_len=c_mask.index(1),
                                           source=ref.source, index=ref.index, pixel_values=pixels,
                                           image_grid_thw=grid))
    check_truncation_drops(dropped, len(samples), what="preference pairs", max_len=max_len, logger=logger)
    return samples


def collate_vlm_pairs(samples: Sequence[VLMPreferenceSample], pad_id: int, image_token_id: int) -> dict[str, Any]:
    """:func:`collate_pairs` (padded) plus ``pixel_values`` / ``image_grid_thw`` / ``mm_token_type_ids``."""
    batch = collate_pairs(samples, pad_id, packed=False)
    with_images = [s for s in samples if s.pixel_values is not None] * 2  # chosen rows, then rejected rows
    if with_images:
        batch["pixel_values"] = torch.cat([s.pixel_values for s in with_images], 0)
        batch["image_grid_thw"] = torch.cat([s.image_grid_thw for s in with_images], 0)
        batch["mm_token_type_ids"] = (batch["input_ids"] == image_token_id).int()
    return batch
