"""Vision-language models for training: detection, loading (model + image processor), the vision
tower (freezing, LoRA on the language model only) and the forward inputs with pixels.

- :func:`is_vlm_config` / :func:`is_vlm`: a model is a VLM when its config has a ``vision_config``
  and ``AutoModelForImageTextToText`` maps its config class (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Gemma 3,
  LLaVA, ...).
- :func:`load_processor`: the :class:`VisionProcessor` of a hub id or folder: its tokenizer and
  its image processor (``AutoImageProcessor``). transformers 5.19's ``AutoProcessor`` needs
  torchvision for Qwen2-VL's *video* processor; the training pipeline only needs the image part,
  so it is loaded on its own and works without torchvision. Its ``save_pretrained`` writes
  tokenizer, image processor and the source's ``processor_config.json`` /
  ``video_preprocessor_config.json`` / chat template, so an export reloads with
  ``AutoProcessor.from_pretrained`` where torchvision is installed.
- :func:`load_vlm`: ``AutoModelForImageTextToText`` through :func:`rlhforge.models.loading.load_causal_lm`
  (dtype, attention, gradient checkpointing), then ``freeze_visual_encoder`` and LoRA restricted to
  the language model's linear layers (:func:`language_model_lora_targets`).
- :func:`vlm_model_inputs`: the ``model(**kwargs)`` arguments of a padded batch carrying
  ``pixel_values`` and ``image_grid_thw``: no ``position_ids`` (Qwen2-VL's M-RoPE positions are
  3-D and computed by the model from the image grid, ``mm_token_type_ids`` and the attention mask),
  ``mm_token_type_ids`` = 1 on the image token (from the collated batch). Packed batches are refused (as OpenRLHF: packing
  needs 1-D positions); trainers fall back to padding.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

import torch

#: attribute names of a vision tower, per family (transformers 5: ``model.model.visual`` for Qwen-VL,
#: ``model.model.vision_tower`` for Gemma 3 / LLaVA, ``vision_model`` for Idefics/SmolVLM)
VISION_TOWER_NAMES = ("visual", "vision_tower", "vision_model")
_PROCESSOR_FILES = ("processor_config.json", "video_preprocessor_config.json", "chat_template.jinja",
                    "chat_template.json")


#: model types whose pixel inputs (``pixel_values`` [patches, D], ``image_grid_thw``, M-RoPE from
#: ``mm_token_type_ids``) this module builds and the tests check; other VLMs are refused for now.
#: Qwen3-VL has the same inputs, image token and ``get_rope_index`` signature as Qwen2-VL (its
#: DeepStack features and interleaved M-RoPE live inside the model): tests/models/test_vlm_family3.py
SUPPORTED_VLM_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def check_supported_vlm(path: str, trust_remote_code: bool = False) -> None:
    """ValueError unless ``path`` is a VLM of :data:`SUPPORTED_VLM_TYPES`."""
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).model_type
    if model_type not in SUPPORTED_VLM_TYPES:
        raise ValueError(f"{path} is a {model_type} vision-language model; rlhforge trains "
                         f"{', '.join(SUPPORTED_VLM_TYPES)} so far (docs/vlm.md)")


def is_vlm_config(config) -> bool:
    from transformers import AutoModelForImageTextToText

    return getattr(config, "vision_config", None) is not None and type(config) in AutoModelForImageTextToText._model_mapping


def is_vlm(path: str, trust_remote_code: bool = False) -> bool:
    """Whether ``path`` (hub id or folder) holds a vision-language model (reads its config only)."""
    from transformers import AutoConfig

    from rlhforge.models.loading import check_model_path

    check_model_path(path)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return False
    return is_vlm_config(config)


@dataclass
class VisionProcessor:
    """Tokenizer + image processor of one VLM (what the data pipeline and the export need)."""

    tokenizer: Any
    image_processor: Any
    source: str
    image_token: str = "<|image_pad|>"

    @property
    def image_token_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids(self.image_token)

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def merge_size(self) -> int:
        return int(getattr(self.image_processor, "merge_size", 1))

    @property
    def placeholder_token_ids(self) -> list[int]:
        """The image / video placeholder tokens a response must never hold (they stand for features)."""
        ids = [self.image_token_id]
        video = self.tokenizer.convert_tokens_to_ids("<|video_pad|>")
        if isinstance(video, int) and video != self.tokenizer.unk_token_id:
            ids.append(video)
        return ids

    def __getattr__(self, name: str):
        """Everything else is the tokenizer's (decode, apply_chat_template, ...): RL code takes the
        processor wherever it takes a tokenizer."""
        if name.startswith("__") or name in ("tokenizer", "image_processor", "source", "image_token"):
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def save_pretrained(self, out_dir: str | Path) -> None:
        out = Path(out_dir)
        self.tokenizer.save_pretrained(out)
        self.image_processor.save_pretrained(out)
        for name in _PROCESSOR_FILES:
            src = _source_file(self.source, name)
            if src is not None and not (out / name).exists():
                shutil.copyfile(src, out / name)


def _source_file(source: str, name: str) -> str | None:
    local = Path(source).expanduser() / name
    if local.is_file():
        return str(local)
    try:
        from transformers.utils import cached_file

        return cached_file(source, name, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False)
    except (OSError, ValueError):
        return None


def load_processor(path: str, *, chat_template: str | None = None, use_fast: bool = True) -> VisionProcessor:
    """Tokenizer (right padding, pad token set; ``chat_template`` overrides) + image processor of ``path``."""
    from transformers import AutoImageProcessor

    from rlhforge.models.loading import load_tokenizer

    tokenizer = load_tokenizer(path, chat_template=chat_template, use_fast=use_fast)
    if not getattr(tokenizer, "chat_template", None):  # older processors keep it in chat_template.json
        legacy = _source_file(path, "chat_template.json")
        if legacy is not None:
            import json

            tokenizer.chat_template = json.loads(Path(legacy).read_text()).get("chat_template")
    try:
        image_processor = AutoImageProcessor.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise FileNotFoundError(f"could not load an image processor from {path!r}: {err}") from err
    image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
    if tokenizer.convert_tokens_to_ids(image_token) in (None, tokenizer.unk_token_id):
        raise ValueError(f"{path}: the tokenizer has no image token {image_token!r}")
    return VisionProcessor(tokenizer, image_processor, str(path), image_token)


def image_token_of(tokenizer) -> int | None:
    """The image token of a :class:`VisionProcessor` (a VLM run's tokenizer); None for a text tokenizer."""
    return tokenizer.image_token_id if getattr(tokenizer, "image_processor", None) is not None else None


def load_policy(path: str, model_cfg, ds_cfg, device: torch.device, tokenizer, *,
                freeze_visual_encoder: bool = False):
    """An RL policy (actor or reference): :func:`load_vlm` when ``tokenizer`` is a :class:`VisionProcessor`,
    else :func:`rlhforge.models.loading.load_causal_lm`."""
    if image_token_of(tokenizer) is not None:
        return load_vlm(path, model_cfg, ds_cfg, device, freeze_visual_encoder=freeze_visual_encoder)
    from rlhforge.models.loading import load_causal_lm

    return load_causal_lm(path, model_cfg, ds_cfg, device)


def vision_tower(model) -> torch.nn.Module:
    """The vision encoder module of a (possibly PEFT-wrapped) VLM, found by :data:`VISION_TOWER_NAMES`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for owner in (base, getattr(base, "model", None)):
        for name in VISION_TOWER_NAMES:
            module = getattr(owner, name, None) if owner is not None else None
            if isinstance(module, torch.nn.Module):
                return module
    raise ValueError(f"{type(base).__name__}: no vision tower found (looked for {', '.join(VISION_TOWER_NAMES)})")


def freeze_vision_tower(model) -> int:
    """``requires_grad=False`` on every vision-tower parameter; returns how many parameters were frozen."""
    params = list(vision_tower(model).parameters())
    for p in params:
        p.requires_grad_(False)
    return sum(p.numel() for p in params)


def language_model_lora_targets(model, targets: tuple[str, ...] | list[str]) -> list[str]:
    """Full names of the linear layers LoRA should adapt: inside the language model only (not the
    vision tower, not the output head), filtered by ``targets`` (``all-linear``, or module-name suffixes)."""
    tower = {id(m) for m in vision_tower(model).modules()}
    names = []
    everything = list(targets) == ["all-linear"]
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or id(module) in tower or name.endswith("lm_head"):
            continue
        if everything or any(name == t or name.endswith("." + t) for t in targets):
            names.append(name)
    if not names:
        raise ValueError(f"no linear layer of the language model matches --ds.lora.target_modules {list(targets)}")
    return names


def load_vlm(path: str, model_cfg, ds_cfg, device: torch.device, *, freeze_visual_encoder: bool = False):
    """``AutoModelForImageTextToText`` in fp32 master precision; vision tower frozen on request;
    LoRA (``ds_cfg.lora.rank > 0``) on the language model's linear layers only."""
    from transformers import AutoModelForImageTextToText

    from rlhforge.models.loading import load_causal_lm, lora_config

    lora = ds_cfg.lora
    model = load_causal_lm(path, model_cfg, replace(ds_cfg, lora=replace(lora, rank=0)), device,
                           auto_class=AutoModelForImageTextToText)
    if freeze_visual_encoder:
        freeze_vision_tower(model)
    if lora.rank > 0:
        from peft import get_peft_model

        if model_cfg.gradient_checkpointing_enable:
            model.enable_input_require_grads()
        peft_cfg = lora_config(lora)
        peft_cfg.target_modules = language_model_lora_targets(model, lora.target_modules)
        model = get_peft_model(model, peft_cfg)
    return model


def _rope_owner(model):
    """The module with ``get_rope_index`` (Qwen-VL's inner ``model``), through DeepSpeed / DDP / PEFT wrappers."""
    base = getattr(model, "module", model)
    base = base.get_base_model() if hasattr(base, "get_base_model") else base
    for owner in (getattr(base, "model", None), base):
        if owner is not None and hasattr(owner, "get_rope_index"):
            return owner
    raise ValueError(f"{type(base).__name__} has no get_rope_index: its M-RoPE positions cannot be computed")


def mrope_positions(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, inputs: Mapping[str, Any]
                    ) -> torch.Tensor:
    """``[3, B, T]`` M-RoPE positions of a (left- or right-) padded batch with images (``inputs``: its
    ``image_grid_thw`` and ``mm_token_type_ids``), computed by the model's own ``get_rope_index``: what
    the model computes itself when a forward gets no ``position_ids``. Padding gets position 0."""
    positions, _ = _rope_owner(model).get_rope_index(
        input_ids, mm_token_type_ids=inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"],
        attention_mask=attention_mask)
    return positions


def vlm_model_inputs(model, batch: Mapping[str, Any]) -> dict[str, Any]:
    """``model(**kwargs)`` arguments of a padded batch with ``pixel_values`` / ``image_grid_thw`` /
    ``mm_token_type_ids`` (:func:`rlhforge.data.images.collate_vlm`)."""
    if batch.get("attention_mask") is None:
        raise ValueError("vision-language batches must be padded (with an attention_mask): packing is not "
                         "supported for VLMs (their M-RoPE positions are computed by the model)")
    kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False,
              "pixel_values": batch["pixel_values"], "image_grid_thw": batch["image_grid_thw"],
              "mm_token_type_ids": batch["mm_token_type_ids"]}
    base = getattr(model, "module", model)  # DeepSpeed / DDP wrappers
    base = base.get_base_model() if hasattr(base, "get_base_model") else base
    inner = getattr(base, "model", None)
    if inner is not None and hasattr(inner, "rope_deltas"):
        inner.rope_deltas = None  # a stale value from generation must not shift a training forward
    return kwargs
