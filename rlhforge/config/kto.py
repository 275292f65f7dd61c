"""Configuration of ``rlhforge kto`` / ``python -m rlhforge.cli.train_kto`` (KTO on unpaired data).

The loss and its flags are TRL's ``KTOTrainer``'s (``loss_type`` ``kto`` | ``apo_zero_unpaired``, ``beta``,
``desirable_weight``, ``undesirable_weight``; TRL's names are accepted as aliases); the rest (reference model,
precomputed reference log-probs, strategies, batches, checkpoints) is ``rlhforge dpo``'s. OpenRLHF's
``train_kto`` (removed in March 2026) named its weights ``--desirable_loss_weight`` /
``--undesirable_loss_weight``: accepted too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from rlhforge.config.components import (AdamConfig, CkptConfig, DataConfig, DSConfig, EvalConfig, LoggerConfig,
                                        ModelConfig, OptimConfig, TrainConfig)
from rlhforge.config.dpo import RefConfig, check_reference, uses_adapter_reference
from rlhforge.config.parsing import ConfigError
from rlhforge.config.validation import validate_common


@dataclass(frozen=True)
class KTOModelConfig(ModelConfig):
    """The policy trained with KTO and the loss."""

    beta: float = 0.1
    """Inverse temperature of the implicit reward ``beta * (log pi - log pi_ref)`` (TRL's default)."""
    loss_type: Literal["kto", "apo_zero_unpaired"] = "kto"
    """``kto`` (a KL reference point from mismatched completions) or ``apo_zero_unpaired`` (none); TRL's names."""
    desirable_weight: float = 1.0
    """Weight of the desirable examples' losses (TRL ``desirable_weight``; KTO's lambda_D)."""
    undesirable_weight: float = 1.0
    """Weight of the undesirable examples' losses (TRL ``undesirable_weight``; KTO's lambda_U). KTO's paper
    keeps ``desirable_weight x desirable examples`` / ``undesirable_weight x undesirable examples`` in [1, 4/3]."""


@dataclass(frozen=True)
class UnpairedDataConfig(DataConfig):
    """Unpaired examples: ``{"prompt", "completion", "label"}`` (rlhforge.data.unpaired)."""

    prompt_key: str = "prompt"
    """Field with the prompt (a string, or messages with ``--data.apply_chat_template``)."""
    completion_key: str = "completion"
    """Field with the completion (a string, or messages with ``--data.apply_chat_template``)."""
    label_key: str = "label"
    """Field with the label: true (desirable) or false (undesirable)."""
    max_len: int = 512
    """Truncate each sequence (prompt + completion) to this many tokens."""


@dataclass(frozen=True)
class KTOCkptConfig(CkptConfig):
    CHECKPOINTS: ClassVar[str] = "checkpoints_kto"


@dataclass(frozen=True)
class KTOConfig:
    """KTO (Kahneman-Tversky optimisation; ``--model.loss_type apo_zero_unpaired`` for APO-zero) on unpaired
    desirable/undesirable examples against a frozen reference model."""

    model: KTOModelConfig = field(default_factory=KTOModelConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    data: UnpairedDataConfig = field(default_factory=UnpairedDataConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(micro_batch_size=8, max_epochs=1))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(adam=AdamConfig(lr=1e-5)))
    ds: DSConfig = field(default_factory=DSConfig)
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(split="test"))
    ckpt: KTOCkptConfig = field(default_factory=KTOCkptConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    local_rank: int = -1
    """Set by the ``deepspeed`` launcher; the rank is read from the environment."""

    @property
    def uses_adapter_reference(self) -> bool:
        return uses_adapter_reference(self)

    def validate(self) -> None:
        validate_common(self)
        m, d = self.model, self.data
        if m.pretrain_mode_enable:
            raise ConfigError("--model.pretrain_mode_enable is an SFT option; it does not apply to KTO")
        if not m.beta > 0:
            raise ConfigError(f"--model.beta must be > 0 (got {m.beta})")
        for name in ("desirable_weight", "undesirable_weight"):
            if not getattr(m, name) > 0:
                raise ConfigError(f"--model.{name} must be > 0 (got {getattr(m, name)})")
        if d.input_template is not None and d.apply_chat_template:
            raise ConfigError("--data.input_template and --data.apply_chat_template are exclusive; pick one")
        if d.max_len < 2:
            raise ConfigError(f"--data.max_len must be >= 2 (got {d.max_len})")
        if self.ds.ring_attn_size > 1:
            raise ConfigError("--ds.ring_attn_size: ring attention is not wired for KTO (its reference point is a "
                              "batch statistic of every example); use it with sft, rm or dpo")
        check_reference(self)
