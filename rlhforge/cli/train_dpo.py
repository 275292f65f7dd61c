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
from rlhforge.config.parsing import parse_args, save_yaml, to_dict
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


def run(cfg: DPOConfig) -> Path:
    """Train and export; returns the output folder. Usable from Python as well as the CLI."""
    from rlhforge.trainers.run_folder import check_run_folder

    check_run_folder(cfg.ckpt)  # a folder holding another run: refused, or --ckpt.overwrite clears it

    from rlhforge.backend.device import dist_info
    from rlhforge.backend.factory import build_strategy
    from rlhforge.config.batching import plan_batches
    from rlhforge.models.loading import load_causal_lm, load_tokenizer
    from rlhforge.trainers.common import seed_everything
    from rlhforge.trainers.dpo import DPOTrainer, Reference
    from rlhforge.tracking.metrics import MetricsLogger

    seed_everything(cfg.train.seed, cfg.train.full_determinism_enable)
    from rlhforge.cli.vlm import load_vlm_model, load_vlm_preference_data, vlm_setup

    processor = vlm_setup(cfg)  # a vision-language model: tokenizer + image processor (docs/vlm.md)
    if processor is not None:
        tokenizer = processor
        train_samples, eval_samples = load_vlm_preference_data(cfg, processor)
    else:
        tokenizer = load_tokenizer(cfg.model.model_name_or_path, chat_template=cfg.data.tokenizer_chat_template,
                                   use_fast=not cfg.data.disable_fast_tokenizer)
        train_samples, eval_samples = load_preference_data(cfg, tokenizer, force_eos=False, use_margin=False)
    ring_size = cfg.ds.ring_attn_size
    plan = plan_batches(num_samples=len(train_samples), batch_size=cfg.train.batch_size,
                        micro_batch_size=cfg.train.micro_batch_size,
                        world_size=dist_info().world_size // max(cfg.ds.tensor_parallel_size, 1),  # AutoTP: dp ranks
                        max_epochs=cfg.train.max_epochs, max_steps=cfg.train.max_steps, ring_size=ring_size)
    strategy = build_strategy(cfg.ds, cfg.optim, cfg.train, plan)
    with strategy.model_init():  # ZeRO-3: partitioned as it loads
        if processor is not None:
            model = load_vlm_model(cfg, strategy.device)
        else:
            model = load_causal_lm(cfg.model.model_name_or_path, cfg.model, cfg.ds, strategy.device)
    ref_model = load_reference_model(cfg, strategy, vlm=processor is not None)
    ring = None
    if ring_size > 1:  # policy and reference run every packed row across the ring (docs/long_context.md)
        from rlhforge.backend.context_parallel import new_ring_group, use_ring_attention

        ring = new_ring_group(ring_size, cfg.ds.ring_attn_head_stride)
        for m in (model, ref_model):
            if m is not None:
                use_ring_attention(m)
    wrapped = strategy.prepare(model, plan.total_steps)
    frozen = None
    if ref_model is not None:  # prepared like the policy: ZeRO-3 partitioned / FSDP2 sharded when it is
        from rlhforge.backend.frozen import FrozenModel

        frozen = FrozenModel(ref_model, cfg.ds, strategy.device, kind=frozen_kind(strategy, cfg),
                             offload=cfg.ref.offload)
    reference = Reference(strategy, wrapped, frozen, offload=cfg.ref.offload, ring=ring)
    out = Path(cfg.ckpt.output_dir)
    if strategy.is_rank0:
        save_yaml(cfg, out / "config.yaml")
        variant = "ipo" if cfg.model.ipo_enable else ("cdpo" if cfg.model.label_smoothing > 0 else "dpo")
        print(f"[rlhforge] dpo ({variant}, beta {cfg.model.beta}): {len(train_samples)} train / {len(eval_samples)} "
              f"eval pairs, {plan.total_steps} steps ({plan.steps_per_epoch}/epoch), {strategy.world_size} rank(s)"
              f"{f' as {plan.world_size} data-parallel x {ring_size} ring-attention' if ring else ''}, "
              f"grad accumulation {plan.grad_accum_steps}, {type(strategy).__name__} on {strategy.device}, "
              f"reference: {reference.kind}{' (precomputed once)' if cfg.ref.precompute_enable else ''}")
    logger = MetricsLogger(out, cfg.logger, enabled=strategy.is_rank0, config=to_dict(cfg))
    try:
        DPOTrainer(cfg, strategy, wrapped, reference, tokenizer, train_samples, eval_samples, plan, logger,
                   ring=ring).fit()
    finally:
        logger.close()
    return out


def main(argv: list[str] | None = None, prog: str = "python -m rlhforge.cli.train_dpo") -> int:
    from rlhforge.cli.errors import user_errors
    from rlhforge.trainers.run_folder import announce_finished
    from rlhforge.config.paths import model_paths
    from rlhforge.models.hub import check_model_sources

    with user_errors(prog):
        cfg = parse_args(DPOConfig, argv, prog=prog, description=DPOConfig.__doc__, legacy=DPO_LEGACY_ALIASES)
        check_model_sources(model_paths(cfg))  # missing local folder / unreachable hub: exit 2 now
        run(cfg)
        announce_finished("dpo", cfg.ckpt)  # one line: the final model, the metrics, the checkpoints
    return 0


if __name__ == "__main__":
    sys.exit(main())
