"""Start-up validation shared by every command: clear messages, never silent auto-correction."""

from __future__ import annotations

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
        raise ConfigError("--optim muon is not supported by rlhforge yet; use --optim adam")
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
