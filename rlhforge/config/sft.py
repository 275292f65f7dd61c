"""Configuration of ``rlhforge sft`` / ``python -m rlhforge.cli.train_sft``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from rlhforge.config.components import (CkptConfig, DataConfig, DSConfig, EvalConfig, LoggerConfig, ModelConfig,
                                        OptimConfig, TrainConfig)
from rlhforge.config.parsing import ConfigError
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
    image_key: str = "images"
    """Vision-language models: field with the record's image(s): paths relative to the dataset file,
    base64 / ``data:`` URIs, or ``datasets`` images (docs/vlm.md). Ignored for a text-only model."""
    max_images_per_prompt: int = 0
    """Vision-language models: most images one sample may have (more is a data error); 0: no bound."""


@dataclass(frozen=True)
class SFTModelConfig(ModelConfig):
    """The model being trained; vision-language models are detected from their config (docs/vlm.md)."""

    freeze_visual_encoder: bool = False
    """Vision-language models: keep the vision tower frozen (OpenRLHF's ``--actor.freeze_visual_encoder``
    for SFT, which OpenRLHF's SFT does not have). A text-only model refuses it."""


@dataclass(frozen=True)
class SFTCkptConfig(CkptConfig):
    CHECKPOINTS: ClassVar[str] = "checkpoints_sft"


@dataclass(frozen=True)
class SFTConfig:
    """Supervised fine-tuning (and continued pre-training with ``--model.pretrain_mode_enable``)."""

    model: SFTModelConfig = field(default_factory=SFTModelConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ds: DSConfig = field(default_factory=DSConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ckpt: SFTCkptConfig = field(default_factory=SFTCkptConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    local_rank: int = -1
    """Set by the ``deepspeed`` launcher; the rank is read from the environment."""
    use_ms: bool = False
    """Not supported: ModelScope downloads."""

    def validate(self) -> None:
        validate_common(self)
        if self.data.max_images_per_prompt < 0:
            raise ConfigError(f"--data.max_images_per_prompt must be >= 0 (got {self.data.max_images_per_prompt}; "
                              "0: no bound)")
