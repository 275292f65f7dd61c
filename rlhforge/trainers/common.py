"""Small pieces every trainer loop uses: seeding, data order, per-rank micro-batches, resume."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from rlhforge.backend.device import seed_everything  # noqa: F401 - re-exported for the trainers
from rlhforge.backend.step import pad_micro_batch_count, reduce_totals, run_no_grad, sum_totals


def epoch_order(num_samples: int, seed: int, epoch: int) -> list[int]:
    """Deterministic shuffle per epoch, independent of any other RNG use (exact resume)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=g).tolist()


def step_indices(order: Sequence[int], step_in_epoch: int, batch_size: int, rank: int, world_size: int) -> list[int]:
    """The sample indices rank ``rank`` trains on at this optimizer step (contiguous shard)."""
    batch = order[step_in_epoch * batch_size : (step_in_epoch + 1) * batch_size]
    per_rank = batch_size // world_size
    return list(batch[rank * per_rank : (rank + 1) * per_rank])


def micro_batches(
    indices: list[int], lengths: Callable[[int], int], *, micro_batch_size: int, max_tokens: int = 0
) -> list[list[int]]:
    """Fixed-size micro-batches, or token-budget ones when ``max_tokens > 0``."""
    from rlhforge.data.packing import token_budget_batches

    if max_tokens > 0:
        groups = token_budget_batches([lengths(i) for i in indices], max_tokens)
        return [[indices[j] for j in group] for group in groups]
    return [indices[i : i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]


def shard_batches(num_samples: int, shard: tuple[int, int], micro_batch_size: int) -> list[list[int]]:
    """Evaluation micro-batches of data rank ``shard[0]`` of ``shard[1]``: every ``shard[1]``-th index."""
    rank, ranks = shard
    idx = list(range(rank, num_samples, ranks))
    return [idx[i : i + micro_batch_size] for i in range(0, len(idx), micro_batch_size)]


def step_micro_batches(trainer, indices: list[int], length: Callable[[int], int]) -> list[list[int] | None]:
    """A supervised trainer's micro-batches of one optimizer step on this rank: ``--train.micro_batch_size``
    rows, or token-budget ones with ``--train.max_tokens_per_device`` (a ring of R devices holds R budgets);
    every rank gets the same count (``None``: a dummy pass, :func:`pad_micro_batch_count`)."""
    train = trainer.cfg.train
    groups = micro_batches(indices, length, micro_batch_size=train.micro_batch_size,
                           max_tokens=train.max_tokens_per_device * trainer.ring_size)
    return pad_micro_batch_count(trainer.strategy, groups)


def eval_totals(trainer, num_samples: int, shard: tuple[int, int], totals: Callable[[list[int]], dict]) -> dict:
    """``totals(indices)`` over this rank's evaluation micro-batches, without gradients, summed over
    micro-batches and ranks (each sample counted once: ``trainer.copies``)."""
    strategy = trainer.strategy
    batches = pad_micro_batch_count(strategy, shard_batches(num_samples, shard, trainer.cfg.train.micro_batch_size))
    return reduce_totals(strategy, sum_totals(run_no_grad(strategy, batches, totals, dummy=[0])), trainer.copies)


def moe_aux_loss_coef(cfg, strategy) -> float:
    """``--model.aux_loss_coef`` where the model has a MoE load-balancing loss; 0 on a dense model (one notice)."""
    from rlhforge.models.moe import aux_loss_enabled

    coef = cfg.model.aux_loss_coef
    return coef if aux_loss_enabled(coef, strategy.module, "--model.aux_loss_coef") else 0.0


def add_aux_loss(loss, totals: dict, coef: float, aux, passes: int):
    """As OpenRLHF: the micro-batch's loss + ``coef`` x its MoE load-balancing loss ``aux`` (so the step
    adds the mean over its ``passes``); ``totals`` counts it for :func:`aux_loss`. ``aux`` None: unchanged."""
    if aux is None:
        return loss
    totals.update(aux=aux.float(), aux_passes=1.0)
    return loss + coef * aux / passes


def aux_loss(totals: dict[str, float], norm) -> float:
    """The MoE load-balancing loss of a step: its sum over the passes that computed one (``aux_passes``)."""
    return totals.get("aux", 0.0) / max(totals.get("aux_passes", 0.0), 1.0 / norm.copies)


def is_eval_step(step: int, steps_per_epoch: int, eval_steps: int, total_steps: int | None = None) -> bool:
    """Evaluate every ``eval_steps`` steps (when > 0), at every epoch end, and (optionally) at the last step."""
    return (
        (eval_steps > 0 and step % eval_steps == 0)
        or step % steps_per_epoch == 0
        or (total_steps is not None and step == total_steps)
    )


def save_step_checkpoint(strategy, ckpt_cfg, step: int, trainer_state: dict, export, config: dict | None = None):
    """A checkpoint as ``--ckpt.*`` asks: resumable state (plus ``hf/`` with ``save_hf``), or with
    ``disable_ds`` only an HF export at ``<ckpt.path>/step_N_hf`` (or nothing without ``save_hf``).
    ``export(dir)`` writes the HF folder; ``config`` (``to_dict(cfg)``) is kept for the resume
    check; all ranks call this."""
    from pathlib import Path

    from rlhforge.backend.checkpoint import save_checkpoint

    if ckpt_cfg.disable_ds:
        if not ckpt_cfg.save_hf:
            return None
        path = Path(ckpt_cfg.checkpoint_dir) / f"step_{step}_hf"
        export(path)
        return path
    return save_checkpoint(strategy, ckpt_cfg.checkpoint_dir, step, trainer_state, max_num=ckpt_cfg.max_num,
                           max_mem_gb=ckpt_cfg.max_mem, export_hf=export if ckpt_cfg.save_hf else None, config=config)


def save_trainer_checkpoint(trainer, export: Callable) -> object:
    """A supervised trainer's step checkpoint: its state and its fault counters (:func:`save_step_checkpoint`)."""
    from rlhforge.config.parsing import to_dict

    state = {**trainer.state.as_dict(), "faults": trainer.guard.state_dict()}
    return save_step_checkpoint(trainer.strategy, trainer.cfg.ckpt, trainer.state.global_step, state,
                                config=to_dict(trainer.cfg), export=export)


def resume_trainer(trainer) -> dict | None:
    """:func:`resume_trainer_state` for a supervised trainer; its fault counters are restored too."""
    state = resume_trainer_state(trainer.strategy, trainer.cfg.ckpt, trainer.logger, trainer.cfg, trainer.plan)
    if state is not None:
        trainer.guard.load_state_dict(state.get("faults"))
    return state


def resume_trainer_state(strategy, ckpt_cfg, logger, cfg=None, plan=None) -> dict | None:
    """With ``--ckpt.load_enable`` and a checkpoint in ``ckpt.path``: check ``cfg`` against the
    checkpoint's config (:mod:`rlhforge.trainers.resume`), restore the strategy and RNG, cut
    ``metrics.jsonl`` back to the checkpoint's step and return the trainer state dict. None (after
    one notice line) when there is nothing to resume."""
    from rlhforge.backend.checkpoint import load_checkpoint
    from rlhforge.config.parsing import to_dict
    from rlhforge.trainers.resume import check_resume_config, find_resume_checkpoint, resume_line

    log = print if strategy.is_rank0 else (lambda *_a, **_k: None)
    path = find_resume_checkpoint(ckpt_cfg, strategy.is_rank0, log)
    if path is None:
        if ckpt_cfg.load_enable:  # nothing to resume: a clean start (stale metrics set aside)
            logger.truncate_after(0)
        return None
    if cfg is not None:
        check_resume_config(path, to_dict(cfg), ckpt_cfg.allow_config_change, log)
    state = load_checkpoint(strategy, path)
    logger.truncate_after(int(state["global_step"]))
    if strategy.is_rank0:
        step = int(state["global_step"])
        print(resume_line(path, step, plan.total_steps, plan.steps_per_epoch) if plan is not None
              else f"[rlhforge] resuming from {path}: steps 1-{step} are done")
    return state


def indices_for_step(global_step: int, plan, num_samples: int, seed: int, strategy,
                     shard: tuple[int, int] | None = None) -> tuple[int, int, list[int]]:
    """``(epoch, step in epoch, this rank's sample indices)`` of optimizer step ``global_step`` (deterministic
    per epoch, so a resumed run takes the same samples). ``shard`` = ``(data rank, data ranks)`` when they
    differ from the strategy's (ring attention: the ranks of one ring share a shard)."""
    epoch, step_in_epoch = divmod(global_step, plan.steps_per_epoch)
    order = epoch_order(num_samples, seed, epoch)
    rank, world = shard if shard is not None else (strategy.rank, strategy.world_size)
    return epoch, step_in_epoch, step_indices(order, step_in_epoch, plan.batch_size, rank, world)


def batch_record(global_step: int, plan, num_samples: int, seed: int) -> dict:
    """Which samples optimizer step ``global_step`` (0-based) trained on, over all ranks: its epoch, its
    position in the epoch and the indices into the training samples (``skipped_steps.jsonl``)."""
    epoch, step_in_epoch = divmod(global_step, plan.steps_per_epoch)
    order = epoch_order(num_samples, seed, epoch)
    batch = order[step_in_epoch * plan.batch_size : (step_in_epoch + 1) * plan.batch_size]
    return {"epoch": epoch, "step_in_epoch": step_in_epoch, "sample_indices": list(batch)}


def step_timing(metrics: dict, epoch: int, step_in_epoch: int, steps_per_epoch: int, elapsed: float,
                per_s: Sequence[str] = ("tokens",)) -> dict[str, float]:
    """``train/epoch``, ``timing/step`` and ``perf/{x}_per_s`` for each ``train/{x}`` count in ``per_s``."""
    out = {"train/epoch": epoch + (step_in_epoch + 1) / steps_per_epoch, "timing/step": elapsed}
    out.update({f"perf/{x}_per_s": metrics[f"train/{x}"] / elapsed for x in per_s})
    return out


def supervised_loop(trainer, *, desc: str, shard, per_s: tuple[str, ...], eval_at_last_step: bool,
                    bar_fields: Callable[[dict], dict], finish: Callable[[], None]) -> None:
    """The optimizer-step loop SFT, RM, DPO and KTO share, top to bottom, under the trainer's fault guard:
    this step's indices (``shard``: the rank's data shard), ``trainer.train_step``, the guard's record, timing
    (``per_s``: the counts turned into rates), evaluation (every ``--eval.steps``, each epoch end and, with
    ``eval_at_last_step``, the last step), logging, the progress bar (``desc``; ``bar_fields(metrics)``),
    checkpoints and the guard's after-step work; then ``finish()`` (the trainer's final checkpoint and export)."""
    from rlhforge.tracking.progress import Progress, progress_enabled

    cfg, strategy, plan, state = trainer.cfg, trainer.strategy, trainer.plan, trainer.state
    bar = Progress(plan.total_steps, state.global_step,
                   enabled=progress_enabled(cfg.logger.progress_bar, strategy.is_rank0), desc=desc)
    strategy.train()
    with trainer.guard:
        _steps(trainer, bar, shard, per_s, eval_at_last_step, bar_fields)
        finish()


def _steps(trainer, bar, shard, per_s, eval_at_last_step, bar_fields) -> None:
    import time

    from rlhforge.backend.device import peak_memory_bytes

    cfg, strategy, plan, state = trainer.cfg, trainer.strategy, trainer.plan, trainer.state
    num_samples = len(trainer.train_samples)
    while state.global_step < plan.total_steps:
        epoch, step_in_epoch, indices = indices_for_step(state.global_step, plan, num_samples, cfg.train.seed,
                                                         strategy, shard=shard)
        start = time.perf_counter()
        metrics = trainer.train_step(indices)
        state.global_step += 1
        step = state.global_step
        trainer.guard.record(step, trainer.step_skipped, grad_norm=metrics["train/grad_norm"],
                             batch=lambda: batch_record(step - 1, plan, num_samples, cfg.train.seed))
        metrics.update(trainer.guard.metrics())
        metrics.update(step_timing(metrics, epoch, step_in_epoch, plan.steps_per_epoch, time.perf_counter() - start,
                                   per_s=per_s))
        if is_eval_step(step, plan.steps_per_epoch, cfg.eval.steps, plan.total_steps if eval_at_last_step else None):
            metrics.update(trainer.evaluate())
        if step % cfg.logger.logging_steps == 0 or step == plan.total_steps:
            metrics["perf/peak_memory_gb"] = peak_memory_bytes(strategy.device) / 2**30
            trainer.logger.log(step, metrics)
        bar.update(1, **bar_fields(metrics), lr=metrics["train/lr"])
        if cfg.ckpt.save_steps > 0 and step % cfg.ckpt.save_steps == 0 and step < plan.total_steps:
            trainer.save_checkpoint()
        trainer.guard.after_step(step, trainer.save_checkpoint)
    trainer.guard.finished()
    bar.close()
