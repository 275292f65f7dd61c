"""Reward-model training. ``python -m rlhforge.cli.train_rm`` (OpenRLHF's module name) or ``rlhforge rm``.

Launch on several processes with ``torchrun --nproc_per_node N -m rlhforge.cli.train_rm ...`` or
``deepspeed --module rlhforge.cli.train_rm ...``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rlhforge.config.rm import RMConfig
from rlhforge.config.aliases import PREFERENCE_LEGACY_ALIASES, RM_LEGACY_ALIASES  # noqa: F401 (re-exported: the tables live in config/aliases.py)

CONFIG_CLASS = RMConfig

def load_preference_data(cfg, tokenizer, *, force_eos: bool, use_margin: bool):
    """Training and eval pairs (eval from ``eval.dataset`` or a held-out fraction)."""
    from rlhforge.data.loading import load_train_and_eval
    from rlhforge.data.preference import build_preference_samples

    d = cfg.data
    kwargs = dict(
        prompt_key=d.prompt_key, chosen_key=d.chosen_key, rejected_key=d.rejected_key, margin_key=d.margin_key,
        use_margin=use_margin, input_template=None if d.apply_chat_template else d.input_template,
        apply_chat_template=d.apply_chat_template, max_len=d.max_len, force_eos=force_eos,
    )
    train, evals = load_train_and_eval(d, cfg.eval, seed=cfg.train.seed)
    train_samples = build_preference_samples(train, tokenizer, **kwargs)
    eval_samples = build_preference_samples(evals, tokenizer, **kwargs) if evals is not None else []
    return train_samples, eval_samples


def run(cfg: RMConfig) -> Path:
    """Train and export; returns the output folder. Usable from Python as well as the CLI."""
    from rlhforge.backend.factory import build_strategy
    from rlhforge.cli.supervised import announce, batch_plan, fit, ring_group, start, tokenizer_and_samples
    from rlhforge.models.reward import load_reward_model
    from rlhforge.trainers.rm import RMTrainer

    start(cfg)
    tokenizer, train_samples, eval_samples, _ = tokenizer_and_samples(
        cfg, lambda tok: load_preference_data(cfg, tok, force_eos=True, use_margin=cfg.model.margin_loss_enable))
    plan = batch_plan(cfg, len(train_samples), cfg.ds.ring_attn_size)
    strategy = build_strategy(cfg.ds, cfg.optim, cfg.train, plan)
    model = load_reward_model(cfg.model.model_name_or_path, cfg.model, cfg.ds, strategy.device,
                              pad_token_id=tokenizer.pad_token_id, value_head_prefix=cfg.ds.value_head_prefix)
    if tokenizer.pad_token_id == tokenizer.eos_token_id and strategy.is_rank0:
        print("[rlhforge] rm: warning: the pad token is the EOS token; HF's AutoModelForSequenceClassification "
              "forward will read the reward one token before the final EOS (rlhforge's own scoring is unaffected). "
              "Give the tokenizer a separate pad token to make them agree.")
    ring = ring_group(cfg, model)  # every packed row runs across the ring (docs/long_context.md)
    wrapped = strategy.prepare(model, plan.total_steps)
    out = announce(cfg, strategy, plan, ring, "rm", f"{len(train_samples)} train / {len(eval_samples)} eval pairs")
    return fit(cfg, strategy, out, lambda logger: RMTrainer(cfg, strategy, wrapped, tokenizer, train_samples,
                                                             eval_samples, plan, logger, ring=ring))


def main(argv: list[str] | None = None, prog: str = "python -m rlhforge.cli.train_rm") -> int:
    from rlhforge.cli.supervised import command_main

    return command_main("rm", RMConfig, run, argv, prog, legacy=RM_LEGACY_ALIASES)


if __name__ == "__main__":
    sys.exit(main())
