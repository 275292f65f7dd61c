"""One frozen dataclass per component.

Field names follow OpenRLHF's dotted flags (``--model.model_name_or_path``,
``--train.micro_batch_size``, ``--ds.zero_stage`` ...) so launch scripts carry over. Each field's
docstring is its ``--help`` text. Where our default differs from OpenRLHF's, the docstring says
so (and docs/config.md lists every difference).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from rlhforge.config.parsing import secret


@dataclass(frozen=True)
class ModelConfig:
    """The model being trained."""

    model_name_or_path: str | None = None
    """HF hub id or local folder of the model to train (``from_pretrained``)."""
    pretrain_mode_enable: bool = False
    """SFT only: loss on every token (continued pre-training) instead of only the response."""
    gradient_checkpointing_enable: bool = False
    """Recompute activations in the backward pass to save memory."""
    gradient_checkpointing_reentrant: bool = False
    """Use the re-entrant implementation of activation checkpointing."""
    aux_loss_coef: float = 0.0
    """MoE models (SFT, RM, DPO): weight of the router's load-balancing loss added to the loss, logged
    as ``train/aux_loss`` (as OpenRLHF; 0: off; a dense model prints one notice)."""
    trust_remote_code: bool = False
    """Allow model code shipped with the checkpoint (``from_pretrained(trust_remote_code=...)``)."""


@dataclass(frozen=True)
class LoraConfig:
    """LoRA/QLoRA adapters via peft. ``rank=0`` trains the full model."""

    rank: int = 0
    """LoRA rank; 0 disables LoRA."""
    alpha: int = 16
    """LoRA alpha (scaling = alpha / rank)."""
    target_modules: tuple[str, ...] = ("all-linear",)
    """Modules that get adapters; ``all-linear`` targets every linear layer but the output head."""
    dropout: float = 0.0
    """Dropout on the LoRA branch."""


@dataclass(frozen=True)
class DSConfig:
    """Training backend (``--ds.*`` as in OpenRLHF): strategy, precision, sharding, packing."""

    strategy: Literal["auto", "torch", "deepspeed", "fsdp2"] = "auto"
    """Backend. ``auto``: plain torch for one process, DeepSpeed when launched with several
    (torchrun/deepspeed/Ray workers); ``fsdp2``: PyTorch FSDP2 (``fully_shard``, the ZeRO-3 layout).
    rlhforge-specific."""
    zero_stage: int = 2
    """DeepSpeed ZeRO stage 0-3 (ignored by the plain-torch strategy)."""
    param_dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Training precision. ``auto`` (our default; OpenRLHF's is bf16): bf16 on GPU, fp32 on CPU."""
    zpg: int = 1
    """ZeRO++ hierarchical partition size (DeepSpeed ``zero_hpz_partition_size``)."""
    adam_offload: bool = False
    """Offload Adam states to CPU (DeepSpeed ``offload_optimizer``)."""
    attn_implementation: str = "auto"
    """HF attention implementation. ``auto`` (our default; OpenRLHF's is flash_attention_2):
    flash_attention_2 when CUDA and flash-attn are present, else sdpa."""
    packing_samples: bool = False
    """Padding-free training: concatenate samples into one row with per-sample position ids."""
    grad_accum_dtype: str | None = None
    """DeepSpeed data type for gradient accumulation (e.g. fp32)."""
    overlap_comm: bool = False
    """Overlap gradient reduction with the backward pass (DeepSpeed)."""
    load_in_4bit: bool = False
    """QLoRA: load the base model in 4 bits (bitsandbytes, CUDA only)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    use_universal_ckpt: bool = False
    """Resume a DeepSpeed ZeRO checkpoint on a different number of ranks: it is converted once to
    DeepSpeed's universal format beside the native shards and loaded with ``load_universal``
    (docs/parallelism.md). OpenRLHF only loads checkpoints converted by hand."""
    deepcompile: bool = False
    """DeepSpeed DeepCompile (``compile: {deepcompile: true}`` and ``engine.compile()``), GPU only: refused on
    CPU (DeepSpeed builds its ``dc`` op for CUDA/ROCm only)."""
    use_liger_kernel: bool = False
    """Liger's Triton kernels for the trained causal LM (``AutoLigerKernelForCausalLM``), GPU only (refused
    on CPU; on GPU it needs ``pip install liger-kernel``)."""
    ring_attn_size: int = 1
    """Not supported yet: ring attention (must stay 1)."""
    ring_attn_head_stride: int = 1
    """Not supported yet: ring attention head stride."""
    tensor_parallel_size: int = 1
    """Not supported yet: DeepSpeed AutoTP (must stay 1)."""
    experts_implementation: str | None = None
    """MoE models: transformers' experts kernel (``from_pretrained(experts_implementation=...)``):
    eager, batched_mm, grouped_mm (CPU and GPU) or deepgemm, sonicmoe (CUDA). None: transformers'
    default (grouped_mm where it can run, else eager)."""


@dataclass(frozen=True)
class AdamConfig:
    """AdamW hyper-parameters."""

    lr: float = 5e-6
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""


@dataclass(frozen=True)
class MuonConfig:
    """Muon hyper-parameters (accepted for OpenRLHF compatibility; Muon is not supported yet)."""

    lr: float = 0.02
    """Muon learning rate."""
    momentum: float = 0.95
    """Muon momentum."""
    ns_steps: int = 5
    """Newton-Schulz iterations."""
    nesterov: bool = True
    """Nesterov momentum."""


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer and schedule. OpenRLHF's flat flags (``--optim``, ``--adam.lr``,
    ``--lr_scheduler``, ``--lr_warmup_ratio``, ``--min_lr_ratio``, ``--max_norm``) map here."""

    name: Literal["adam", "muon"] = "adam"
    """Optimizer (``--optim``): AdamW. ``muon`` is not supported yet (fails at start-up)."""
    adam: AdamConfig = field(default_factory=AdamConfig)
    muon: MuonConfig = field(default_factory=MuonConfig)
    lr_scheduler: Literal["cosine_with_min_lr", "cosine", "constant", "constant_with_warmup", "linear"] = (
        "cosine_with_min_lr"
    )
    """Learning-rate schedule (after warm-up)."""
    lr_warmup_ratio: float = 0.03
    """Fraction of optimizer steps spent warming up linearly from 0."""
    min_lr_ratio: float = 0.1
    """Floor of ``cosine_with_min_lr`` as a fraction of the peak lr."""
    max_norm: float = 1.0
    """Clip the global gradient norm to this value (0 disables clipping)."""


