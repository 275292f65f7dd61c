"""Images in data records: reading them, placing them in the conversation, pixel inputs, collation.

A record's images are in ``record[image_key]`` (``--data.image_key``, default ``images`` as
OpenRLHF): one value or a list of them, each

- a path, relative to the dataset file's folder (or to the dataset folder), or absolute;
- a ``data:image/...;base64,...`` URI or a bare base64 string of an image file's bytes;
- a PIL image, or ``{"bytes": ..., "path": ...}`` (a ``datasets`` ``Image`` feature, decoded or not);
- ``http(s)://`` URLs are refused: nothing is downloaded (save the images beside the data).

A missing key, ``None`` or ``[]`` means no image (a text-only sample). More than
``max_images_per_prompt`` images (when > 0) is an error. Every error is a
:class:`~rlhforge.data.errors.DataError` naming the file, the record and the image
(``data.jsonl, record 3, field 'images[1]': image file not found: /data/img/cat.png``).

Placement (:func:`place_images`), the rule the chat template then renders:

1. messages whose ``content`` is a list with ``{"type": "image"}`` parts: the record's images fill
   those parts in order (their number must match);
2. else string contents with ``<image>`` placeholders: each placeholder becomes an image part, in
   order (their number must match);
3. else (no placeholder at all): every image goes at the start of the first user message.

The chat template renders one image part as its vision tokens with one image token (Qwen2-VL:
``<|vision_start|><|image_pad|><|vision_end|>``); :func:`expand_image_tokens` repeats that token
to the image's feature count, ``image_grid_thw.prod() / merge_size**2`` (what the processor does),
on the token ids, so the assistant mask found on the short rendering stays exact.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from rlhforge.data.errors import describe_value
from rlhforge.data.records import RecordRef

__all__ = ["IMAGE_PLACEHOLDER", "VisionInput", "load_image", "record_images", "place_images", "pixel_inputs",
           "expand_image_tokens", "collate_vlm", "vision_batch", "vision_input"]

IMAGE_PLACEHOLDER = "<image>"


@dataclass
class VisionInput:
    """The images of one token sequence (an RL prompt, a trajectory so far), in the order of its image
    tokens: what the generation engine and the trainer's forward both receive.

    ``pixel_values`` [P, D] and ``image_grid_thw`` [n, 3] are the image processor's output
    (:func:`pixel_inputs`); the sequence holds ``image_grid_thw[k].prod() // merge_size**2`` image tokens for
    image ``k``. ``images`` keeps the RGB PIL images (vLLM processes them itself); None when only the
    pixels travel (they are what the HF engine and the trainer use).
    """

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    images: list | None = None
    merge_size: int = 2
    """The image processor's spatial merge (patches per image token: ``merge_size**2``)."""

    @property
    def num_images(self) -> int:
        return int(self.image_grid_thw.shape[0])

    def __add__(self, other: "VisionInput | None") -> "VisionInput":
        """This sequence's images followed by ``other``'s (a later turn's)."""
        if other is None:
            return self
        images = None if self.images is None or other.images is None else [*self.images, *other.images]
        return VisionInput(torch.cat([self.pixel_values, other.pixel_values]),
                           torch.cat([self.image_grid_thw, other.image_grid_thw]), images, self.merge_size)

    @property
    def num_tokens(self) -> int:
        """Image tokens the sequence holds for these images."""
        return int(self.image_grid_thw.prod(-1).sum()) // self.merge_size ** 2

    def without_images(self) -> "VisionInput":
        """The pixels only (for shipping to trainer workers: the PIL images are for engines)."""
        return VisionInput(self.pixel_values, self.image_grid_thw, None, self.merge_size)


