"""Configuration of ``rlhforge sft`` / ``python -m rlhforge.cli.train_sft``."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhforge.config.components import (
    CkptConfig,
    DataConfig,
    DSConfig,
    EvalConfig,
    LoggerConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
)
from rlhforge.config.validation import validate_common


@dataclass(frozen=True)
class SFTDataConfig(DataConfig):
    """SFT data: prompt/response keys, templates, multi-turn conversations."""

    input_key: str = "input"
    """Field with the prompt (or, with ``multiturn``, the list of chat messages)."""
    output_key: str | None = None
    """Field with the response. None with ``multiturn``/pretrain mode."""
    input_template: str | None = "User: {}\nAssistant: "
    """Template with one ``{}`` wrapped around the prompt when no chat template is applied."""
    multiturn: bool = False
    """``input_key`` holds a whole conversation; loss on every assistant turn only."""


@dataclass(frozen=True)
class SFTConfig:
    """Supervised fine-tuning (and continued pre-training with ``--model.pretrain_mode_enable``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ds: DSConfig = field(default_factory=DSConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ckpt: CkptConfig = field(default_factory=lambda: CkptConfig(path="./ckpt/checkpoints_sft"))
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    local_rank: int = -1
    """Set by the ``deepspeed`` launcher; the rank is read from the environment."""
    use_ms: bool = False
    """Not supported: ModelScope downloads."""

    def validate(self) -> None:
        validate_common(self)
