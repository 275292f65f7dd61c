"""Reward-model training. ``python -m rlhforge.cli.train_rm`` (OpenRLHF's module name) or ``rlhforge rm``.

Launch on several processes with ``torchrun --nproc_per_node N -m rlhforge.cli.train_rm ...`` or
``deepspeed --module rlhforge.cli.train_rm ...``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rlhforge.config.parsing import parse_args, save_yaml, to_dict
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
    from rlhforge.trainers.run_folder import check_run_folder

    check_run_folder(cfg.ckpt)  # a folder holding another run: refused, or --ckpt.overwrite clears it

    from rlhforge.backend.device import dist_info
    from rlhforge.backend.factory import build_strategy
    from rlhforge.config.batching import plan_batches
    from rlhforge.models.loading import load_tokenizer
    from rlhforge.models.reward import load_reward_model
    from rlhforge.trainers.common import seed_everything
    from rlhforge.trainers.rm import RMTrainer
    from rlhforge.tracking.metrics import MetricsLogger

    seed_everything(cfg.train.seed, cfg.train.full_determinism_enable)
    tokenizer = load_tokenizer(cfg.model.model_name_or_path, chat_template=cfg.data.tokenizer_chat_template,
                               use_fast=not cfg.data.disable_fast_tokenizer)
    train_samples, eval_samples = load_preference_data(cfg, tokenizer, force_eos=True,
                                                       use_margin=cfg.model.margin_loss_enable)
    ring_size = cfg.ds.ring_attn_size
    plan = plan_batches(num_samples=len(train_samples), batch_size=cfg.train.batch_size,
                        micro_batch_size=cfg.train.micro_batch_size,
                        world_size=dist_info().world_size // max(cfg.ds.tensor_parallel_size, 1),  # AutoTP: dp ranks
                        max_epochs=cfg.train.max_epochs, max_steps=cfg.train.max_steps, ring_size=ring_size)
    strategy = build_strategy(cfg.ds, cfg.optim, cfg.train, plan)
    model = load_reward_model(cfg.model.model_name_or_path, cfg.model, cfg.ds, strategy.device,
                              pad_token_id=tokenizer.pad_token_id, value_head_prefix=cfg.ds.value_head_prefix)
    if tokenizer.pad_token_id == tokenizer.eos_token_id and strategy.is_rank0:
        print("[rlhforge] rm: warning: the pad token is the EOS token; HF's AutoModelForSequenceClassification "
              "forward will read the reward one token before the final EOS (rlhforge's own scoring is unaffected). "
              "Give the tokenizer a separate pad token to make them agree.")
    ring = None
    if ring_size > 1:  # every packed row runs across the ring (docs/long_context.md)
        from rlhforge.backend.context_parallel import new_ring_group, use_ring_attention

        ring = new_ring_group(ring_size, cfg.ds.ring_attn_head_stride)
        use_ring_attention(model)
    wrapped = strategy.prepare(model, plan.total_steps)
    out = Path(cfg.ckpt.output_dir)
    if strategy.is_rank0:
        save_yaml(cfg, out / "config.yaml")
        print(f"[rlhforge] rm: {len(train_samples)} train / {len(eval_samples)} eval pairs, "
              f"{plan.total_steps} steps ({plan.steps_per_epoch}/epoch), {strategy.world_size} rank(s)"
              f"{f' as {plan.world_size} data-parallel x {ring_size} ring-attention' if ring else ''}, "
              f"grad accumulation {plan.grad_accum_steps}, {type(strategy).__name__} on {strategy.device}")
    logger = MetricsLogger(out, cfg.logger, enabled=strategy.is_rank0, config=to_dict(cfg))
    try:
        RMTrainer(cfg, strategy, wrapped, tokenizer, train_samples, eval_samples, plan, logger, ring=ring).fit()
    finally:
        logger.close()
    return out


def main(argv: list[str] | None = None, prog: str = "python -m rlhforge.cli.train_rm") -> int:
    from rlhforge.cli.errors import user_errors
    from rlhforge.trainers.run_folder import announce_finished
    from rlhforge.config.paths import model_paths
    from rlhforge.models.hub import check_model_sources

    with user_errors(prog):
        cfg = parse_args(RMConfig, argv, prog=prog, description=RMConfig.__doc__, legacy=RM_LEGACY_ALIASES)
        check_model_sources(model_paths(cfg))  # missing local folder / unreachable hub: exit 2 now
        run(cfg)
        announce_finished("rm", cfg.ckpt)  # one line: the final model, the metrics, the checkpoints
    return 0


if __name__ == "__main__":
    sys.exit(main())
