"""SFT samples with images: the conversation of :mod:`rlhforge.data.sft` plus the record's images.

``build_vlm_sft_samples(dataset, processor, ...)`` takes the chat-template modes of
:func:`rlhforge.data.sft.build_sft_samples` (``{"messages"}``, or prompt/response keys rendered as a
conversation; a chat template is required: it places the images), reads ``record[image_key]``
(:mod:`rlhforge.data.images`), places the images (image parts, ``<image>`` placeholders, or the first
user message), tokenises the conversation (targets: the assistant tokens, as for text), runs the image
processor and expands each image token to the image's feature count. ``processor`` is a
:class:`rlhforge.models.vlm.VisionProcessor` (anything with ``tokenizer``, ``image_processor``,
``image_token_id``).

Truncation to ``max_len`` keeps the first tokens; a sample whose image tokens would be cut is an
error (the model needs every image token for its features, OpenRLHF refuses over-long VLM prompts too);
a sample left without targets is dropped as for text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch

from rlhforge.data.images import expand_image_tokens, pixel_inputs, place_images, record_images
from rlhforge.data.records import RecordRef, check_truncation_drops, record_ref
from rlhforge.data.sft import SFTSample, _conversation
from rlhforge.data.templates import tokenize_conversation

__all__ = ["VLMSFTSample", "build_vlm_sft_samples", "vlm_sft_sample_from_record"]

logger = logging.getLogger(__name__)


@dataclass
class VLMSFTSample(SFTSample):
    """An :class:`SFTSample` with its images' processor outputs (None for a text-only record)."""

    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None

    @property
    def num_images(self) -> int:
        return 0 if self.image_grid_thw is None else int(self.image_grid_thw.shape[0])


def vlm_sft_sample_from_record(record: Mapping[str, Any], processor, *, ref: RecordRef, input_key: str,
                               output_key: str | None, multiturn: bool, image_key: str,
                               max_images: int) -> VLMSFTSample:
    images = record_images(record, image_key, ref, max_images)
    messages = _conversation(record, ref, input_key, output_key, multiturn)
    messages = place_images(messages, len(images), ref, input_key)
    try:
        ids, spans = tokenize_conversation(processor.tokenizer, messages, last_turn_only=not multiturn)
    except ValueError as err:
        raise ref.error(str(err), field=input_key) from None
    mask = [0] * len(ids)
    for start, end in spans:
        mask[start:end] = [1] * (end - start)
    pixel_values = grid = None
    if images:
        pixel_values, grid, counts = pixel_inputs(processor.image_processor, images)
        try:
            ids, mask = expand_image_tokens(ids, mask, processor.image_token_id, counts)
        except ValueError as err:
            raise ref.error(str(err), field=image_key) from None
    mask[0] = 0
    return VLMSFTSample(ids, mask, ref.source, ref.index, pixel_values=pixel_values, image_grid_thw=grid)


def build_vlm_sft_samples(dataset: Iterable[Mapping[str, Any]], processor, *, input_key: str = "messages",
                          output_key: str | None = None, multiturn: bool = False, image_key: str = "images",
                          max_images: int = 0, max_len: int = 2048) -> list[VLMSFTSample]:
    """Every record of ``dataset`` as a :class:`VLMSFTSample` (module docstring); DataError on a bad record."""
    if not getattr(processor.tokenizer, "chat_template", None):
        raise ValueError("SFT with images needs a chat template (it places the images); set "
                         "--data.tokenizer_chat_template")
    image_id = processor.image_token_id
    samples, dropped = [], []
    for position, record in enumerate(dataset):
        ref = record_ref(record, position)
        sample = vlm_sft_sample_from_record(record, processor, ref=ref, input_key=input_key, output_key=output_key,
                                            multiturn=multiturn, image_key=image_key, max_images=max_images)
        if len(sample.input_ids) > max_len:
            cut = sample.input_ids[max_len:]
            if image_id in cut:
                raise ref.error(f"the sample has {len(sample.input_ids)} tokens with its images; truncating it to "
                                f"max_len={max_len} would cut image tokens (raise --data.max_len or use smaller "
                                "images)", field=image_key)
            sample.input_ids, sample.loss_mask = sample.input_ids[:max_len], sample.loss_mask[:max_len]
        if sample.num_targets == 0:
            dropped.append(ref)
            continue
        samples.append(sample)
    check_truncation_drops(dropped, len(samples), what="SFT samples", max_len=max_len, logger=logger)
    return samples