@dataclass(frozen=True)
class TrainConfig:
    """Batch sizes, epochs, seed. ``batch_size`` is global (samples per optimizer step across all
    ranks); ``micro_batch_size`` and ``max_tokens_per_device`` are per device."""

    micro_batch_size: int = 8
    """Samples per forward/backward on one device."""
    batch_size: int = 128
    """Samples per optimizer step, summed over ranks and gradient-accumulation micro-batches."""
    max_epochs: int = 2
    """Passes over the training data."""
    max_steps: int = -1
    """Stop after this many optimizer steps (-1: run all epochs). rlhforge-specific."""
    max_tokens_per_device: int = 0
    """Token-budget micro-batching (needs ``--ds.packing_samples``): fill each micro-batch up to
    this many tokens instead of a fixed sample count. 0 disables. rlhforge-specific."""
    seed: int = 42
    """Seed for data order, initialisation and sampling."""
    full_determinism_enable: bool = False
    """Use deterministic algorithms (slower)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device: ``auto`` uses CUDA when present, else CPU. rlhforge-specific."""
    preempt_grace_s: float = 120.0
    """SIGTERM/SIGINT: wait at most this many seconds for the current step to end, then save a
    checkpoint and exit (143 / 130); if the step does not end in time, exit without saving (the last
    good checkpoint stays). 0: wait however long the step takes. rlhforge-specific; docs/reliability.md."""
    max_skipped_steps_in_row: int = 3
    """Optimizer steps with a non-finite loss or gradient norm are skipped (counted in
    ``train/skipped_steps``); this many in a row stop the run (exit 5) naming the last good
    checkpoint. 0: never stop. rlhforge-specific; docs/reliability.md."""


