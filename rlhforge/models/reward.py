"""Reward models: any causal-LM checkpoint as HF ``AutoModelForSequenceClassification`` with one label.

The reward of a sequence is the value head's output at its **last token** (sequences built by
:mod:`rlhforge.data.preference` and the reward server end with EOS). HF's own forward of
the exported model reads the same position (it takes the last token that is not ``pad_token_id``),
so ``AutoModelForSequenceClassification.from_pretrained(out).logits`` equals what training saw,
provided the pad token is not a real token of the scored text (pad != EOS).

:func:`sequence_rewards` runs the model once on a padded or packed batch (the layouts of
:mod:`rlhforge.data.packing`) and returns one reward per sequence. It calls the model normally (so
DeepSpeed ZeRO-3 gathers parameters as usual) and reads the head's per-token output through a
forward hook, then picks each sequence's last token itself: HF's pooling cannot see sequence
boundaries inside a packed row.

Normalisation statistics: the trainer stores the reward mean and standard deviation over its eval
pairs (chosen and rejected) as ``reward_mean``/``reward_std`` in config.json (:func:`save_reward_model`);
:func:`reward_stats` reads them back (also OpenRLHF's ``mean``/``std``).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import Tensor

from rlhforge.tracking.quiet import expected_new_weights
from rlhforge.models.export import write_folder

__all__ = [
    "load_reward_model",
    "init_value_head",
    "value_head",
    "sequence_rewards",
    "last_token_index",
    "reward_stats",
    "save_reward_model",
    "encode_reward_text",
]


def load_reward_model(path: str, model_cfg, ds_cfg, device: torch.device, *, pad_token_id: int | None = None,
                      value_head_prefix: str = "score"):
    """Load ``path`` as a one-label sequence classifier (a new head, initialised as OpenRLHF does by
    :func:`init_value_head`, if ``path`` is a causal LM without one), with LoRA when ``ds_cfg.lora.rank > 0`` (the head is then trained in full, as peft's
    ``modules_to_save``). ``pad_token_id`` is written into the config when it has none (HF's
    pooling needs it for batches)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from rlhforge.models.loading import load_causal_lm

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code)
    except OSError as err:
        raise FileNotFoundError(f"could not load a model config from {path!r}: {err}") from err
    kwargs: dict[str, Any] = {"num_labels": 1}
    if getattr(config, "pad_token_id", None) is None and pad_token_id is not None:
        kwargs["pad_token_id"] = pad_token_id
    new_head = not _checkpoint_has_head(path, value_head_prefix)
    quiet = expected_new_weights({f"{value_head_prefix}.weight", f"{value_head_prefix}.bias"}) if new_head \
        else contextlib.nullcontext()
    try:
        with quiet:
            model = load_causal_lm(path, model_cfg, ds_cfg, device, auto_class=AutoModelForSequenceClassification,
                                   **kwargs)
    except ValueError as err:
        if "Unrecognized configuration class" in str(err):
            raise ValueError(
                f"{path}: transformers has no sequence-classification class for model type "
                f"{getattr(config, 'model_type', '?')!r}, so it cannot become a reward model here"
            ) from err
        raise
    head = value_head(model, value_head_prefix)  # fail early with the available names
    if new_head:
        init_value_head(head, getattr(config, "hidden_size", None))
        if _is_first_rank():
            print(f"{path}: no '{value_head_prefix}' value head in the checkpoint (a causal LM): a new one is "
                  f"initialised, N(0, 1/(hidden_size+1)) as OpenRLHF does")
    return model


def init_value_head(head: torch.nn.Module, hidden_size: int | None = None) -> None:
    """A *new* value head, as OpenRLHF's ``init_value_head``: weight ~ N(0, std = 1 / (d + 1)) with
    d the hidden size (OpenRLHF's convention: the standard deviation, not the variance, is 1/(d+1));
    a bias, if any, 0. Under LoRA the head is peft's ``ModulesToSaveWrapper``: the original and the
    trained copy get the same values. Draws from torch's global RNG (seed first)."""
    linears = [m for m in head.modules() if isinstance(m, torch.nn.Linear)]
    if not linears:
        raise ValueError(f"value head {type(head).__name__} has no linear layer to initialise")
    d = hidden_size or linears[0].in_features
    with torch.no_grad():
        weight = torch.empty(linears[0].weight.shape, dtype=torch.float32).normal_(mean=0.0, std=1.0 / (d + 1))
        for m in linears:
            m.weight.copy_(weight.to(m.weight.device, m.weight.dtype))
            if m.bias is not None:
                m.bias.zero_()


