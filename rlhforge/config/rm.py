"""Configuration of ``rlhforge rm`` / ``python -m rlhforge.cli.train_rm`` (pairwise reward model).

Flag names are OpenRLHF's ``train_rm`` flags (``--model.loss_type``, ``--model.margin_loss_enable``,
``--data.prompt_key`` ...); defaults are OpenRLHF's where it has the flag (micro-batch 1, one epoch,
lr 9e-6, max_len 512).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from rlhforge.config.components import (AdamConfig, CkptConfig, DataConfig, DSConfig, EvalConfig, LoggerConfig,
                                        ModelConfig, OptimConfig, TrainConfig)
from rlhforge.config.parsing import ConfigError
from rlhforge.config.validation import validate_common

RM_LOSS_TYPES = ("sigmoid", "logexp")


@dataclass(frozen=True)
class PreferenceDataConfig(DataConfig):
    """Preference pairs: ``{"prompt", "chosen", "rejected"}`` as text or chat messages, or
    ``{"chosen", "rejected"}`` holding whole conversations (the shared leading messages are the prompt)."""

    prompt_key: str | None = None
    """Field with the prompt (a string, or a list of messages with ``apply_chat_template``). None:
    the prompt is inside ``chosen``/``rejected`` (whole texts, or conversations whose common leading
    messages are the prompt)."""
    chosen_key: str = "chosen"
    """Field with the preferred response (string or list of messages)."""
    rejected_key: str = "rejected"
    """Field with the dispreferred response (string or list of messages)."""
    margin_key: str = "margin"
    """Field with the per-pair margin read by ``--model.margin_loss_enable``. rlhforge-specific."""
    max_len: int = 512
    """Truncate each of chosen and rejected (prompt + response) to this many tokens."""


@dataclass(frozen=True)
class RMModelConfig(ModelConfig):
    """The model turned into a reward model (any causal-LM checkpoint; a one-label value head is added)."""

    loss_type: str = "sigmoid"
    """Pairwise loss: ``sigmoid`` (-log sigmoid(r_c - r_r - margin)) or ``logexp``
    (log(1 + exp(r_r - r_c + margin))). OpenRLHF treats any other value as logexp; rlhforge rejects it."""
    margin_loss_enable: bool = False
    """Subtract the record's margin (``--data.margin_key``) inside the loss."""
    compute_fp32_loss_enable: bool = False
    """Cast the rewards to fp32 before the loss (matters with bf16/fp16 training)."""


@dataclass(frozen=True)
class RMDSConfig(DSConfig):
    """Training backend, plus the value head's name."""

    value_head_prefix: str = "score"
    """Attribute name of the value head. rlhforge loads HF's ``AutoModelForSequenceClassification``
    (one label), whose head is ``score`` for Llama, Qwen, Mistral, Gemma, GPT-2 ...; another name
    must exist on the model class."""


@dataclass(frozen=True)
class RMCkptConfig(CkptConfig):
    CHECKPOINTS: ClassVar[str] = "checkpoints_rm"


@dataclass(frozen=True)
class RMConfig:
    """Train a pairwise (Bradley-Terry) reward model. The output folder loads with
    ``AutoModelForSequenceClassification.from_pretrained`` (one label; reward = head output at the
    last token) and stores the eval reward mean/std as ``reward_mean``/``reward_std`` in config.json."""

    model: RMModelConfig = field(default_factory=RMModelConfig)
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(micro_batch_size=1, max_epochs=1))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(adam=AdamConfig(lr=9e-6)))
    ds: RMDSConfig = field(default_factory=RMDSConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ckpt: RMCkptConfig = field(default_factory=RMCkptConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    local_rank: int = -1
    """Set by the ``deepspeed`` launcher; the rank is read from the environment."""
    use_ms: bool = False
    """Not supported: ModelScope downloads."""

    def validate(self) -> None:
        validate_common(self)
        validate_preference_common(self)
        if self.model.loss_type not in RM_LOSS_TYPES:
            raise ConfigError(
                f"--model.loss_type {self.model.loss_type!r} is not a reward-model loss; valid: {', '.join(RM_LOSS_TYPES)}"
            )


def validate_preference_common(cfg) -> None:
    """Checks shared by ``rm`` and ``dpo``."""
    if cfg.model.pretrain_mode_enable:
        raise ConfigError("--model.pretrain_mode_enable is an SFT option; it does not apply to preference training")
    if cfg.data.input_template is not None and cfg.data.prompt_key is None:
        raise ConfigError(
            "--data.input_template wraps the prompt, but no --data.prompt_key is given (the prompt is inside "
            "chosen/rejected); set --data.prompt_key or drop the template"
        )
    if cfg.data.input_template is not None and cfg.data.apply_chat_template:
        raise ConfigError("--data.input_template and --data.apply_chat_template are exclusive; pick one")
    if cfg.data.max_len < 2:
        raise ConfigError(f"--data.max_len must be >= 2 (got {cfg.data.max_len})")
