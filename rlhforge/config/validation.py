"""Start-up validation shared by every command: clear messages, never silent auto-correction.

Every accepted flag either works, or is refused here (:class:`ConfigError`: exit 2, one line naming
the flag, before any model is loaded), or, for an OpenRLHF tuning knob that means nothing in this
run, prints exactly one ``[rlhforge] note: --flag ... has no effect: why`` line (:func:`notice`).
"""

from __future__ import annotations

import os
import sys

from rlhforge.config.parsing import ConfigError

_UNSUPPORTED_DS = {
    "use_universal_ckpt": False,
    "deepcompile": False,
    "use_liger_kernel": False,
    "ring_attn_size": 1,
    "ring_attn_head_stride": 1,
    "tensor_parallel_size": 1,
    "experts_implementation": None,
}


def validate_common(cfg) -> None:
    if cfg.model.model_name_or_path is None:
        raise ConfigError("--model.model_name_or_path is required (an HF hub id or a local folder)")
    if cfg.data.dataset is None:
        raise ConfigError("--data.dataset is required (files, folders, hub ids or builtin:NAME; comma-separated)")
    for name, default in _UNSUPPORTED_DS.items():
        value = getattr(cfg.ds, name)
        if value != default:
            raise ConfigError(f"--ds.{name} {value} is not supported by rlhforge yet (leave it at {default})")
    if getattr(cfg, "use_ms", False):
        raise ConfigError("--use_ms (ModelScope) is not supported; download the model and pass a local folder")
    if cfg.optim.name == "muon":
        raise ConfigError("--optim.name muon (OpenRLHF: --optim muon) is not supported by rlhforge yet; use adam")
    if getattr(cfg.model, "aux_loss_coef", 0.0):
        raise ConfigError(f"--model.aux_loss_coef {cfg.model.aux_loss_coef}: the MoE load-balancing loss is not "
                          "supported by rlhforge yet (leave it at 0)")
    if cfg.ds.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"--ds.zero_stage must be 0, 1, 2 or 3 (got {cfg.ds.zero_stage})")
    if cfg.train.max_tokens_per_device and not cfg.ds.packing_samples:
        raise ConfigError(
            f"--train.max_tokens_per_device {cfg.train.max_tokens_per_device} needs --ds.packing_samples "
            "(token-budget micro-batches are packed rows)"
        )
    if cfg.train.max_tokens_per_device and cfg.train.max_tokens_per_device < cfg.data.max_len:
        raise ConfigError(
            f"--train.max_tokens_per_device {cfg.train.max_tokens_per_device} is below --data.max_len "
            f"{cfg.data.max_len}: a full-length sample would not fit"
        )
    if cfg.ds.lora.rank < 0:
        raise ConfigError(f"--ds.lora.rank must be >= 0 (got {cfg.ds.lora.rank})")
    if cfg.ds.load_in_4bit and cfg.ds.lora.rank == 0:
        raise ConfigError("--ds.load_in_4bit (QLoRA) needs LoRA adapters: set --ds.lora.rank > 0")
    validate_logging_steps(cfg)
    validate_fault_limits(cfg.train)
    if not 0.0 <= cfg.eval.holdout_ratio < 1.0:
        raise ConfigError(f"--eval.holdout_ratio must be in [0, 1) (got {cfg.eval.holdout_ratio})")
    if not 0.0 <= cfg.optim.lr_warmup_ratio <= 1.0:
        raise ConfigError(f"--lr_warmup_ratio must be in [0, 1] (got {cfg.optim.lr_warmup_ratio})")
    if cfg.data.input_template is not None and "{}" not in cfg.data.input_template:
        raise ConfigError(f"--data.input_template must contain '{{}}' for the prompt (got {cfg.data.input_template!r})")
    if cfg.data.dataset_probs is not None:
        probs = cfg.data.dataset_probs.split(",")
        names = cfg.data.dataset.split(",")
        if len(probs) != len(names):
            raise ConfigError(
                f"--data.dataset_probs has {len(probs)} values for {len(names)} datasets ({cfg.data.dataset})"
            )
    if cfg.ds.load_in_4bit:
        check_load_in_4bit(cfg.train.device)
    validate_no_effect_common(cfg)