def _checkpoint_tensor_names(path: str) -> set[str] | None:
    """Tensor names stored in the checkpoint at ``path`` (a local folder or a cached hub id), read
    from the safetensors headers / index files only; None when they cannot be read."""
    def locate(name: str) -> Path | None:
        local = Path(path) / name
        if local.is_file():
            return local
        if Path(path).is_dir():
            return None
        try:
            from transformers.utils import cached_file

            found = cached_file(path, name, _raise_exceptions_for_missing_entries=False,
                                _raise_exceptions_for_connection_errors=False)
        except Exception:  # noqa: BLE001 - any failure: cannot tell
            return None
        return Path(found) if found else None

    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        found = locate(index)
        if found is not None:
            return set(json.loads(found.read_text()).get("weight_map", {}))
    found = locate("model.safetensors")
    if found is not None:
        from safetensors import safe_open

        with safe_open(str(found), framework="pt") as f:
            return set(f.keys())
    found = locate("pytorch_model.bin")
    if found is not None:
        try:
            return set(torch.load(found, map_location="cpu", weights_only=True, mmap=True))
        except Exception:  # noqa: BLE001 - an old or unreadable format: cannot tell
            return None
    return None


def _is_first_rank() -> bool:
    return not (torch.distributed.is_available() and torch.distributed.is_initialized()) or \
        torch.distributed.get_rank() == 0


def _checkpoint_has_head(path: str, prefix: str) -> bool:
    """Whether ``path`` stores the value head ``prefix`` (a trained reward model / critic) rather
    than being a causal LM whose head transformers has just created. Unknown: assume stored (never
    overwrite weights that may be trained)."""
    names = _checkpoint_tensor_names(path)
    if names is None:
        return True
    return any(n == f"{prefix}.weight" or n.endswith(f".{prefix}.weight") for n in names)


def _unwrap(model):
    """HF model under DeepSpeed / DDP / peft wrappers."""
    while type(model).__name__ in ("DeepSpeedEngine", "DistributedDataParallel") and isinstance(
        getattr(model, "module", None), torch.nn.Module
    ):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def value_head(model, prefix: str = "score") -> torch.nn.Module:
    """The value-head module named ``prefix`` (peft's ``ModulesToSaveWrapper`` under LoRA)."""
    base = _unwrap(model)
    head = getattr(base, prefix, None)
    if not isinstance(head, torch.nn.Module):
        names = ", ".join(name for name, _ in base.named_children())
        raise ValueError(
            f"{type(base).__name__} has no value head named {prefix!r} (--ds.value_head_prefix); "
            f"its top-level modules are: {names}"
        )
    return head


def last_token_index(batch: Mapping[str, Any]) -> Tensor:
    """Index of each sequence's last token: ``[S]`` row positions (padded, right or left padding)
    or ``[S]`` positions in the packed row."""
    if batch.get("attention_mask") is None:
        if batch.get("cu_seqlens") is not None:
            return batch["cu_seqlens"][1:].long() - 1
        lens = torch.as_tensor(batch["seq_lens"], device=batch["input_ids"].device)
        return torch.cumsum(lens, 0) - 1
    mask = batch["attention_mask"]
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return (positions * mask.long()).argmax(-1)


def _forward_kwargs(model, batch: Mapping[str, Any]):
    """``model(**kwargs)`` arguments and the packed row layout (None: outputs are already per token of
    ``batch``). Packed batches run in bounded rows (:func:`rlhforge.models.forward.packed_model_inputs`)."""
    from rlhforge.models.forward import is_packed, packed_model_inputs

    if is_packed(batch):
        return packed_model_inputs(_unwrap(model), batch)
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
            "position_ids": batch.get("position_ids"), "use_cache": False}, None


