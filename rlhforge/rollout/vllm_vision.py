"""Images through the vLLM engine (``VLLMEngine.generate(..., vision=[VisionInput | None])``).

rlhforge's prompts already hold the *expanded* image tokens (``<|image_pad|>`` once per image
feature, :func:`rlhforge.data.images.expand_image_tokens`). vLLM 0.32 does not recognise an
expanded prompt: its Qwen2-VL processor replaces the first single ``<|image_pad|>`` it finds for
each image with that image's run (``BaseMultiModalProcessor._apply_prompt_updates``, no "already
applied" check), so an expanded prompt would be expanded a second time, wrongly. The engine
therefore hands vLLM each image's run collapsed back to one token (:func:`collapse_image_tokens`)
plus the PIL images; vLLM's processor (the model folder's ``preprocessor_config.json``: the same
``min_pixels`` / ``max_pixels``) re-expands them, and :func:`check_expanded_prompt` checks that it
gave back exactly our ids (else its pixels differ from the trainer's).

**What does not run where.** vLLM 0.32's Qwen2-VL support imports transformers' torchvision-based
image and video processors (``vllm.model_executor.models.qwen2_vl`` imports
``transformers.models.qwen2_vl.image_processing_qwen2_vl``, which imports ``torchvision``; vLLM's
processor loads ``Qwen2VLVideoProcessor``, also torchvision). vLLM's CPU build runs without
torchvision: PyPI's torchvision wheels are CUDA builds, which fail to load against the CPU torch
(``operator torchvision::nms does not exist``; docs/install.md removes them). So without an
importable torchvision the engine refuses a VLM at construction (:func:`vlm_unsupported_reason`);
the model then cannot even be inspected by vLLM ("Model architectures
['Qwen2VLForConditionalGeneration'] failed to be inspected"). The image path of the engine is
therefore **not run here** (CPU-only CI); it is written for vLLM on GPUs (tests/rl/test_vllm_vlm.py's
``gpu`` tests check it there). A CPU machine with a CPU build of torchvision is not refused, but untried.

vLLM is not imported by this module.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["vlm_unsupported_reason", "vlm_placeholders", "collapse_image_tokens", "vllm_vision_prompt",
           "check_expanded_prompt"]


def vlm_unsupported_reason() -> str | None:
    """Why this vLLM cannot serve a vision-language model here, or None when it can (torchvision works)."""
    try:
        import torchvision  # noqa: F401
    except Exception as err:  # noqa: BLE001 - a CUDA wheel on CPU torch raises RuntimeError, not ImportError
        return ("vLLM 0.32's Qwen2-VL model and multimodal processor import transformers' torchvision-based "
                f"Qwen2-VL image/video processors, and torchvision cannot be imported here ({type(err).__name__}: "
                f"{err}). vLLM's CPU build runs without torchvision (PyPI's torchvision wheels are CUDA builds that "
                "do not load against the CPU torch). Generate with the HF engine instead (--vllm.num_engines 0), "
                "or use vLLM on a GPU machine with its matching torchvision")
    return None


def collapse_image_tokens(ids: Sequence[int], vision, image_token_id: int, where: str = "prompt") -> list[int]:
    """``ids`` with each image's run of image tokens (``image_grid_thw[k].prod() // merge_size**2`` of
    them, in order) replaced by one image token: the unexpanded prompt vLLM's processor expects."""
    counts = [int(g.prod()) // vision.merge_size ** 2 for g in vision.image_grid_thw]
    out: list[int] = []
    i, k = 0, 0
    while i < len(ids):
        if int(ids[i]) != image_token_id:
            out.append(int(ids[i]))
            i += 1
            continue
        if k >= len(counts):
            raise ValueError(f"{where}: more image tokens than its {len(counts)} image(s) need")
        run = ids[i: i + counts[k]]
        if len(run) != counts[k] or any(int(t) != image_token_id for t in run):
            raise ValueError(f"{where}: image {k} needs {counts[k]} consecutive image tokens at position {i}")
        out.append(image_token_id)
        i += counts[k]
        k += 1
    if k != len(counts):
        raise ValueError(f"{where}: {len(counts)} image(s) but image tokens for {k}")
    return out


def vllm_vision_prompt(ids: Sequence[int], vision, image_token_id: int, where: str = "prompt") -> dict:
    """vLLM's prompt dict for one request: collapsed ids plus its PIL images (GPU path; not run here)."""
    if vision is None:
        return {"prompt_token_ids": [int(t) for t in ids]}
    if not vision.images:
        raise ValueError(f"{where}: vLLM needs the PIL images (VisionInput.images), only pixels were given")
    return {"prompt_token_ids": collapse_image_tokens(ids, vision, image_token_id, where),
            "multi_modal_data": {"image": list(vision.images)}}


def check_expanded_prompt(ours: Sequence[int], vllms: Sequence[int] | None, where: str = "prompt") -> None:
    """vLLM's expansion of a collapsed prompt must give back our ids: otherwise its image processor
    resized the images differently (other ``min_pixels`` / ``max_pixels``) and its pixels are not the
    trainer's."""
    if vllms is not None and [int(t) for t in vllms] != [int(t) for t in ours]:
        raise RuntimeError(f"{where}: vLLM expanded the images to a {len(vllms)}-token prompt, ours has {len(ours)} "
                           "tokens: its image processor settings (min_pixels / max_pixels) differ from the model "
                           "folder's preprocessor_config.json that the trainer used")


def vlm_placeholders(model_path: str) -> tuple[int, list[int]] | None:
    """A vision-language model folder's (image token id, placeholder ids never to sample: image and
    video); None for a text model. Reads the config only."""
    from transformers import AutoConfig

    from rlhforge.models.vlm import is_vlm

    if not is_vlm(model_path):
        return None
    config = AutoConfig.from_pretrained(model_path)
    image = int(config.image_token_id)
    video = getattr(config, "video_token_id", None)
    return image, [image] + ([int(video)] if video is not None else [])
