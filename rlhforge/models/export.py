"""HF export: a folder ``from_pretrained`` loads (safetensors, config, tokenizer, chat template)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def save_hf(strategy, tokenizer, out_dir: str | Path, extra_files: dict[str, str] | None = None) -> None:
    """Gather the full weights (all ranks call this) and write them on rank 0, atomically.

    LoRA models are written as a PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``);
    ``rlhforge merge-lora`` merges one into its base model.
    """
    state_dict = strategy.full_state_dict()
    if not strategy.is_rank0:
        return
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model = strategy.module
    model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    for name, text in (extra_files or {}).items():
        (tmp / name).write_text(text)
    # Move file by file so a run directory that also holds metrics/config keeps them.
    out.mkdir(parents=True, exist_ok=True)
    for item in tmp.iterdir():
        target = out / item.name
        if target.is_dir():
            shutil.rmtree(target)
        item.replace(target)
    tmp.rmdir()


@torch.no_grad()
def merge_lora(base_dir: str, adapter_dir: str, out_dir: str, dtype: str = "fp32") -> Path:
    """Merge a PEFT LoRA adapter into its base model and save a plain HF folder."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch_dtype)
    merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out_dir, safe_serialization=True)
    src = adapter_dir if any(Path(adapter_dir).glob("tokenizer*")) else base_dir
    AutoTokenizer.from_pretrained(src).save_pretrained(out_dir)
    return Path(out_dir)


def merged_lora_state(state: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """A PEFT LoRA model's full state dict (PEFT names) -> the base model's names with every adapter
    merged, ``W = W_base + scaling * B @ A``, computed out of place (the trained model is untouched).
    This is what generation engines load after each update (weight sync of a LoRA actor). ``model``
    is the PEFT model the state came from (for each LoRA layer's scaling)."""
    from peft.tuners.lora import LoraLayer

    scalings: dict[str, dict[str, float]] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            if getattr(module, "fan_in_fan_out", False):
                raise ValueError(f"{name}: merging fan_in_fan_out LoRA layers for weight sync is not supported")
            if type(module).__name__ == "ParamWrapper":  # peft's LoRA on a bare parameter (MoE experts/router)
                raise ValueError(f"{name}: LoRA on the parameter {getattr(module, 'parameter_name', '?')!r} (peft "
                                 "ParamWrapper: MoE experts or router) cannot be merged for weight sync; target "
                                 "nn.Linear modules (the default all-linear does on MoE models)")
            scalings[name] = dict(module.scaling)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if ".lora_" in key:
            continue
        module_name, _, leaf = key.rpartition(".")
        if module_name.endswith(".base_layer"):
            owner = module_name[: -len(".base_layer")]
            if leaf == "weight" and owner in scalings:
                merged = tensor.float()
                for adapter, scale in scalings[owner].items():
                    a, b = state[f"{owner}.lora_A.{adapter}.weight"], state[f"{owner}.lora_B.{adapter}.weight"]
                    merged = merged + scale * (b.float() @ a.float())
                tensor = merged.to(tensor.dtype)
            key = f"{owner}.{leaf}"
        out[key.removeprefix("base_model.model.")] = tensor
    return out
