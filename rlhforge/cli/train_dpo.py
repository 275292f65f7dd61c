"""DPO / cDPO / IPO training. ``python -m rlhforge.cli.train_dpo`` (OpenRLHF's module name) or ``rlhforge dpo``.

Launch on several processes with ``torchrun --nproc_per_node N -m rlhforge.cli.train_dpo ...`` or
``deepspeed --module rlhforge.cli.train_dpo ...``.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from rlhforge.cli.train_rm import load_preference_data
from rlhforge.config.dpo import DPOConfig
from rlhforge.config.aliases import DPO_LEGACY_ALIASES  # noqa: F401 (re-exported: the tables live in config/aliases.py)

CONFIG_CLASS = DPOConfig

def load_reference_model(cfg: DPOConfig, strategy, vlm: bool = False):
    """The frozen reference policy, or None when it is the LoRA policy with its adapter disabled."""
    import torch

    from rlhforge.config.components import LoraConfig
    from rlhforge.models.loading import load_causal_lm

    if cfg.uses_adapter_reference:
        return None
    path = cfg.ref.model_name_or_path or cfg.model.model_name_or_path
    model_cfg = dataclasses.replace(cfg.model, gradient_checkpointing_enable=False)
    ds_cfg = dataclasses.replace(cfg.ds, lora=LoraConfig(rank=0), load_in_4bit=False)
    device = torch.device("cpu") if cfg.ref.offload else strategy.device
    if vlm:  # a vision-language policy (docs/vlm.md)
        from rlhforge.cli.vlm import load_vlm_reference

        ref = load_vlm_reference(path, model_cfg, ds_cfg, device)
    else:
        ref = load_causal_lm(path, model_cfg, ds_cfg, device)
    return ref  # FrozenModel gives it the policy's precision mechanism (run())


def frozen_kind(strategy, cfg: DPOConfig) -> str:
    """How the reference is prepared: as the policy's strategy (AutoTP policies keep a replicated one)."""
    if cfg.ds.tensor_parallel_size > 1:
        return "torch"
    return {"DeepSpeedStrategy": "deepspeed", "FSDP2Strategy": "fsdp2"}.get(type(strategy).__name__, "torch")


def build_reference(cfg, strategy, wrapped, ref_model, ring=None):
    """The reference log-probs' source: the separate reference prepared like the policy (ZeRO-3 partitioned /
    FSDP2 sharded when it is), or the LoRA policy with its adapter disabled (``ref_model`` None)."""
    from rlhforge.trainers.dpo import Reference

    frozen = None
    if ref_model is not None:
        from rlhforge.backend.frozen import FrozenModel

        frozen = FrozenModel(ref_model, cfg.ds, strategy.device, kind=frozen_kind(strategy, cfg),
                             offload=cfg.ref.offload)
    return Reference(strategy, wrapped, frozen, offload=cfg.ref.offload, ring=ring)


def run(cfg: DPOConfig) -> Path:
    """Train and export; returns the output folder. Usable from Python as well as the CLI."""
    from rlhforge.backend.factory import build_strategy
    from rlhforge.cli.supervised import announce, batch_plan, fit, policy_model, ring_group, start, tokenizer_and_samples
    from rlhforge.cli.vlm import load_vlm_preference_data
    from rlhforge.trainers.dpo import DPOTrainer

    start(cfg)
    tokenizer, train_samples, eval_samples, vlm = tokenizer_and_samples(
        cfg, lambda tok: load_preference_data(cfg, tok, force_eos=False, use_margin=False), load_vlm_preference_data)
    plan = batch_plan(cfg, len(train_samples), cfg.ds.ring_attn_size)
    strategy = build_strategy(cfg.ds, cfg.optim, cfg.train, plan)
    model = policy_model(cfg, strategy, vlm)
    ref_model = load_reference_model(cfg, strategy, vlm=vlm)
    ring = ring_group(cfg, model, ref_model)  # policy and reference run every packed row across the ring
    wrapped = strategy.prepare(model, plan.total_steps)
    reference = build_reference(cfg, strategy, wrapped, ref_model, ring=ring)
    variant = "ipo" if cfg.model.ipo_enable else ("cdpo" if cfg.model.label_smoothing > 0 else "dpo")
    out = announce(cfg, strategy, plan, ring, f"dpo ({variant}, beta {cfg.model.beta})",
                   f"{len(train_samples)} train / {len(eval_samples)} eval pairs",
                   f", reference: {reference.kind}{' (precomputed once)' if cfg.ref.precompute_enable else ''}")
    return fit(cfg, strategy, out, lambda logger: DPOTrainer(cfg, strategy, wrapped, reference, tokenizer,
                                                              train_samples, eval_samples, plan, logger, ring=ring))


def main(argv: list[str] | None = None, prog: str = "python -m rlhforge.cli.train_dpo") -> int:
    from rlhforge.cli.supervised import command_main

    return command_main("dpo", DPOConfig, run, argv, prog, legacy=DPO_LEGACY_ALIASES)


if __name__ == "__main__":
    sys.exit(main())
