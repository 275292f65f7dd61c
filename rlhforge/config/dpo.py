"""Configuration of ``rlhforge dpo`` / ``python -m rlhforge.cli.train_dpo`` (DPO, cDPO, IPO).

Flag names are OpenRLHF's ``train_dpo`` flags (``--model.beta``, ``--model.ipo_enable``,
``--model.label_smoothing``, ``--model.nll_loss_coef``, ``--ref.model_name_or_path``,
``--ref.offload``); defaults are OpenRLHF's (micro-batch 8, one epoch, lr 1e-5, max_len 512,
eval split ``test``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from rlhforge.config.components import (AdamConfig, CkptConfig, DSConfig, EvalConfig, LoggerConfig, ModelConfig,
                                        OptimConfig, TrainConfig)
from rlhforge.config.parsing import ConfigError
from rlhforge.config.rm import PreferenceDataConfig, validate_preference_common
from rlhforge.config.validation import validate_common


@dataclass(frozen=True)
class DPOModelConfig(ModelConfig):
    """The policy trained with DPO and the loss variant."""

    beta: float = 0.1
    """Inverse temperature of the implicit reward ``beta * (log pi - log pi_ref)``."""
    ipo_enable: bool = False
    """IPO loss ``(h - 1/(2 beta))^2`` instead of DPO's ``-log sigmoid(beta h)`` (summed log-probs, as OpenRLHF)."""
    label_smoothing: float = 0.0
    """cDPO: probability eps in [0, 0.5) that a preference label is flipped (0 = plain DPO)."""
    nll_loss_coef: float = 0.0
    """Add ``coef * NLL`` of the chosen responses (token-averaged per pair; RPO)."""
    freeze_visual_encoder: bool = False
    """Vision-language models: keep the vision tower frozen (docs/vlm.md; OpenRLHF's DPO has no VLM
    support). A text-only model refuses it."""


@dataclass(frozen=True)
class DPODataConfig(PreferenceDataConfig):
    """Preference pairs; for vision-language models also the prompt's images (docs/vlm.md)."""

    image_key: str = "images"
    """Vision-language models: field with the pair's image(s) (paths relative to the dataset file, base64 /
    ``data:`` URIs, ``datasets`` images), shown in the prompt of both sides. Ignored for a text-only model."""
    max_images_per_prompt: int = 0
    """Vision-language models: most images one pair may have (more is a data error); 0: no bound."""


@dataclass(frozen=True)
class RefConfig:
    """The frozen reference policy."""

    model_name_or_path: str | None = None
    """Reference model (default: the policy's starting checkpoint). With LoRA and no other path, the
    reference is the policy with its adapter disabled, so no second copy is held."""
    offload: bool = False
    """Keep the reference model on the CPU and move it to the device only while it runs."""
    precompute_enable: bool = False
    """Compute the reference log-probs of every train/eval pair once before training, then free the
    reference model (saves memory and one forward per step). rlhforge-specific."""


def uses_adapter_reference(cfg) -> bool:
    """LoRA with no separate reference path (DPO, KTO): the reference is the policy with the adapter disabled."""
    ref = cfg.ref.model_name_or_path
    return cfg.ds.lora.rank > 0 and (ref is None or ref == cfg.model.model_name_or_path)


def check_reference(cfg) -> None:
    """The ``--ref.*`` rules DPO and KTO share."""
    if cfg.ref.offload and uses_adapter_reference(cfg):
        raise ConfigError(
            "--ref.offload: with LoRA the reference is the policy with its adapter disabled, so there is no "
            "separate reference model to offload (drop --ref.offload, or give --ref.model_name_or_path)"
        )


@dataclass(frozen=True)
class DPOCkptConfig(CkptConfig):
    CHECKPOINTS: ClassVar[str] = "checkpoints_dpo"


@dataclass(frozen=True)
class DPOConfig:
    """Direct preference optimisation (DPO; cDPO with ``--model.label_smoothing``; IPO with
    ``--model.ipo_enable``) against a frozen reference model."""

    model: DPOModelConfig = field(default_factory=DPOModelConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    data: DPODataConfig = field(default_factory=DPODataConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(micro_batch_size=8, max_epochs=1))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(adam=AdamConfig(lr=1e-5)))
    ds: DSConfig = field(default_factory=DSConfig)
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(split="test"))
    ckpt: DPOCkptConfig = field(default_factory=DPOCkptConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    local_rank: int = -1
    """Set by the ``deepspeed`` launcher; the rank is read from the environment."""
    use_ms: bool = False
    """Not supported: ModelScope downloads."""

    @property
    def uses_adapter_reference(self) -> bool:
        return uses_adapter_reference(self)

    def validate(self) -> None:
        validate_common(self)
        validate_preference_common(self)
        m = self.model
        if not m.beta > 0:
            raise ConfigError(f"--model.beta must be > 0 (got {m.beta})")
        if not 0.0 <= m.label_smoothing < 0.5:
            raise ConfigError(f"--model.label_smoothing must be in [0, 0.5) (got {m.label_smoothing})")
        if m.ipo_enable and m.label_smoothing > 0:
            raise ConfigError(
                f"--model.ipo_enable and --model.label_smoothing {m.label_smoothing} are exclusive: label "
                "smoothing (cDPO) applies to the sigmoid DPO loss only"
            )
        if self.data.max_images_per_prompt < 0:
            raise ConfigError(f"--data.max_images_per_prompt must be >= 0 (got {self.data.max_images_per_prompt}; "
                              "0: no bound)")
        if m.nll_loss_coef < 0:
            raise ConfigError(f"--model.nll_loss_coef must be >= 0 (got {m.nll_loss_coef})")
        check_reference(self)
