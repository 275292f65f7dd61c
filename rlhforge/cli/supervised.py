"""The set-up ``rlhforge sft``, ``rm``, ``dpo`` and ``kto`` share (issue 45): the command-line entry, the batch
plan over the data-parallel ranks, the ring-attention group, the run's header line and config file, and the
metrics logger around the trainer's ``fit``. Each command's module keeps what is its own (its data, its
model and reference, its trainer)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

__all__ = ["command_main", "start", "tokenizer_and_samples", "policy_model", "batch_plan", "ring_group", "announce",
           "fit"]


def command_main(command: str, config_cls, run: Callable, argv, prog: str, legacy: dict | None = None) -> int:
    """``main`` of a training command: parse (exit 2 on a bad flag), check model paths (a missing local folder
    or an unreachable hub: exit 2 now), ``run(cfg)``, then one line naming the final model."""
    from rlhforge.cli.errors import user_errors
    from rlhforge.config.parsing import parse_args
    from rlhforge.config.paths import model_paths
    from rlhforge.models.hub import check_model_sources
    from rlhforge.trainers.run_folder import announce_finished

    with user_errors(prog):
        kwargs = {} if legacy is None else {"legacy": legacy}
        cfg = parse_args(config_cls, argv, prog=prog, description=config_cls.__doc__, **kwargs)
        check_model_sources(model_paths(cfg))
        run(cfg)
        announce_finished(command, cfg.ckpt)
    return 0


def start(cfg) -> None:
    """A run's first steps: the output folder may take this run (else exit 2, or ``--ckpt.overwrite``), seeds."""
    from rlhforge.trainers.common import seed_everything
    from rlhforge.trainers.run_folder import check_run_folder

    check_run_folder(cfg.ckpt)
    seed_everything(cfg.train.seed, cfg.train.full_determinism_enable)


def tokenizer_and_samples(cfg, text_samples: Callable, vlm_samples: Callable | None = None) -> tuple:
    """``(tokenizer, train samples, eval samples, is_vlm)``: a vision-language model (docs/vlm.md) gets its
    processor as the tokenizer and ``vlm_samples(cfg, processor)``; a text model its tokenizer (with
    ``--data.tokenizer_chat_template``) and ``text_samples(tokenizer)``."""
    from rlhforge.models.loading import load_tokenizer

    if vlm_samples is not None:
        from rlhforge.cli.vlm import vlm_setup

        processor = vlm_setup(cfg)
        if processor is not None:
            return (processor, *vlm_samples(cfg, processor), True)
    tokenizer = load_tokenizer(cfg.model.model_name_or_path, chat_template=cfg.data.tokenizer_chat_template,
                               use_fast=not cfg.data.disable_fast_tokenizer)
    return (tokenizer, *text_samples(tokenizer), False)


def policy_model(cfg, strategy, vlm: bool = False):
    """The trained causal LM (a VLM's with ``vlm``), loaded under ``strategy.model_init()`` (ZeRO-3:
    partitioned as it loads)."""
    from rlhforge.models.loading import load_causal_lm

    with strategy.model_init():
        if vlm:
            from rlhforge.cli.vlm import load_vlm_model

            return load_vlm_model(cfg, strategy.device)
        return load_causal_lm(cfg.model.model_name_or_path, cfg.model, cfg.ds, strategy.device)


def batch_plan(cfg, num_samples: int, ring_size: int = 1):
    """The step plan over the data-parallel ranks (AutoTP: a tensor-parallel group is one data rank)."""
    from rlhforge.backend.device import dist_info
    from rlhforge.config.batching import plan_batches

    return plan_batches(num_samples=num_samples, batch_size=cfg.train.batch_size,
                        micro_batch_size=cfg.train.micro_batch_size,
                        world_size=dist_info().world_size // max(cfg.ds.tensor_parallel_size, 1),
                        max_epochs=cfg.train.max_epochs, max_steps=cfg.train.max_steps, ring_size=ring_size)


def ring_group(cfg, *models):
    """With ``--ds.ring_attn_size`` > 1: the ring group, every given model attending across it
    (docs/long_context.md); else None."""
    if cfg.ds.ring_attn_size <= 1:
        return None
    from rlhforge.backend.context_parallel import new_ring_group, use_ring_attention

    ring = new_ring_group(cfg.ds.ring_attn_size, cfg.ds.ring_attn_head_stride)
    for model in models:
        if model is not None:
            use_ring_attention(model)
    return ring


def announce(cfg, strategy, plan, ring, label: str, counts: str, tail: str = "") -> Path:
    """Write the resolved config to the output folder and print the run's header line (rank 0); the folder."""
    from rlhforge.config.parsing import save_yaml

    out = Path(cfg.ckpt.output_dir)
    if strategy.is_rank0:
        save_yaml(cfg, out / "config.yaml")
        print(f"[rlhforge] {label}: {counts}, {plan.total_steps} steps ({plan.steps_per_epoch}/epoch), "
              f"{strategy.world_size} rank(s)"
              f"{f' as {plan.world_size} data-parallel x {ring.ring_size} ring-attention' if ring else ''}, "
              f"grad accumulation {plan.grad_accum_steps}, {type(strategy).__name__} on {strategy.device}{tail}")
    return out


def fit(cfg, strategy, out: Path, make_trainer: Callable) -> Path:
    """``make_trainer(logger).fit()`` with the run's metrics logger, closed whatever happens; the folder."""
    from rlhforge.config.parsing import to_dict
    from rlhforge.tracking.metrics import MetricsLogger

    logger = MetricsLogger(out, cfg.logger, enabled=strategy.is_rank0, config=to_dict(cfg))
    try:
        make_trainer(logger).fit()
    finally:
        logger.close()
    return out
