"""Supervised fine-tuning. ``python -m rlhforge.cli.train_sft`` (OpenRLHF's module name) or ``rlhforge sft``.

Launch on several processes with ``torchrun --nproc_per_node N -m rlhforge.cli.train_sft ...`` or
``deepspeed --module rlhforge.cli.train_sft ...``.
"""

from __future__ import annotations

import sys
from pathlib import Path

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
    from rlhforge.backend.factory import build_strategy
    from rlhforge.cli.supervised import announce, batch_plan, fit, policy_model, ring_group, start, tokenizer_and_samples
    from rlhforge.cli.vlm import load_vlm_sft_data
    from rlhforge.trainers.sft import SFTTrainer

    start(cfg)
    tokenizer, train_samples, eval_samples, vlm = tokenizer_and_samples(
        cfg, lambda tok: load_sft_data(cfg, tok), load_vlm_sft_data)
    plan = batch_plan(cfg, len(train_samples), cfg.ds.ring_attn_size)
    strategy = build_strategy(cfg.ds, cfg.optim, cfg.train, plan)
    model = policy_model(cfg, strategy, vlm)
    ring = ring_group(cfg, model)
    wrapped = strategy.prepare(model, plan.total_steps)
    out = announce(cfg, strategy, plan, ring, "sft", f"{len(train_samples)} train / {len(eval_samples)} eval samples")
    return fit(cfg, strategy, out, lambda logger: SFTTrainer(cfg, strategy, wrapped, tokenizer, train_samples,
                                                              eval_samples, plan, logger, ring=ring))


def main(argv: list[str] | None = None, prog: str = "python -m rlhforge.cli.train_sft") -> int:
    from rlhforge.cli.supervised import command_main

    return command_main("sft", SFTConfig, run, argv, prog)


if __name__ == "__main__":
    sys.exit(main())