def vision_batch(input_ids: torch.Tensor, visions: Sequence["VisionInput | None"], image_token_id: int
                 ) -> dict[str, torch.Tensor]:
    """The pixel inputs of a padded batch whose row ``b`` has the images ``visions[b]`` (None: none)::

        pixel_values       [P, D] float  every row's patches, row by row (absent when no row has an image)
        image_grid_thw     [I, 3] int64
        mm_token_type_ids  [B, T] int32  1 on the image token

    A row whose image-token count differs from its images' feature count is a ValueError (the model
    would scatter the features to the wrong tokens)."""
    present = [v for v in visions if v is not None]
    if not present:
        return {}
    mm = (input_ids == image_token_id).int()
    tokens = mm.sum(-1).tolist()
    for b, v in enumerate(visions):
        need = 0 if v is None else v.num_tokens
        if tokens[b] != need:
            raise ValueError(f"row {b} has {tokens[b]} image tokens but its images need {need}")
    return {"pixel_values": torch.cat([v.pixel_values for v in present]),
            "image_grid_thw": torch.cat([v.image_grid_thw for v in present]).long(), "mm_token_type_ids": mm}


_BASE64 = re.compile(r"^[A-Za-z0-9+/=\s]+$")


def _base_dir(source: str | None) -> Path:
    if not source or source.startswith(("<", "builtin:")):
        return Path.cwd()
    path = Path(source).expanduser()
    return path if path.is_dir() else path.parent


def _open(data: bytes, ref: RecordRef, field: str, what: str):
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise ref.error(f"unreadable image ({what}): {err}", field=field) from None
    return image.convert("RGB")


def load_image(value: Any, ref: RecordRef, field: str):
    """One image value (module docstring) -> an RGB ``PIL.Image``; DataError naming ``field`` otherwise."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, Mapping) and ("bytes" in value or "path" in value):  # datasets Image feature
        if value.get("bytes"):
            return _open(value["bytes"], ref, field, "bytes")
        value = value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return _open(bytes(value), ref, field, "bytes")
    if not isinstance(value, str) or not value.strip():
        raise ref.error(f"expected an image path, base64 string or image, got {describe_value(value)}", field=field)
    text = value.strip()
    if text.startswith(("http://", "https://")):
        raise ref.error(f"image URLs are not downloaded ({text[:80]}): save the image and give its path, "
                        "relative to the dataset file", field=field)
    if text.startswith("data:"):
        header, _, payload = text.partition(",")
        if ";base64" not in header:
            raise ref.error(f"a data: URI image must be base64-encoded (got {header[:40]!r})", field=field)
        return _open(_b64(payload, ref, field), ref, field, "data: URI")
    path = Path(text).expanduser()
    if not path.is_absolute():
        path = _base_dir(ref.source) / path
    if path.is_file():
        return _open(path.read_bytes(), ref, field, str(path))
    if len(text) > 64 and _BASE64.match(text):
        return _open(_b64(text, ref, field), ref, field, "base64")
    raise ref.error(f"image file not found: {path}", field=field)


def _b64(payload: str, ref: RecordRef, field: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=False)
    except (binascii.Error, ValueError) as err:
        raise ref.error(f"invalid base64 image data: {err}", field=field) from None


def record_images(record: Mapping[str, Any], image_key: str, ref: RecordRef, max_images: int = 0) -> list:
    """The record's images as RGB PIL images (``[]`` without any); ``max_images > 0`` bounds the count."""
    value = record.get(image_key)
    if value is None:
        return []
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if max_images > 0 and len(values) > max_images:
        raise ref.error(f"has {len(values)} images, more than --data.max_images_per_prompt {max_images}",
                        field=image_key)
    return [load_image(v, ref, f"{image_key}[{i}]") for i, v in enumerate(values)]


def _is_image_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") in ("image", "image_url")