@dataclass(frozen=True)
class DataConfig:
    """Training data shared by every trainer."""

    dataset: str | None = None
    """Comma-separated files/folders/hub ids (JSONL, JSON, CSV, Parquet, Arrow, ``datasets``
    folders). A name may carry a split as ``path@split``. ``builtin:NAME`` uses a generator
    shipped with rlhforge."""
    dataset_probs: str | None = None
    """Comma-separated mixing probabilities, one per dataset (default: concatenate)."""
    dataset_split: str = "train"
    """Split to read from hub datasets and ``datasets`` folders."""
    max_samples: int = 1_000_000
    """Keep at most this many training samples (after mixing)."""
    input_template: str | None = None
    """Template with one ``{}`` wrapped around the prompt when no chat template is applied."""
    apply_chat_template: bool = False
    """Render prompts/conversations with the tokenizer's chat template."""
    tokenizer_chat_template: str | None = None
    """Override the tokenizer's chat template (a Jinja string or a path to a .jinja file)."""
    max_len: int = 2048
    """Truncate samples to this many tokens."""
    disable_fast_tokenizer: bool = False
    """Load the slow (Python) tokenizer."""
    dataloader_num_workers: int = 0
    """Accepted for OpenRLHF compatibility; no effect: data is tokenised once, before training."""


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation data and cadence."""

    dataset: str | None = None
    """Eval files/folders (same syntax as ``--data.dataset``)."""
    split: str = "train"
    """Split to read from the eval dataset."""
    steps: int = -1
    """Evaluate every N optimizer steps (-1: at the end of each epoch only)."""
    holdout_ratio: float = 0.0
    """With no eval dataset: hold out this fraction of the training data for eval. rlhforge-specific."""
    max_samples: int = 100_000
    """Keep at most this many eval samples."""


@dataclass(frozen=True)
class CkptConfig:
    """Outputs and checkpoints."""

    output_dir: str = "./ckpt"
    """Run directory: final HF model, resolved config.yaml, metrics.jsonl."""
    save_steps: int = -1
    """Save a resumable checkpoint every N optimizer steps (-1: only at the end)."""
    save_hf: bool = False
    """Also keep an HF export inside each checkpoint (always done for the final model)."""
    disable_ds: bool = False
    """Do not write resumable training state; with ``save_hf`` each save writes only
    ``<ckpt.path>/step_N_hf/``."""
    path: str | None = None
    """Folder of resumable checkpoints (``step_N`` sub-folders). Default: ``<output_dir>/checkpoints_<command>``
    (OpenRLHF's ``./ckpt/checkpoints_<command>`` with the default output folder), so a run's checkpoints
    follow its output folder."""
    max_num: int = 3
    """Keep at most this many resumable checkpoints (oldest removed first)."""
    max_mem: int = 100_000_000
    """Disk budget (GB) for resumable checkpoints: the oldest are removed while the total exceeds it."""
    load_enable: bool = False
    """Resume from the latest checkpoint in ``ckpt.path`` if one exists (a missing or empty folder
    starts from scratch with a notice)."""
    overwrite: bool = False
    """Start a fresh run in an output folder that holds another run (its ``metrics.jsonl`` or checkpoints):
    they are deleted first. Without it (or ``load_enable``) such a folder is refused at start-up.
    rlhforge-specific; docs/reliability.md."""
    allow_config_change: bool = False
    """Resume even when settings that break exact resumption (data, global batch sizes, seed,
    epochs/steps, model paths) differ from the checkpoint's config (refused with exit 2 otherwise).
    rlhforge-specific; docs/reliability.md."""

    CHECKPOINTS: ClassVar[str] = "checkpoints"

    @property
    def checkpoint_dir(self) -> str:
        """``path``, or the output folder's ``checkpoints_<command>`` when unset."""
        return self.path if self.path else f"{self.output_dir.rstrip('/') or '/'}/{self.CHECKPOINTS}"


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases (optional; needs ``pip install wandb``)."""

    key: str | None = secret(redacted="env")
    """API key (or ``env`` to use WANDB_API_KEY). Enables W&B logging. Written to config.yaml as
    ``env`` (never the key itself)."""
    org: str | None = None
    """Entity."""
    group: str | None = None
    """Run group."""
    project: str = "rlhforge"
    """Project name."""
    run_name: str | None = None
    """Run name (default: the output folder name)."""


@dataclass(frozen=True)
class LoggerConfig:
    """Metrics and progress."""

    logging_steps: int = 1
    """Write metrics every N optimizer steps."""
    tensorboard_dir: str | None = None
    """Also write TensorBoard event files here."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    progress_bar: Literal["auto", "on", "off"] = "auto"
    """Progress bar on rank 0: ``auto`` shows it on a TTY and hides it in CI/pipes."""
