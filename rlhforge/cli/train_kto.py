"""KTO training on unpaired data. ``rlhforge kto`` or ``python -m rlhforge.cli.train_kto`` (the module name
OpenRLHF used until March 2026).

Launch on several processes with ``torchrun --nproc_per_node N -m rlhforge.cli.train_kto ...`` or
``deepspeed --module rlhforge.cli.train_kto ...``. The loop, reference model, precomputed reference log-probs and
strategies are ``rlhforge dpo``'s (:mod:`rlhforge.cli.train_dpo`); the objective is
:class:`rlhforge.trainers.kto.KTOObjective`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rlhforge.config.kto import KTOConfig
from rlhforge.config.parsing import parse_args, save_yaml, to_dict
from rlhforge.config.aliases import KTO_LEGACY_ALIASES  # noqa: F401 (re-exported: the tables live in config/aliases.py)

CONFIG_CLASS = KTOConfig

def load_unpaired_data(cfg: KTOConfig, tokenizer):
    """Training and eval examples (eval from ``eval.dataset`` or a held-out fraction)."""
    from rlhforge.data.loading import load_train_and_eval
    from rlhforge.data.unpaired import build_unpaired_samples

    d = cfg.data
    kwargs = dict(prompt_key=d.prompt_key, completion_key=d.completion_key, label_key=d.label_key,
                  input_template=None if d.apply_chat_template else d.input_template,
                  apply_chat_template=d.apply_chat_template, max_len=d.max_len)
    train, evals = load_train_and_eval(d, cfg.eval, seed=cfg.train.seed)
    train_samples = build_unpaired_samples(train, tokenizer, **kwargs)
    eval_samples = build_unpaired_samples(evals, tokenizer, **kwargs) if evals is not None else []
    return train_samples, eval_samples


def run(cfg: KTOConfig) -> Path:
    """Train and export; returns the output folder. Usable from Python as well as the CLI."""
    from rlhforge.trainers.run_folder import check_run_folder

    check_run_folder(cfg.ckpt)  # a folder holding another run: refused, or --ckpt.overwrite clears it

    from rlhforge.backend.device import dist_info
    from rlhforge.backend.factory import build_strategy
    from rlhforge.backend.frozen import FrozenModel
    from rlhforge.cli.train_dpo import frozen_kind, load_reference_model
    from rlhforge.config.batching import plan_batches
    from rlhforge.models.loading import load_causal_lm, load_tokenizer
    from rlhforge.trainers.common import seed_everything
    from rlhforge.trainers.dpo import DPOTrainer, Reference
    from rlhforge.trainers.kto import KTOObjective
    from rlhforge.tracking.metrics import MetricsLogger

    seed_everything(cfg.train.seed, cfg.train.full_determinism_enable)
    tokenizer = load_tokenizer(cfg.model.model_name_or_path, chat_template=cfg.data.tokenizer_chat_template,
                               use_fast=not cfg.data.disable_fast_tokenizer)
    train_samples, eval_samples = load_unpaired_data(cfg, tokenizer)
    plan = plan_batches(num_samples=len(train_samples), batch_size=cfg.train.batch_size,
                        micro_batch_size=cfg.train.micro_batch_size,
                        world_size=dist_info().world_size // max(cfg.ds.tensor_parallel_size, 1),  # AutoTP: dp ranks
                        max_epochs=cfg.train.max_epochs, max_steps=cfg.train.max_steps)
    strategy = build_strategy(cfg.ds, cfg.optim, cfg.train, plan)
    with strategy.model_init():  # ZeRO-3: partitioned as it loads
        model = load_causal_lm(cfg.model.model_name_or_path, cfg.model, cfg.ds, strategy.device)
    ref_model = load_reference_model(cfg, strategy)
    wrapped = strategy.prepare(model, plan.total_steps)
    frozen = None
    if ref_model is not None:  # prepared like the policy: ZeRO-3 partitioned / FSDP2 sharded when it is
        frozen = FrozenModel(ref_model, cfg.ds, strategy.device, kind=frozen_kind(strategy, cfg),
                             offload=cfg.ref.offload)
    reference = Reference(strategy, wrapped, frozen, offload=cfg.ref.offload)
    out = Path(cfg.ckpt.output_dir)
    if strategy.is_rank0:
        save_yaml(cfg, out / "config.yaml")
        good = sum(s.desirable for s in train_samples)
        print(f"[rlhforge] kto ({cfg.model.loss_type}, beta {cfg.model.beta}, weights {cfg.model.desirable_weight} "
              f"/ {cfg.model.undesirable_weight}): {len(train_samples)} train examples ({good} desirable, "
              f"{len(train_samples) - good} undesirable) / {len(eval_samples)} eval, {plan.total_steps} steps "
              f"({plan.steps_per_epoch}/epoch), {strategy.world_size} rank(s), grad accumulation "
              f"{plan.grad_accum_steps}, {type(strategy).__name__} on {strategy.device}, reference: {reference.kind}"
              f"{' (precomputed once)' if cfg.ref.precompute_enable else ''}")
    logger = MetricsLogger(out, cfg.logger, enabled=strategy.is_rank0, config=to_dict(cfg))
    try:
        DPOTrainer(cfg, strategy, wrapped, reference, tokenizer, train_samples, eval_samples, plan, logger,
                   objective=KTOObjective(cfg, strategy), name="kto").fit()
    finally:
        logger.close()
    return out


def main(argv: list[str] | None = None, prog: str = "python -m rlhforge.cli.train_kto") -> int:
    from rlhforge.cli.errors import user_errors
    from rlhforge.config.paths import model_paths
    from rlhforge.models.hub import check_model_sources
    from rlhforge.trainers.run_folder import announce_finished

    with user_errors(prog):
        cfg = parse_args(KTOConfig, argv, prog=prog, description=KTOConfig.__doc__, legacy=KTO_LEGACY_ALIASES)
        check_model_sources(model_paths(cfg))  # missing local folder / unreachable hub: exit 2 now
        run(cfg)
        announce_finished("kto", cfg.ckpt)  # one line: the final model, the metrics, the checkpoints
    return 0


if __name__ == "__main__":
    sys.exit(main())
