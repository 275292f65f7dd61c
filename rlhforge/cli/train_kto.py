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
    from rlhforge.backend.factory import build_strategy
    from rlhforge.cli.supervised import announce, batch_plan, fit, policy_model, start, tokenizer_and_samples
    from rlhforge.cli.train_dpo import build_reference, load_reference_model
    from rlhforge.trainers.dpo import DPOTrainer
    from rlhforge.trainers.kto import KTOObjective

    start(cfg)
    tokenizer, train_samples, eval_samples, _ = tokenizer_and_samples(cfg, lambda tok: load_unpaired_data(cfg, tok))
    plan = batch_plan(cfg, len(train_samples))
    strategy = build_strategy(cfg.ds, cfg.optim, cfg.train, plan)
    model = policy_model(cfg, strategy)
    ref_model = load_reference_model(cfg, strategy)
    wrapped = strategy.prepare(model, plan.total_steps)
    reference = build_reference(cfg, strategy, wrapped, ref_model)
    m, good = cfg.model, sum(s.desirable for s in train_samples)
    out = announce(cfg, strategy, plan, None,
                   f"kto ({m.loss_type}, beta {m.beta}, weights {m.desirable_weight} / {m.undesirable_weight})",
                   f"{len(train_samples)} train examples ({good} desirable, {len(train_samples) - good} undesirable) "
                   f"/ {len(eval_samples)} eval",
                   f", reference: {reference.kind}{' (precomputed once)' if cfg.ref.precompute_enable else ''}")
    return fit(cfg, strategy, out, lambda logger: DPOTrainer(
        cfg, strategy, wrapped, reference, tokenizer, train_samples, eval_samples, plan, logger,
        objective=KTOObjective(cfg, strategy), name="kto"))


def main(argv: list[str] | None = None, prog: str = "python -m rlhforge.cli.train_kto") -> int:
    from rlhforge.cli.supervised import command_main

    return command_main("kto", KTOConfig, run, argv, prog, legacy=KTO_LEGACY_ALIASES)


if __name__ == "__main__":
    sys.exit(main())
