"""Load HF models and tokenizers: dtype, attention implementation, gradient checkpointing, LoRA/QLoRA."""

from __future__ import annotations

from pathlib import Path

import torch


def default_attn_implementation(requested: str, device: torch.device) -> str:
    """``--ds.attn_implementation``: ``auto`` -> flash_attention_2 on CUDA where flash-attn imports, else sdpa."""
    if requested != "auto":
        return requested
    if device.type == "cuda":
        try:
            import flash_attn  # noqa: F401

            return "flash_attention_2"
        except ImportError:
            return "sdpa"
    return "sdpa"


def check_model_path(path: str) -> None:
    """A path that is clearly local (absolute, ./, ../, ~) must exist: say so instead of a hub error."""
    p = Path(path).expanduser()
    if str(path).startswith(("/", "./", "../", "~")) and not p.exists():
        raise FileNotFoundError(f"model folder not found: {path}")


def load_tokenizer(path: str, *, chat_template: str | None = None, use_fast: bool = True, padding_side: str = "right"):
    from transformers import AutoTokenizer

    check_model_path(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, use_fast=use_fast, padding_side=padding_side)
    except OSError as err:
        raise FileNotFoundError(f"could not load a tokenizer from {path!r}: {err}") from err
    if chat_template:
        p = Path(chat_template)
        tokenizer.chat_template = p.read_text() if p.is_file() else chat_template
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def lora_config(lora_cfg, task_type: str = "CAUSAL_LM"):
    from peft import LoraConfig, TaskType

    targets = list(lora_cfg.target_modules)
    return LoraConfig(
        r=lora_cfg.rank,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules="all-linear" if targets == ["all-linear"] else targets,
        task_type=getattr(TaskType, task_type),
        bias="none",
    )


def load_causal_lm(path: str, model_cfg, ds_cfg, device: torch.device, *, auto_class=None, **kwargs):
    """Load ``path`` in fp32 master precision (strategies cast/autocast) with the chosen attention."""
    from transformers import AutoModelForCausalLM

    auto_class = auto_class or AutoModelForCausalLM
    load_kwargs = dict(
        dtype=torch.float32,
        attn_implementation=default_attn_implementation(ds_cfg.attn_implementation, device),
        trust_remote_code=model_cfg.trust_remote_code,
        **kwargs,
    )
    if ds_cfg.load_in_4bit:
        if device.type != "cuda":
            raise ValueError("--ds.load_in_4bit (QLoRA) needs a CUDA device (bitsandbytes); this run is on CPU")
        from transformers import BitsAndBytesConfig

        load_kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
        )
        load_kwargs["dtype"] = torch.bfloat16
    check_model_path(path)
    try:
        model = auto_class.from_pretrained(path, **load_kwargs)
    except OSError as err:
        raise FileNotFoundError(f"could not load a model from {path!r}: {err}") from err
    if model_cfg.gradient_checkpointing_enable:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": model_cfg.gradient_checkpointing_reentrant}
        )
        model.config.use_cache = False
    if ds_cfg.lora.rank > 0:
        from peft import get_peft_model, prepare_model_for_kbit_training

        if ds_cfg.load_in_4bit:
            model = prepare_model_for_kbit_training(model)
        if model_cfg.gradient_checkpointing_enable:
            model.enable_input_require_grads()
        task = "SEQ_CLS" if "SequenceClassification" in type(model).__name__ else "CAUSAL_LM"
        model = get_peft_model(model, lora_config(ds_cfg.lora, task))
    return model
