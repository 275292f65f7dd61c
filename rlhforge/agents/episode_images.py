"""Images in environment feedback (OpenRLHF's ``environment_images``): from a step's images and
feedback text to the token pieces an :class:`~rlhforge.agents.episode.Episode` appends.

An environment step may return ``environment_images`` (one image or a list: PIL images, file paths -
relative to the working directory - ``data:`` URIs or base64 strings, ``datasets`` images; read by
:func:`rlhforge.data.images.load_image`, URLs refused) together with its ``environment_feedback`` text.

**Placement.** With ``<image>`` placeholders in the feedback text, the images fill them in order (their
numbers must match); without any placeholder every image goes before the text. Without images the text
is tokenised whole, as it always was (a literal ``<image>`` stays text).

**Tokens.** Each image becomes what the chat template renders for an image part, with its image token
expanded to the image's feature count: ``<|vision_start|>`` + ``<|image_pad|>`` x count +
``<|vision_end|>`` (Qwen2-VL / Qwen2.5-VL; count = ``image_grid_thw.prod() / merge_size**2``). The text
pieces around the placeholders are tokenised one by one (``add_special_tokens=False``). The actor's
tokenizer must be a :class:`rlhforge.models.vlm.VisionProcessor` (it has the image processor); a text
actor given images is an :class:`AgentError` naming the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from rlhforge.agents.types import AgentError
from rlhforge.data.images import IMAGE_PLACEHOLDER, VisionInput, load_image, vision_input

__all__ = ["FeedbackPiece", "feedback_pieces", "image_list", "check_image_tokens", "VISION_START", "VISION_END"]

VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


@dataclass
class FeedbackPiece:
    """A run of feedback tokens: text, or one whole image (``vision`` set: never split by the budget)."""

    ids: list[int]
    vision: VisionInput | None = None


class _StepRef:
    """Stands in for a :class:`~rlhforge.data.records.RecordRef` in :func:`load_image`: a bad image
    becomes an :class:`AgentError` naming the step and the image (the executor adds the sample)."""

    source = None  # relative paths: from the working directory
    line = None

    def __init__(self, what: str):
        self.what = what

    def error(self, message: str, field: str | None = None) -> AgentError:
        return AgentError(f"{self.what} {field}: {message}")


def image_list(value: Any) -> list:
    """``environment_images`` as a list (None / ``[]`` -> no image; one value -> one image)."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _token_id(tokenizer, token: str, what: str) -> int:
    tid = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(tid, int) or tid == getattr(tokenizer, "unk_token_id", None):
        raise AgentError(f"{what} returned environment_images but the tokenizer has no {token} token "
                         "(images in feedback need a Qwen2-VL-style chat template)")
    return tid


def feedback_pieces(ctx, feedback: str | Sequence[int], images: Sequence, what: str) -> list[FeedbackPiece]:
    """The pieces of one feedback with images, in order (module docstring). ``ctx`` is the episode's
    :class:`~rlhforge.agents.episode.EpisodeContext` (its tokenizer and lock); ``what`` names the step."""
    tok = ctx.tokenizer
    processor = getattr(tok, "image_processor", None)
    if processor is None:
        raise AgentError(f"{what} returned {len(images)} environment_images but the actor is a text model (its "
                         "tokenizer has no image processor): images in feedback need a vision-language actor")
    ref = _StepRef(what)
    pil = [load_image(v, ref, f"environment_images[{k}]") for k, v in enumerate(images)]
    if isinstance(feedback, str):
        n_slots = feedback.count(IMAGE_PLACEHOLDER)
        if n_slots and n_slots != len(pil):
            raise AgentError(f"{what} environment_feedback has {n_slots} {IMAGE_PLACEHOLDER} placeholders but "
                             f"{len(pil)} environment_images (give one per placeholder, or none: then the images "
                             "go before the text)")
        texts = feedback.split(IMAGE_PLACEHOLDER) if n_slots else [""] * len(pil) + [feedback]
        text_ids = [ctx.encode(t) if t else [] for t in texts]
    else:  # token ids: no placeholder possible, the images go first
        text_ids = [[]] * len(pil) + [[int(i) for i in feedback]]
    start, end = _token_id(tok, VISION_START, what), _token_id(tok, VISION_END, what)
    pieces = [FeedbackPiece(text_ids[0])]
    for image, ids in zip(pil, text_ids[1:]):
        vision, (count,) = vision_input(processor, [image])
        pieces.append(FeedbackPiece([start] + [tok.image_token_id] * count + [end], vision))
        pieces.append(FeedbackPiece(ids))
    return [p for p in pieces if p.ids]


def check_image_tokens(ids: Sequence[int], vision: VisionInput | None, tokenizer, what: str) -> None:
    """AgentError unless ``ids`` hold exactly the image tokens ``vision``'s images need."""
    if vision is None:
        return
    have = sum(1 for t in ids if t == tokenizer.image_token_id)
    if have != vision.num_tokens:
        raise AgentError(f"{what} has {have} image tokens but its {vision.num_images} images need "
                         f"{vision.num_tokens} (an observation rewritten by reset must keep the prompt's image tokens)")
