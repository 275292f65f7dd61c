"""The vision-language side of ``rlhforge sft``, ``rlhforge dpo`` and ``rlhforge rl`` (docs/vlm.md): checks,
processor, samples, models (RL: :func:`vlm_rl_setup`).

``train_sft.run`` / ``train_dpo.run`` ask :func:`vlm_setup` whether the model is a VLM (from its
config); when it is, the tokenizer is a :class:`rlhforge.models.vlm.VisionProcessor` (tokenizer +
image processor, saved with the export), samples come from
:func:`rlhforge.data.vlm_sft.build_vlm_sft_samples` / :func:`rlhforge.data.vlm_preference.build_vlm_preference_samples`
and the models from :func:`rlhforge.models.vlm.load_vlm`.
"""

from __future__ import annotations

import sys

from rlhforge.config.parsing import ConfigError


def vlm_setup(cfg):
    """The model's :class:`VisionProcessor` when it is a VLM (after the checks below), else None."""
    from rlhforge.models.vlm import check_supported_vlm, is_vlm, load_processor

    path = cfg.model.model_name_or_path
    if not is_vlm(path, cfg.model.trust_remote_code):
        if cfg.model.freeze_visual_encoder:
            raise ConfigError(f"--model.freeze_visual_encoder: {path} is not a vision-language model "
                              "(its config has no vision_config)")
        return None
    try:
        check_supported_vlm(path, cfg.model.trust_remote_code)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if cfg.model.pretrain_mode_enable:
        raise ConfigError("--model.pretrain_mode_enable is not supported for vision-language models "
                          "(images are placed by the chat template)")
    if not cfg.data.apply_chat_template:
        raise ConfigError("SFT of a vision-language model renders each record with the chat template, which "
                          "places the images: add --data.apply_chat_template")
    if cfg.ds.ring_attn_size > 1:
        raise ConfigError(f"--ds.ring_attn_size {cfg.ds.ring_attn_size} is not supported for vision-language "
                          "models (the ring slices packed rows; VLM batches are padded)")
    if cfg.ds.packing_samples:
        print("[rlhforge] note: --ds.packing_samples true has no effect with a vision-language model: its M-RoPE "
              "positions are computed by the model, so batches are padded", file=sys.stderr)
    return load_processor(path, chat_template=cfg.data.tokenizer_chat_template,
                          use_fast=not cfg.data.disable_fast_tokenizer)


def vlm_rl_setup(cfg):
    """``rlhforge rl``: ``(cfg, processor)``: the actor's :class:`VisionProcessor` when it is a VLM (after the
    checks below; packing turned off, with a notice), else ``(cfg, None)``."""
    import dataclasses

    from rlhforge.models.vlm import check_supported_vlm, is_vlm, load_processor

    path = cfg.actor.model_name_or_path
    if not is_vlm(path, cfg.actor.trust_remote_code):
        if cfg.actor.freeze_visual_encoder:
            raise ConfigError(f"--actor.freeze_visual_encoder: {path} is not a vision-language model "
                              "(its config has no vision_config)")
        if cfg.data.max_images_per_prompt:
            print(f"[rlhforge] note: --data.max_images_per_prompt {cfg.data.max_images_per_prompt} has no effect: "
                  f"{path} is a text model (its prompts' images are not read)", file=sys.stderr)
        return cfg, None
    try:
        check_supported_vlm(path, cfg.actor.trust_remote_code)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    refusals = [
        (not cfg.data.apply_chat_template, "--data.apply_chat_template is required: the chat template places the images"),
        (cfg.uses_critic, f"--algo.advantage.estimator {cfg.algo.advantage.estimator} needs a critic, which is not "
                          "built for vision-language models (use group_norm, rloo, reinforce_baseline, dr_grpo ...)"),
        (cfg.ds.ring_attn_size > 1, f"--ds.ring_attn_size {cfg.ds.ring_attn_size}: the ring slices packed rows; "
                                    "VLM batches are padded"),
        (cfg.ds.tensor_parallel_size > 1, f"--ds.tensor_parallel_size {cfg.ds.tensor_parallel_size}: AutoTP is not "
                                          "built for vision towers"),
        (cfg.train.dynamic_batch_enable, "--train.dynamic_batch_enable needs packing, and VLM batches are padded"),
        (cfg.train.routing_replay, "--train.routing_replay: the supported VLMs are dense"),
    ]
    if cfg.vllm.num_engines:  # vLLM's Qwen2-VL needs torchvision (rollout/vllm_vision.py); CPU builds have none
        from rlhforge.rollout.vllm_vision import vlm_unsupported_reason

        reason = vlm_unsupported_reason()
        refusals.append((reason is not None, f"--vllm.num_engines {cfg.vllm.num_engines}: {reason}"))
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"{path} is a vision-language model: {why} (docs/vlm.md)")
    if cfg.ds.packing_samples:
        print("[rlhforge] note: --ds.packing_samples true has no effect with a vision-language model: its M-RoPE "
              "positions are computed by the model, so batches are padded", file=sys.stderr)
        cfg = dataclasses.replace(cfg, ds=dataclasses.replace(cfg.ds, packing_samples=False))
    processor = load_processor(path, chat_template=cfg.data.tokenizer_chat_template,
                               use_fast=not cfg.data.disable_fast_tokenizer)
    return cfg, processor


def load_vlm_sft_data(cfg, processor):
    """Training and eval :class:`VLMSFTSample` lists (eval from ``eval.dataset`` or a held-out fraction)."""
    from rlhforge.data.loading import load_train_and_eval
    from rlhforge.data.vlm_sft import build_vlm_sft_samples

    d = cfg.data
    kwargs = dict(input_key=d.input_key, output_key=d.output_key, multiturn=d.multiturn, image_key=d.image_key,
                  max_images=d.max_images_per_prompt, max_len=d.max_len)
    train, evals = load_train_and_eval(d, cfg.eval, seed=cfg.train.seed)
    train_samples = build_vlm_sft_samples(train, processor, **kwargs)
    eval_samples = build_vlm_sft_samples(evals, processor, **kwargs) if evals is not None else []
    return train_samples, eval_samples


def load_vlm_model(cfg, device):
    from rlhforge.models.vlm import load_vlm

    return load_vlm(cfg.model.model_name_or_path, cfg.model, cfg.ds, device,
                    freeze_visual_encoder=cfg.model.freeze_visual_encoder)


def load_vlm_preference_data(cfg, processor):
    """Training and eval :class:`VLMPreferenceSample` lists (DPO)."""
    from rlhforge.data.loading import load_train_and_eval
    from rlhforge.data.vlm_preference import build_vlm_preference_samples

    d = cfg.data
    kwargs = dict(prompt_key=d.prompt_key, chosen_key=d.chosen_key, rejected_key=d.rejected_key,
                  image_key=d.image_key, max_images=d.max_images_per_prompt, max_len=d.max_len)
    train, evals = load_train_and_eval(d, cfg.eval, seed=cfg.train.seed)
    train_samples = build_vlm_preference_samples(train, processor, **kwargs)
    eval_samples = build_vlm_preference_samples(evals, processor, **kwargs) if evals is not None else []
    return train_samples, eval_samples


def load_vlm_reference(path: str, model_cfg, ds_cfg, device):
    """The frozen DPO reference VLM (no LoRA, no 4-bit; the whole model, tower included, is frozen anyway)."""
    from rlhforge.models.vlm import load_vlm

    return load_vlm(path, model_cfg, ds_cfg, device)
