"""Load HF models and tokenizers: dtype, attention implementation, gradient checkpointing, LoRA/QLoRA."""

from __future__ import annotations

from pathlib import Path

import torch


def training_dtype_name(param_dtype: str, device: torch.device) -> str:
    """``--ds.param_dtype`` as the strategies resolve it: ``auto`` is bf16 on CUDA, fp32 elsewhere."""
    if param_dtype == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return param_dtype


def default_attn_implementation(requested: str, device: torch.device, param_dtype: str = "auto") -> str:
    """``--ds.attn_implementation``: ``auto`` -> flash_attention_2 on CUDA where flash-attn imports and the
    model trains in bf16/fp16, else sdpa. Models load in fp32 and the strategies cast (or autocast) to the
    training dtype; in an fp32 run q/k/v reach the kernel in fp32, which flash-attn refuses ("only supports
    fp16 and bf16") at the first forward (gpu-review-2 F3)."""
    if requested != "auto":
        return requested
    if device.type != "cuda" or training_dtype_name(param_dtype, device) not in ("bf16", "fp16"):
        return "sdpa"
    try:
        import flash_attn  # noqa: F401

        return "flash_attention_2"
    except ImportError:
        return "sdpa"


def check_model_path(path: str, flag: str | None = None) -> None:
    """A path that looks local must exist: say so (naming ``flag`` when given) instead of asking the hub.

    Looks local (:func:`rlhforge.config.paths.looks_local`): starts with ``.``, ``/``, ``~``, has more
    than one ``/``, or its first component names an existing folder (``runs/rm`` when ``runs/`` exists)."""
    from rlhforge.config.paths import missing_local_path, missing_path_message

    if missing_local_path(str(path)):
        raise FileNotFoundError(missing_path_message(str(path), flag))


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


def default_lora_targets(model) -> str | list[str]:
    """What ``--ds.lora.target_modules all-linear`` (the default) means on ``model``.

    Dense models: peft's ``all-linear`` (every ``nn.Linear`` but the output head; Phi-3's fused
    ``qkv_proj``/``gate_up_proj`` included). MoE models: their attention projections only, as an
    explicit list of ``nn.Linear`` module names. peft (>= 0.18) maps ``all-linear`` on transformers 5's
    MoE models onto the router and the fused 3-D expert tensors too (``ParamWrapper``): LoRA on a
    router moves the routing itself, and the weight-sync merge
    (:func:`rlhforge.models.export.merged_lora_state`) covers ``nn.Linear`` adapters only. Name the
    experts in ``--ds.lora.target_modules`` to go further (the sync merge then refuses with the reason).
    """
    from rlhforge.models.moe import is_moe, router_modules

    if not is_moe(model):
        return "all-linear"
    moe_blocks = tuple(name.rsplit(".", 1)[0] + "." for name, _ in router_modules(model))
    head = model.get_output_embeddings()
    return sorted(name for name, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and m is not head and not name.startswith(moe_blocks))


def lora_config(lora_cfg, task_type: str = "CAUSAL_LM", model=None):
    """peft's LoraConfig for ``--ds.lora.*``; with ``model``, the default ``all-linear`` is resolved by
    :func:`default_lora_targets` (MoE models: attention projections)."""
    from peft import LoraConfig, TaskType

    targets = list(lora_cfg.target_modules)
    if targets == ["all-linear"]:
        targets = default_lora_targets(model) if model is not None else "all-linear"
    return LoraConfig(
        r=lora_cfg.rank,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=targets,
        task_type=getattr(TaskType, task_type),
        bias="none",
    )


def load_causal_lm(path: str, model_cfg, ds_cfg, device: torch.device, *, auto_class=None, **kwargs):
    """Load ``path`` in fp32 master precision (strategies cast/autocast) with the chosen attention."""
    from transformers import AutoModelForCausalLM

    if auto_class is None and getattr(ds_cfg, "use_liger_kernel", False):  # GPU only (config/validation.py)
        from liger_kernel.transformers import AutoLigerKernelForCausalLM as auto_class  # noqa: N813
    auto_class = auto_class or AutoModelForCausalLM
    load_kwargs = dict(
        dtype=torch.float32,
        attn_implementation=default_attn_implementation(ds_cfg.attn_implementation, device,
                                                        getattr(ds_cfg, "param_dtype", "auto")),
        trust_remote_code=model_cfg.trust_remote_code,
        **kwargs,
    )
    experts = getattr(ds_cfg, "experts_implementation", None)
    if experts is not None:  # --ds.experts_implementation (MoE kernels; dense models ignore it)
        load_kwargs["experts_implementation"] = experts
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
        model = get_peft_model(model, lora_config(ds_cfg.lora, task, model))
    if device.type == "cpu":  # fp32 linear layers on oneDNN where it is faster than BLAS (models/cpu_linear.py)
        from rlhforge.models.cpu_linear import use_cpu_linear

        use_cpu_linear(model)
    return model
