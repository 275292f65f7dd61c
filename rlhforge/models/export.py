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

    def write(tmp: Path) -> None:
        strategy.module.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)

    write_folder(out_dir, write)


def write_folder(out_dir: str | Path, write) -> None:
    """Write into ``<out>.tmp`` with ``write(tmp)``, then move it file by file into ``out``, so that a run
    folder that also holds metrics and the config keeps them (a crash leaves ``out`` as it was)."""
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    write(tmp)
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


def _lora_scalings(model) -> dict[str, dict[str, float]]:
    """``{module name: {adapter: scaling}}`` of a PEFT model's mergeable LoRA layers (refuses the others)."""
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
    return scalings


def merged_lora_state(state: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """A PEFT LoRA model's full state dict (PEFT names) -> the base model's names with every adapter
    merged, ``W = W_base + scaling * B @ A``, computed out of place (the trained model is untouched).
    This is what generation engines load after each update (weight sync of a LoRA actor). ``model``
    is the PEFT model the state came from (for each LoRA layer's scaling)."""
    return dict(merged_lora_stream(state.items(), model))


def merged_lora_stream(named, model):
    """:func:`merged_lora_state` over a stream of (PEFT name, tensor) pairs, as a stream: each LoRA layer's
    base weight is held (cloned: a streamed tensor may be freed once the next is asked for) until its
    adapters' A and B have passed, then yielded merged; every other entry passes straight through under
    its base-model name. Every rank that streams the same weights yields the same sequence (weight sync
    by CUDA IPC needs all actor ranks in step: issue 30, bug 6)."""
    scalings = _lora_scalings(model)
    pending: dict[str, dict] = {}  # owner -> {"base": tensor, "key": out name, "ab": {part: tensor}}

    def ready(owner: str) -> bool:
        p = pending[owner]
        return "base" in p and all(f"{part}.{a}" in p["ab"] for a in scalings[owner] for part in ("lora_A", "lora_B"))

    def merged(owner: str) -> tuple[str, torch.Tensor]:
        p = pending.pop(owner)
        out = p["base"].float()
        for adapter, scale in scalings[owner].items():
            out = out + scale * (p["ab"][f"lora_B.{adapter}"].float() @ p["ab"][f"lora_A.{adapter}"].float())
        return p["key"], out.to(p["base"].dtype)

    for key, tensor in named:
        module_name, _, leaf = key.rpartition(".")
        if ".lora_" in key:  # <owner>.lora_A.<adapter>.weight
            owner, _, rest = key.partition(".lora_")
            part, _, adapter_leaf = rest.partition(".")
            adapter = adapter_leaf.rpartition(".")[0]
            if owner in scalings and leaf == "weight" and part in ("A", "B"):
                pending.setdefault(owner, {"ab": {}})["ab"][f"lora_{part}.{adapter}"] = tensor.detach().clone()
                if ready(owner):
                    yield merged(owner)
            continue
        if module_name.endswith(".base_layer"):
            owner = module_name[: -len(".base_layer")]
            out_key = f"{owner}.{leaf}".removeprefix("base_model.model.")
            if leaf == "weight" and owner in scalings:
                entry = pending.setdefault(owner, {"ab": {}})
                entry["base"], entry["key"] = tensor.detach().clone(), out_key
                if ready(owner):
                    yield merged(owner)
                continue
            yield out_key, tensor
            continue
        yield key.removeprefix("base_model.model."), tensor
    if pending:
        raise RuntimeError(f"LoRA merge for weight sync: {sorted(pending)[:3]} never got their base weight or "
                           "adapters (a LoRA layer whose tensors are not all in the stream)")
