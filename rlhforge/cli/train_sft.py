"""Supervised fine-tuning. ``python -m rlhforge.cli.train_sft`` (OpenRLHF's module name) or ``rlhforge sft``.

Launch on several processes with ``torchrun --nproc_per_node N -m rlhforge.cli.train_sft ...`` or
``deepspeed --module rlhforge.cli.train_sft ...``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rlhforge.config.parsing import parse_args, save_yaml, to_dict
from rlhforge.config.sft import SFTConfig

CONFIG_CLASS = SFTConfig


def load_sft_data(cfg: SFTConfig, tokenizer):
    """Training and eval samples (eval from ``eval.dataset`` or a held-out fraction)."""
    from rlhforge.data.loading import load_train_and_eval
    from rlhforge.data.sft import build_sft_samples

    d = cfg.data
    kwargs = dict(
        input_key=d.input_key, output_key=d.output_key, input_template=None if d.apply_chat_template else d.input_template,
        apply_chat_template=d.apply_chat_template, multiturn=d.multiturn,
        pretrain_mode=cfg.model.pretrain_mode_enable, max_len=d.max_len,
    )
    train, evals = load_train_and_eval(d, cfg.eval, seed=cfg.train.seed)
    train_samples = build_sft_samples(train, tokenizer, **kwargs)
    eval_samples = build_sft_samples(evals, tokenizer, **kwargs) if evals is not None else []
    return train_samples, eval_samples


def run(cfg: SFTConfig) -> Path:
    """Train and export; returns the output folder. Usable from Python as well as the CLI."""
    from rlhforge.trainers.run_folder import check_run_folder

    check_run_folder(cfg.ckpt)  # a folder holding another run: refused, or --ckpt.overwrite clears it

    from rlhforge.backend.device import dist_info
    from rlhforge.backend.factory import build_strategy
    from rlhforge.config.batching import plan_batches
    from rlhforge.models.loading import load_causal_lm, load_tokenizer
    from rlhforge.trainers.common import seed_everything
    from rlhforge.trainers.sft import SFTTrainer
    from rlhforge.tracking.metrics import MetricsLogger

    seed_everything(cfg.train.seed, cfg.train.full_determinism_enable)
    from rlhforge.cli.vlm import load_vlm_model, load_vlm_sft_data, vlm_setup

    processor = vlm_setup(cfg)  # a vision-language model: tokenizer + image processor (docs/vlm.md)
    if processor is not None:
        tokenizer = processor
        train_samples, eval_samples = load_vlm_sft_data(cfg, processor)
    else:
        tokenizer = load_tokenizer(cfg.model.model_name_or_path, chat_template=cfg.data.tokenizer_chat_template,
                                   use_fast=not cfg.data.disable_fast_tokenizer)
        train_samples, eval_samples = load_sft_data(cfg, tokenizer)
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
    ring = None
    if ring_size > 1:
        from rlhforge.backend.context_parallel import new_ring_group, use_ring_attention

        ring = new_ring_group(ring_size, cfg.ds.ring_attn_head_stride)
        use_ring_attention(model)
    wrapped = strategy.prepare(model, plan.total_steps)
    out = Path(cfg.ckpt.output_dir)
    if strategy.is_rank0:
        save_yaml(cfg, out / "config.yaml")
        print(f"[rlhforge] sft: {len(train_samples)} train / {len(eval_samples)} eval samples, "
              f"{plan.total_steps} steps ({plan.steps_per_epoch}/epoch), {strategy.world_size} rank(s)"
              f"{f' as {plan.world_size} data-parallel x {ring_size} ring-attention' if ring else ''}, "
              f"grad accumulation {plan.grad_accum_steps}, {type(strategy).__name__} on {strategy.device}")
    logger = MetricsLogger(out, cfg.logger, enabled=strategy.is_rank0, config=to_dict(cfg))
    try:
        SFTTrainer(cfg, strategy, wrapped, tokenizer, train_samples, eval_samples, plan, logger, ring=ring).fit()
    finally:
        logger.close()
    return out


def main(argv: list[str] | None = None, prog: str = "python -m rlhforge.cli.train_sft") -> int:
    from rlhforge.cli.errors import user_errors
    from rlhforge.trainers.run_folder import announce_finished
    from rlhforge.config.paths import model_paths
    from rlhforge.models.hub import check_model_sources

    with user_errors(prog):
        cfg = parse_args(SFTConfig, argv, prog=prog, description=SFTConfig.__doc__)
        check_model_sources(model_paths(cfg))  # missing local folder / unreachable hub: exit 2 now
        run(cfg)
        announce_finished("sft", cfg.ckpt)  # one line: the final model, the metrics, the checkpoints
    return 0


if __name__ == "__main__":
    sys.exit(main())
