"""RL prompts with images: a record -> the prompt's token ids (image tokens expanded) + its images.

``vlm_prompt(record, processor, ref, ...)`` reads the prompt field (a string becomes one user
message; a list of messages is used as given), reads ``record[image_key]``
(:mod:`rlhforge.data.images`: paths relative to the dataset file, base64, PIL / ``datasets``
images; URLs refused), places the images by the rule of :func:`rlhforge.data.images.place_images`,
renders the conversation with the chat template and the generation prompt, and expands each image
token to the image's feature count. The result is what both the generation engine and the trainer
see: the token ids and one :class:`~rlhforge.data.images.VisionInput` (None for a text-only record).
"""

from __future__ import annotations

from typing import Any, Mapping

from rlhforge.data.images import VisionInput, expand_image_tokens, place_images, record_images, vision_input
from rlhforge.data.records import RecordRef, get_field, get_messages
from rlhforge.data.templates import encode_prompt, render_chat

__all__ = ["vlm_prompt"]


def vlm_prompt(record: Mapping[str, Any], processor, ref: RecordRef, *, input_key: str, image_key: str = "images",
               max_images: int = 0) -> tuple[Any, list[int], VisionInput | None]:
    """``(the prompt field as given, prompt ids, images)``; a DataError names the record, field and image.

    ``processor``: a :class:`rlhforge.models.vlm.VisionProcessor` (``tokenizer``, ``image_processor``,
    ``image_token_id``)."""
    raw = get_field(record, input_key, ref)
    if isinstance(raw, str):
        if not raw.strip():
            raise ref.error("is an empty prompt", field=input_key)
        messages = [{"role": "user", "content": raw}]
    elif isinstance(raw, list):
        messages = get_messages(record, input_key, ref, value=raw)
    else:
        from rlhforge.data.errors import describe_value

        raise ref.error(f"expected a string or a list of messages (the prompt), got {describe_value(raw)}",
                        field=input_key)
    images = record_images(record, image_key, ref, max_images)
    messages = place_images(messages, len(images), ref, input_key)
    try:
        text = render_chat(processor.tokenizer, messages, add_generation_prompt=True)
    except (ValueError, TypeError) as err:
        raise ref.error(f"cannot be rendered as a prompt: {err}", field=input_key) from None
    ids = encode_prompt(processor.tokenizer, text, chat=True)
    if not images:
        return raw, ids, None
    vision, counts = vision_input(processor.image_processor, images)
    try:
        ids, _ = expand_image_tokens(ids, [0] * len(ids), processor.image_token_id, counts)
    except ValueError as err:
        raise ref.error(str(err), field=image_key) from None
    return raw, ids, vision