def place_images(messages: Sequence[dict], n_images: int, ref: RecordRef, field: str) -> list[dict]:
    """``messages`` with exactly ``n_images`` image parts, by the rule of the module docstring."""
    messages = [dict(m) for m in messages]
    parts = sum(1 for m in messages if isinstance(m.get("content"), list)
                for p in m["content"] if _is_image_part(p))
    placeholders = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages if isinstance(m.get("content"), str))
    if parts:
        if parts != n_images or placeholders:
            raise ref.error(f"the messages have {parts} image parts{f' and {placeholders} <image> placeholders' if placeholders else ''} "
                            f"but the record has {n_images} images", field=field)
        return messages
    if placeholders:
        if placeholders != n_images:
            raise ref.error(f"the messages have {placeholders} <image> placeholders but the record has {n_images} images",
                            field=field)
        for m in messages:
            if isinstance(m.get("content"), str) and IMAGE_PLACEHOLDER in m["content"]:
                pieces = m["content"].split(IMAGE_PLACEHOLDER)
                content: list[dict] = []
                for i, piece in enumerate(pieces):
                    if i:
                        content.append({"type": "image"})
                    if piece:
                        content.append({"type": "text", "text": piece})
                m["content"] = content
        return messages
    if n_images:
        first_user = next((m for m in messages if m.get("role") == "user"), None)
        if first_user is None:
            raise ref.error(f"the record has {n_images} images but no user message to put them in", field=field)
        text = first_user["content"]
        rest = text if isinstance(text, list) else [{"type": "text", "text": text}] if text else []
        first_user["content"] = [{"type": "image"} for _ in range(n_images)] + rest
    return messages


def pixel_inputs(image_processor, images: Sequence) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``(pixel_values [patches, D], image_grid_thw [n, 3], tokens per image)`` from the image processor."""
    out = image_processor(images=list(images), return_tensors="pt")
    grid = out["image_grid_thw"].long()
    merge = int(getattr(image_processor, "merge_size", 1))
    counts = (grid.prod(-1) // (merge * merge)).tolist()
    return out["pixel_values"], grid, [int(c) for c in counts]


def vision_input(image_processor, images: Sequence, keep_images: bool = True) -> tuple[VisionInput, list[int]]:
    """``(VisionInput, tokens per image)`` of ``images`` (RGB PIL images) under ``image_processor``."""
    pixel_values, grid, counts = pixel_inputs(image_processor, images)
    merge = int(getattr(image_processor, "merge_size", 1))
    return VisionInput(pixel_values, grid, list(images) if keep_images else None, merge), counts


def expand_image_tokens(ids: Sequence[int], mask: Sequence[int], image_token_id: int,
                        counts: Sequence[int]) -> tuple[list[int], list[int]]:
    """Repeat the ``k``-th image token ``counts[k]`` times (its mask value with it)."""
    positions = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(positions) != len(counts):
        raise ValueError(f"the rendered conversation has {len(positions)} image tokens for {len(counts)} images "
                         "(does the chat template render image content parts?)")
    out_ids, out_mask, k = [], [], 0
    for t, m in zip(ids, mask):
        n = counts[k] if t == image_token_id else 1
        k += t == image_token_id
        out_ids += [t] * n
        out_mask += [m] * n
    return out_ids, out_mask


def collate_vlm(samples: Sequence[Any], pad_id: int, image_token_id: int) -> dict[str, Any]:
    """:func:`rlhforge.data.packing.collate_padded` plus the samples' images, in sample order::

        pixel_values       [P, D] float  every image's patches (None when no sample has an image)
        image_grid_thw     [I, 3] int64  one row per image
        mm_token_type_ids  [B, T] int32  1 on the image token
    """
    from rlhforge.data.packing import collate_padded

    batch: dict[str, Any] = collate_padded(samples, pad_id)
    pixels = [s.pixel_values for s in samples if getattr(s, "pixel_values", None) is not None]
    grids = [s.image_grid_thw for s in samples if getattr(s, "image_grid_thw", None) is not None]
    if pixels:
        batch["pixel_values"] = torch.cat(pixels, 0)
        batch["image_grid_thw"] = torch.cat(grids, 0)
        batch["mm_token_type_ids"] = (batch["input_ids"] == image_token_id).int()
    return batch
