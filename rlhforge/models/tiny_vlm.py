"""Tiny vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) with their processor files, built without a hub.

``build_tiny_vlm(out_dir, arch="qwen2_vl")`` writes a folder that
``AutoModelForImageTextToText.from_pretrained`` loads offline, plus the processor files that
``AutoProcessor.from_pretrained`` reads (``preprocessor_config.json``,
``video_preprocessor_config.json``, ``processor_config.json``, tokenizer, chat template):

- text part: hidden 64, 2 layers, 2 attention heads of head_dim 32 (vLLM's CPU attention minimum),
  1 key/value head, M-RoPE sections ``[4, 6, 6]`` (they sum to head_dim / 2);
- vision tower: 1 block, embed dim 32, patch 14, spatial merge 2, temporal patch 2; the merger
  projects to the text hidden size, so a 28x28 image is 2x2 patches -> 1 image token and a 56x56
  one is 4x4 -> 4 tokens;
- image processor: Qwen2-VL's, with ``min_pixels = 28 * 28`` and ``max_pixels = 112 * 112``;
- Qwen3-VL (``qwen3_vl``): the same text sizes (explicit ``head_dim`` 32, q/k norms, interleaved
  M-RoPE sections ``[6, 5, 5]``), a 2-block vision tower (width 32, patch **16**, a learned 8x8
  position grid, DeepStack features from block 0 added after text layer 0); its image processor is
  Qwen2-VL's class with patch 16, mean/std 0.5 and ``min_pixels = 32 * 32``, ``max_pixels = 128 * 128``
  (sides rounded to multiples of 32: a 56x56 image is 64x64 -> 4x4 patches -> 4 tokens). Its image
  inputs have the same form as Qwen2-VL's (``pixel_values`` [patches, 3 * 2 * 16 * 16],
  ``image_grid_thw``, ``mm_token_type_ids``) and its chat template renders the same vision tokens;
- tokenizer: :func:`rlhforge.models.tiny.build_tokenizer` plus Qwen2-VL's special tokens
  (:data:`VISION_TOKENS`) and :data:`CHATML_VL_TEMPLATE`, a ChatML template with
  ``{% generation %}`` markers that renders ``{"type": "image"}`` content parts as
  ``<|vision_start|><|image_pad|><|vision_end|>`` (one pad per image; the data pipeline expands it
  to the image's token count, as the processor does).

transformers 5.19's Qwen2-VL video processor needs torchvision. Without it ``AutoProcessor`` cannot
load any Qwen2-VL folder (hub ones included); :func:`rlhforge.models.vlm.load_processor` then
loads the image processor and the tokenizer on their own (images only).
"""

from __future__ import annotations

import json
from pathlib import Path

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]

#: Image sizes the tiny processor keeps (pixels; multiples of patch * merge = 28 per side).
MIN_PIXELS, MAX_PIXELS = 28 * 28, 112 * 112

_CONTENT = (
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
)

CHATML_VL_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}" + _CONTENT + "{{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
    "{%- else %}" + _CONTENT + "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: --arch NAME -> (config class, processor class) in transformers
VLM_ARCHS: dict[str, tuple[str, str]] = {
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLProcessor"),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLProcessor"),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLProcessor"),
}

#: --arch NAME -> (image processor kwargs, video processor class) of the tiny processor
_PROCESSORS: dict[str, tuple[dict, str]] = {
    "qwen2_vl": (dict(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS), "Qwen2VLVideoProcessor"),
    "qwen2_5_vl": (dict(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS), "Qwen2VLVideoProcessor"),
    "qwen3_vl": (dict(min_pixels=32 * 32, max_pixels=128 * 128, patch_size=16, image_mean=[0.5, 0.5, 0.5],
                      image_std=[0.5, 0.5, 0.5]), "Qwen3VLVideoProcessor"),
}


def is_vlm_arch(arch: str) -> bool:
    return arch in VLM_ARCHS


def build_vl_tokenizer(seed: int = 0):
    """The tiny BPE tokenizer with Qwen2-VL's vision tokens and :data:`CHATML_VL_TEMPLATE`."""
    from rlhforge.models.tiny import build_tokenizer

    tokenizer = build_tokenizer(seed=seed, padding_side="right")
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = CHATML_VL_TEMPLATE
    return tokenizer


def _vision_config(arch: str, hidden: int) -> dict:
    common = dict(depth=1, num_heads=2, in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    if arch == "qwen2_vl":
        return dict(common, embed_dim=32, hidden_size=hidden, mlp_ratio=2)
    if arch == "qwen3_vl":  # patch 16, a learned 8x8 position grid, DeepStack from block 0 into text layer 0
        return dict(common, depth=2, patch_size=16, hidden_size=32, intermediate_size=64, out_hidden_size=hidden,
                    num_position_embeddings=64, deepstack_visual_indexes=[0])
    # Qwen2.5-VL: hidden_size is the tower's width, out_hidden_size the merger's output (the text width)
    return dict(common, hidden_size=32, intermediate_size=64, out_hidden_size=hidden, window_size=56,
                fullatt_block_indexes=[0])


def _write_processor_files(out: Path, arch: str, tokenizer) -> None:
    """Image processor, video processor config (written as JSON: the class needs torchvision), processor config."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    image_kwargs, video_class = _PROCESSORS[arch]
    image_processor = Qwen2VLImageProcessorPil(**image_kwargs)
    image_processor.save_pretrained(out)
    video = dict(json.loads((out / "preprocessor_config.json").read_text()))
    video.pop("image_processor_type", None)
    video.update(video_processor_type=video_class, min_frames=1, max_frames=4, fps=2.0, do_sample_frames=False)
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    (out / "processor_config.json").write_text(json.dumps({"processor_class": VLM_ARCHS[arch][1]}, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(tokenizer.chat_template)


def build_tiny_vlm(out_dir: str | Path, arch: str = "qwen2_vl", seed: int = 0) -> Path:
    """Write a tiny random VLM of family ``arch`` (:data:`VLM_ARCHS`) and its processor files; return the path."""
    import torch
    import transformers
    from transformers import AutoModelForImageTextToText, GenerationConfig

    if arch not in VLM_ARCHS:
        raise ValueError(f"unknown VLM --arch {arch!r}; valid: {', '.join(VLM_ARCHS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_vl_tokenizer(seed)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    hidden = 64
    text = dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 10000.0},
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    if arch == "qwen3_vl":  # head_dim is explicit; M-RoPE's T/H/W frequencies are interleaved (16 = 6 + 5 + 5)
        text.update(head_dim=hidden // 2, rope_parameters={"rope_type": "default", "mrope_section": [6, 5, 5],
                                                           "mrope_interleaved": True, "rope_theta": 10000.0})
    config = getattr(transformers, VLM_ARCHS[arch][0])(
        text_config=text, vision_config=_vision_config(arch, hidden), image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD], vision_start_token_id=ids[VISION_START], vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=True, torch_dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText._model_mapping[type(config)](config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _write_processor_files(out, arch, tokenizer)
    return out