def validate_no_effect_common(cfg) -> None:
    """Notices (never errors) for the SFT/RM/DPO flags that do nothing in this run."""
    for line in deepspeed_only_notices(cfg.ds, resolved_strategy(cfg.ds.strategy, world_size())):
        notice(line)
    if cfg.data.dataloader_num_workers != 0:
        notice(f"--data.dataloader_num_workers {cfg.data.dataloader_num_workers} has no effect: the data is "
               "tokenised once, before training (no DataLoader worker processes)")
    if cfg.optim.name != "muon":
        from rlhforge.config.components import MuonConfig

        default = MuonConfig()
        for name in ("lr", "momentum", "ns_steps", "nesterov"):
            value = getattr(cfg.optim.muon, name)
            if value != getattr(default, name):
                notice(f"--optim.muon.{name} {value} has no effect: the optimizer is {cfg.optim.name} "
                       "(Muon is not supported yet)")


def validate_fault_limits(train) -> None:
    """``--train.preempt_grace_s`` (0: no limit) and ``--train.max_skipped_steps_in_row`` (0: never
    stop) must not be negative; ``--train.agent_max_stuck_threads`` (RL) must be >= 1."""
    if train.preempt_grace_s < 0:
        raise ConfigError(f"--train.preempt_grace_s must be >= 0 seconds (got {train.preempt_grace_s}; 0: wait for "
                          "the step to end however long it takes)")
    if train.max_skipped_steps_in_row < 0:
        raise ConfigError(f"--train.max_skipped_steps_in_row must be >= 0 (got {train.max_skipped_steps_in_row}; "
                          "0: skip non-finite steps without ever stopping)")
    stuck = getattr(train, "agent_max_stuck_threads", 1)
    if stuck < 1:
        raise ConfigError(f"--train.agent_max_stuck_threads must be >= 1 (got {stuck})")


def validate_logging_steps(cfg) -> None:
    if cfg.logger.logging_steps < 1:
        raise ConfigError(f"--logger.logging_steps must be >= 1 (got {cfg.logger.logging_steps}): metrics are "
                          "written every N optimizer steps")


# --------------------------------------------------------------------------------------------- notices


def notice(message: str) -> None:
    """One start-up line (stderr, rank 0 only) saying that a flag has no effect here."""
    if int(os.environ.get("RANK", "0") or 0) == 0:
        print(f"[rlhforge] note: {message}", file=sys.stderr)


def world_size() -> int:
    """Processes of this launch (torchrun / deepspeed set WORLD_SIZE; 1 otherwise)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def resolved_strategy(strategy: str, world: int) -> str:
    """What ``--ds.strategy`` becomes (as :func:`rlhforge.backend.factory.build_strategy` decides)."""
    if strategy == "auto":
        return "deepspeed" if world > 1 else "torch"
    return strategy


#: DeepSpeed-only ``--ds.*`` knobs and their defaults (read by the DeepSpeed strategy alone)
DEEPSPEED_ONLY: dict[str, object] = {"zero_stage": 2, "zpg": 1, "adam_offload": False, "overlap_comm": False,
                                     "grad_accum_dtype": None}


def deepspeed_only_notices(ds, strategy: str) -> list[str]:
    """One line per DeepSpeed-only flag set to a non-default value while ``strategy`` (resolved) is
    not DeepSpeed."""
    if strategy == "deepspeed":
        return []
    if ds.strategy == "auto":
        why = "one process uses the plain torch strategy; use --ds.strategy deepspeed for DeepSpeed ZeRO"
    elif strategy == "fsdp2":
        why = "--ds.strategy fsdp2 always shards like ZeRO-3 (this is a DeepSpeed option)"
    else:
        why = f"--ds.strategy {strategy} is not DeepSpeed; use --ds.strategy deepspeed"
    out = []
    for name, default in DEEPSPEED_ONLY.items():
        value = getattr(ds, name)
        if value != default:
            shown = "" if isinstance(value, bool) else f" {value}"
            out.append(f"--ds.{name}{shown} has no effect: {why}")
    return out


def check_load_in_4bit(device: str, flag: str = "--ds.load_in_4bit") -> None:
    """QLoRA's 4-bit base needs a CUDA device and bitsandbytes: refuse at start-up, not at model load."""
    import importlib.util

    if device == "cpu":
        raise ConfigError(f"{flag} (4-bit QLoRA base, bitsandbytes) needs a CUDA device, but the device is cpu; "
                          "drop the flag (LoRA without 4 bits works on CPU)")
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(f"{flag} (4-bit QLoRA base, bitsandbytes) needs a CUDA device, and none is visible here; "
                          "drop the flag (LoRA without 4 bits works on CPU)")
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"{flag} needs bitsandbytes, which is not installed: `pip install bitsandbytes`, "
                          "or drop the flag")
