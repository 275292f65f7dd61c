"""Start-up validation shared by every command: clear messages, never silent auto-correction.

Every accepted flag either works, or is refused here (:class:`ConfigError`: exit 2, one line naming
the flag, before any model is loaded), or, for an OpenRLHF tuning knob that means nothing in this
run, prints exactly one ``[rlhforge] note: --flag ... has no effect: why`` line (:func:`notice`).
"""

from __future__ import annotations

import os
import sys

from rlhforge.config.parsing import ConfigError

#: ``--ds.experts_implementation`` names that need CUDA (DeepGEMM: CUDA + bf16; sonic-moe: CUDA kernels)
_GPU_EXPERTS = ("deepgemm", "deepgemm_megamoe", "sonicmoe")


def validate_experts_implementation(name: str | None) -> None:
    """``--ds.experts_implementation``: one of the names transformers' ``from_pretrained`` takes
    (``eager`` plus its experts-interface kernels); the CUDA-only ones are refused on a machine without."""
    if name is None:
        return
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        valid = ["eager", *ALL_EXPERTS_FUNCTIONS.keys()]
    except ImportError:
        raise ConfigError(f"--ds.experts_implementation {name}: this transformers has no experts "
                          "implementations (needs transformers >= 5)") from None
    if name not in valid:
        raise ConfigError(f"--ds.experts_implementation {name!r} is not one of transformers' experts "
                          f"implementations: {', '.join(valid)}")
    if name in _GPU_EXPERTS:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"--ds.experts_implementation {name} needs a CUDA GPU (no CUDA device here); "
                              "use eager, batched_mm or grouped_mm")


def validate_aux_loss_coef(coef: float, flag: str) -> None:
    if not coef >= 0:
        raise ConfigError(f"{flag} must be >= 0 (got {coef}; 0 turns the MoE load-balancing loss off)")



def validate_ring_attention(ds, world: int, packing_flag: str = "--ds.packing_samples") -> None:
    """``--ds.ring_attn_size`` / ``--ds.ring_attn_head_stride`` where ring attention is wired (SFT, RM, DPO, RL actor)."""
    size, stride = ds.ring_attn_size, ds.ring_attn_head_stride
    if size < 1:
        raise ConfigError(f"--ds.ring_attn_size must be >= 1 (got {size})")
    if stride < 1:
        raise ConfigError(f"--ds.ring_attn_head_stride must be >= 1 key/value heads per ring pass (got {stride})")
    if size == 1:
        if stride != 1:
            notice(f"--ds.ring_attn_head_stride {stride} has no effect: ring attention is off (--ds.ring_attn_size 1)")
        return
    if not ds.packing_samples:
        raise ConfigError(f"--ds.ring_attn_size {size} needs {packing_flag}: ring attention slices one packed row "
                          "(OpenRLHF turns packing on by itself; rlhforge asks for it)")
    if world % size:
        raise ConfigError(f"--ds.ring_attn_size {size} must divide the {world} training ranks "
                          f"(ranks = data-parallel size x ring size)")


def validate_tensor_parallel(ds, world: int) -> None:
    """``--ds.tensor_parallel_size`` (DeepSpeed AutoTP, backend/autotp.py) in sft, rm and dpo."""
    tp = ds.tensor_parallel_size
    if tp < 1:
        raise ConfigError(f"--ds.tensor_parallel_size must be >= 1 (got {tp})")
    if tp == 1:
        return
    if resolved_strategy(ds.strategy, world) != "deepspeed":
        raise ConfigError(f"--ds.tensor_parallel_size {tp} is DeepSpeed AutoTP: it needs the DeepSpeed strategy "
                          f"(--ds.strategy deepspeed, or launch several ranks; got {ds.strategy} on {world} rank(s))")
    if world % tp:
        raise ConfigError(f"--ds.tensor_parallel_size {tp} must divide the {world} training ranks "
                          "(ranks = data-parallel size x tensor-parallel size)")
    if ds.zero_stage == 3:
        raise ConfigError(f"--ds.tensor_parallel_size {tp} with --ds.zero_stage 3: DeepSpeed's AutoTP training runs "
                          "with ZeRO stages 0-2")
    if ds.ring_attn_size > 1:
        raise ConfigError(f"--ds.tensor_parallel_size {tp} with --ds.ring_attn_size {ds.ring_attn_size}: "
                          "use one of the two")