def sequence_rewards(model, batch: Mapping[str, Any], prefix: str = "score", return_aux_loss: bool = False):
    """One reward per sequence of ``batch`` (padded or packed): the value head at the last token. [S].

    ``return_aux_loss`` (MoE models): ``(rewards, load-balancing loss)``, the loss over the real tokens
    (:func:`rlhforge.models.moe.load_balancing_loss`, router logits recorded by hooks)."""
    import contextlib

    from rlhforge.models import moe

    captured: dict[str, Tensor] = {}

    def hook(_module, _inputs, output):
        captured["values"] = output

    kwargs, rows = _forward_kwargs(model, batch)
    handle = value_head(model, prefix).register_forward_hook(hook)
    record = moe.recorded_router_logits(model) if return_aux_loss else contextlib.nullcontext()
    try:
        with record as router_logits:
            model(**kwargs)
    finally:
        handle.remove()
    values = captured["values"] if rows is None else rows.to_packed(captured["values"])
    if values.dim() == 3:
        if values.shape[-1] != 1:
            raise ValueError(f"the value head has {values.shape[-1]} outputs; a reward model has one label")
        values = values[..., 0]
    index = last_token_index(batch).to(values.device)
    if batch.get("attention_mask") is None:
        rewards = values[0, index]
    else:
        rewards = values[torch.arange(values.shape[0], device=values.device), index]
    if not return_aux_loss:
        return rewards
    mask = moe.token_mask_for_router(batch.get("attention_mask"), rows)
    return rewards, moe.load_balancing_loss(router_logits, *moe.moe_routing(_unwrap(model)), mask)


def encode_reward_text(tokenizer, text: str, max_len: int) -> list[int]:
    """Token ids of a whole text to score: encoded with the tokenizer's special tokens (a
    duplicated leading BOS, as from a chat template that writes it, is dropped), EOS appended unless
    it already ends with it, truncated to ``max_len`` keeping the start (last token set to EOS). The
    same shape as the sequences a reward model is trained on."""
    eos = tokenizer.eos_token_id
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    bos = tokenizer.bos_token_id
    if bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    if eos is not None and (not ids or ids[-1] != eos):
        ids.append(eos)
    if len(ids) > max_len:
        ids = ids[:max_len]
        if eos is not None:
            ids[-1] = eos
    return ids


def reward_stats(config) -> tuple[float, float] | None:
    """(mean, std) stored in a model config (``reward_mean``/``reward_std``, or OpenRLHF's ``mean``/``std``)."""
    for mean_key, std_key in (("reward_mean", "reward_std"), ("mean", "std")):
        mean, std = getattr(config, mean_key, None), getattr(config, std_key, None)
        if isinstance(mean, (int, float)) and isinstance(std, (int, float)):
            return float(mean), float(std)
    return None


def save_reward_model(strategy, tokenizer, out_dir: str | Path, *, stats: tuple[float, float] | None,
                      base_path: str, model_cfg, ds_cfg) -> None:
    """Export a reward model that ``AutoModelForSequenceClassification.from_pretrained`` loads (all
    ranks call this; rank 0 writes). ``stats`` = (mean, std) go into config.json.

    A LoRA model is merged into its base and saved whole (so the reward server and the RL trainer
    load it directly); the adapter itself is kept in ``adapter/``.
    """
    module = strategy.module
    is_peft = hasattr(module, "get_base_model")
    if not is_peft:
        config = module.config
        if stats is not None:
            config.reward_mean, config.reward_std = float(stats[0]), float(stats[1])
        from rlhforge.models.export import save_hf

        save_hf(strategy, tokenizer, out_dir)
        return
    state_dict = strategy.full_state_dict()
    if not strategy.is_rank0:
        return
    from peft import get_peft_model
    from transformers import AutoModelForSequenceClassification

    from rlhforge.models.loading import lora_config

    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the fresh head's "newly initialised" report would only confuse here
    try:
        base = AutoModelForSequenceClassification.from_pretrained(
            base_path, num_labels=1, dtype=torch.float32, pad_token_id=module.get_base_model().config.pad_token_id,
            trust_remote_code=model_cfg.trust_remote_code,
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    peft_model = get_peft_model(base, lora_config(ds_cfg.lora, "SEQ_CLS"))
    # a gathered ZeRO-3 state dict also lists non-persistent buffers (rotary inv_freq ...); skip those
    buffers = {name for name, _ in peft_model.named_buffers()}
    state_dict = {k: v for k, v in state_dict.items() if not (k in buffers and k not in peft_model.state_dict())}
    result = peft_model.load_state_dict(state_dict, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise RuntimeError(f"LoRA reward-model export: weights do not match a fresh {type(base).__name__} + adapter "
                           f"(missing {result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]})")

    def write(tmp: Path) -> None:
        peft_model.save_pretrained(tmp / "adapter", safe_serialization=True)
        merged = peft_model.merge_and_unload()
        if stats is not None:
            merged.config.reward_mean, merged.config.reward_std = float(stats[0]), float(stats[1])
        merged.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / "adapter" / "README.rlhforge.json").write_text(json.dumps(
            {"note": "LoRA adapter of this reward model; the folder above holds it merged into the base model."}
        ))

    write_folder(out_dir, write)