def validate_fp16(ds, strategy: str) -> None:
    """fp16 needs loss scaling, which only the DeepSpeed strategy applies (dynamic, DeepSpeed's own): the
    torch and FSDP2 strategies would train fp16 with unscaled gradients that underflow to zero."""
    if ds.param_dtype == "fp16" and strategy != "deepspeed":
        raise ConfigError(f"--ds.param_dtype fp16 with the {strategy} strategy: it has no loss scaling, so small "
                          "fp16 gradients underflow; use --ds.param_dtype bf16, or --ds.strategy deepspeed (dynamic "
                          "loss scaling)")


def validate_common(cfg) -> None:
    """Start-up checks shared by sft, rm and dpo."""
    if cfg.model.model_name_or_path is None:
        raise ConfigError("--model.model_name_or_path is required (an HF hub id or a local folder)")
    if cfg.data.dataset is None:
        raise ConfigError("--data.dataset is required (files, folders, hub ids or builtin:NAME; comma-separated)")
    if cfg.model.aux_loss_coef and cfg.ds.ring_attn_size > 1:
        raise ConfigError(f"--model.aux_loss_coef cannot be combined with --ds.ring_attn_size {cfg.ds.ring_attn_size} "
                          "(each ring rank routes a slice of the sequence)")
    validate_ring_attention(cfg.ds, world_size())  # sft, rm, dpo (docs/long_context.md)
    validate_tensor_parallel(cfg.ds, world_size())  # AutoTP: sft, rm, dpo (backend/autotp.py)
    validate_fp16(cfg.ds, resolved_strategy(cfg.ds.strategy, world_size()))
    if getattr(cfg, "use_ms", False):
        raise ConfigError("--use_ms (ModelScope) is not supported; download the model and pass a local folder")
    validate_aux_loss_coef(cfg.model.aux_loss_coef, "--model.aux_loss_coef")  # sft, rm and dpo add it
    validate_experts_implementation(cfg.ds.experts_implementation)
    if cfg.ds.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"--ds.zero_stage must be 0, 1, 2 or 3 (got {cfg.ds.zero_stage})")
    if cfg.train.max_tokens_per_device and not cfg.ds.packing_samples:
        raise ConfigError(
            f"--train.max_tokens_per_device {cfg.train.max_tokens_per_device} needs --ds.packing_samples "
            "(token-budget micro-batches are packed rows)"
        )
    ring = max(cfg.ds.ring_attn_size, 1)  # a ring holds ring x budget
    if cfg.train.max_tokens_per_device and cfg.train.max_tokens_per_device * ring < cfg.data.max_len:
        raise ConfigError(
            f"--train.max_tokens_per_device {cfg.train.max_tokens_per_device}"
            f"{f' x ring {ring}' if ring > 1 else ''} is below --data.max_len "
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
    check_gpu_kernels(cfg.ds, cfg.train.device)
    check_flash_attention_dtype(cfg.ds, cfg.train.device)
    validate_no_effect_common(cfg)


def validate_no_effect_common(cfg) -> None:
    """Notices (never errors) for the SFT/RM/DPO flags that do nothing in this run."""
    for line in deepspeed_only_notices(cfg.ds, resolved_strategy(cfg.ds.strategy, world_size())):
        notice(line)
    if cfg.data.dataloader_num_workers != 0:
        notice(f"--data.dataloader_num_workers {cfg.data.dataloader_num_workers} has no effect: the data is "
               "tokenised once, before training (no DataLoader worker processes)")
    deepspeed = resolved_strategy(cfg.ds.strategy, world_size()) == "deepspeed"
    for line in muon_notices(cfg.optim, "--optim.muon.", "--optim.max_norm", "--optim muon", deepspeed):
        notice(line)


def muon_notices(optim, muon_prefix: str, max_norm_flag: str, muon_flag: str, deepspeed: bool) -> list[str]:
    """Muon's start-up notices for one optimizer block (``optim``: an ``OptimConfig``): with Muon and a
    positive max_norm, one line recommending 0 (OpenRLHF warns the same: under DeepSpeed ZeRO the clip
    acts on the orthogonalised update and shrinks it); under DeepSpeed, whose Muon fixes 5 Newton-Schulz
    steps with Nesterov momentum, ``ns_steps`` / ``nesterov`` do nothing; without Muon no ``muon.*`` does."""
    from rlhforge.config.components import MuonConfig

    out, default = [], MuonConfig()
    if optim.name == "muon":
        if optim.max_norm > 0:
            out.append(f"{muon_flag} with {max_norm_flag} {optim.max_norm}: gradient clipping shrinks Muon's "
                       f"orthogonalised updates (DeepSpeed ZeRO clips after Newton-Schulz); {max_norm_flag} 0 is "
                       "recommended, as OpenRLHF warns")
        for name in ("ns_steps", "nesterov") if deepspeed else ():
            value = getattr(optim.muon, name)
            if value != getattr(default, name):
                out.append(f"{muon_prefix}{name} {value} has no effect under DeepSpeed: its Muon runs 5 Newton-Schulz "
                           "steps with Nesterov momentum (the torch and fsdp2 strategies honour it)")
        return out
    for name in ("lr", "momentum", "ns_steps", "nesterov"):
        value = getattr(optim.muon, name)
        if value != getattr(default, name):
            out.append(f"{muon_prefix}{name} {value} has no effect: the optimizer is {optim.name} "
                       f"({muon_flag} turns Muon on)")
    return out


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
                                     "grad_accum_dtype": None, "use_universal_ckpt": False, "deepcompile": False}


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


def check_gpu_kernels(ds, device: str) -> None:
    """``--ds.use_liger_kernel`` (Liger's Triton kernels) and ``--ds.deepcompile`` (DeepSpeed's compiled
    ZeRO passes, whose ``dc`` op DeepSpeed builds for CUDA/ROCm only) need a GPU: refused on CPU with
    that reason; Liger also where its package is missing (docs/parallelism.md)."""
    import importlib.util

    wanted = [f for f in ("use_liger_kernel", "deepcompile") if getattr(ds, f, False)]
    if not wanted:
        return
    why = {"use_liger_kernel": "Liger's fused kernels are Triton GPU kernels",
           "deepcompile": "DeepCompile's op (deepspeed.ops.dc) is built for CUDA/ROCm only; DeepSpeed's CPU "
                          "accelerator has none"}
    if device == "cpu" or device in ("auto", "cuda") and not _cuda_available():
        where = "the device is cpu" if device == "cpu" else "no CUDA device is visible"
        flag = wanted[0]
        raise ConfigError(f"--ds.{flag} needs a CUDA GPU ({why[flag]}), but {where}; drop the flag on this machine")
    if "use_liger_kernel" in wanted and importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError("--ds.use_liger_kernel needs the liger-kernel package: pip install liger-kernel")


def check_flash_attention_dtype(ds, device: str) -> None:
    """An explicit ``--ds.attn_implementation flash_attention_2`` with an fp32 run is refused: flash-attn
    takes fp16/bf16 only, and models train in fp32 under ``--ds.param_dtype fp32`` (or ``auto`` off CUDA),
    so the first forward would die ("FlashAttention only supports fp16 and bf16"). ``auto`` picks sdpa there
    itself (models/loading.py)."""
    if getattr(ds, "attn_implementation", "auto") != "flash_attention_2":
        return
    on_cuda = device == "cuda" or device == "auto" and _cuda_available()
    dtype = ds.param_dtype if ds.param_dtype != "auto" else ("bf16" if on_cuda else "fp32")
    if dtype == "fp32":
        why = "--ds.param_dtype fp32" if ds.param_dtype == "fp32" else "--ds.param_dtype auto, which is fp32 off CUDA"
        raise ConfigError(f"--ds.attn_implementation flash_attention_2 needs bf16 or fp16 training, but this run trains "
                          f"in fp32 ({why}); flash-attn refuses fp32 tensors at the first forward. Use "
                          "--ds.param_dtype bf16, or --ds.attn_implementation sdpa (or auto)")


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


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
