"""The RL trainer's state, checkpoints, resume and fault handling (a mixin of
:class:`~rlhforge.trainers.rl.RLTrainer`, kept apart so the loop stays one readable file).

The driver is the single controller: it saves and loads through the worker groups (in this
process or Ray actors), so a signal to the driver checkpoints a Ray run as well
(:mod:`rlhforge.trainers.faults`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from rlhforge.backend.checkpoint import load_checkpoint, save_checkpoint
from rlhforge.config.parsing import to_dict
from rlhforge.distributed.groups import GroupCheckpoint
from rlhforge.trainers.faults import RunGuard
from rlhforge.trainers.resume import check_resume_config, find_resume_checkpoint, resume_line

__all__ = ["RLState", "RLCheckpointing", "rl_guard"]


@dataclass
class RLState:
    global_step: int = 0
    prompt_position: int = 0
    kl_controller: dict = field(default_factory=dict)
    best_metric: float | None = None
    best_step: int | None = None
    buffered_positions: list = field(default_factory=list)
    """Stream positions of prompt groups generated but not trained yet (oversampling; prompts.GroupBuffer)."""

    def as_dict(self) -> dict:
        return {"global_step": self.global_step, "prompt_position": self.prompt_position,
                "kl_controller": self.kl_controller, "best_metric": self.best_metric, "best_step": self.best_step,
                "buffered_positions": list(self.buffered_positions)}


def rl_guard(cfg) -> RunGuard:
    return RunGuard(grace_s=cfg.train.preempt_grace_s, max_skipped_in_row=cfg.train.max_skipped_steps_in_row,
                    run_dir=cfg.ckpt.output_dir, ckpt_path=cfg.ckpt.checkpoint_dir)


class RLCheckpointing:
    """Checkpoint, resume and per-update fault accounting of the RL trainer (needs ``cfg``, ``state``,
    ``actor``, ``critic``, ``kl_ctl``, ``stream``, ``logger``, ``tokenizer`` and ``guard``)."""

    def _ckpt_strategies(self) -> GroupCheckpoint:
        return GroupCheckpoint(self.actor, self.critic)

    def save_checkpoint(self) -> Path:
        cfg = self.cfg
        self.state.kl_controller = self.kl_ctl.state_dict()
        protected = (f"step_{self.state.best_step}",) if self.state.best_step is not None else ()
        export = (lambda d: self.actor.call("save_hf", d)) if cfg.ckpt.save_hf else None
        state = {**self.state.as_dict(), "faults": self.guard.state_dict()}
        path = save_checkpoint(self._ckpt_strategies(), cfg.ckpt.checkpoint_dir, self.state.global_step, state,
                               max_num=cfg.ckpt.max_num, protected=protected, export_hf=export,
                               max_mem_gb=cfg.ckpt.max_mem, config=to_dict(cfg))
        if self.state.best_step is not None:
            (Path(cfg.ckpt.checkpoint_dir) / "best").write_text(json.dumps(
                {"checkpoint": f"step_{self.state.best_step}", "metric": cfg.ckpt.best_metric_key or "eval/pass1",
                 "value": self.state.best_metric}))
        return path

    def _preempt_save(self) -> Path | None:
        """The checkpoint a signal asks for (none with ``--ckpt.disable_ds``)."""
        return None if self.cfg.ckpt.disable_ds else self.save_checkpoint()

    def _maybe_resume(self) -> None:
        path = find_resume_checkpoint(self.cfg.ckpt)
        if path is None:
            if self.cfg.ckpt.load_enable:  # nothing to resume: a clean start (stale metrics set aside)
                self.logger.truncate_after(0)
            return
        check_resume_config(path, to_dict(self.cfg), self.cfg.ckpt.allow_config_change)
        state = load_checkpoint(self._ckpt_strategies(), path)
        self.state = RLState(global_step=int(state["global_step"]), prompt_position=int(state["prompt_position"]),
                             kl_controller=state.get("kl_controller") or {}, best_metric=state.get("best_metric"),
                             best_step=state.get("best_step"),
                             buffered_positions=[int(p) for p in state.get("buffered_positions", [])])
        self.guard.load_state_dict(state.get("faults"))
        if self.state.kl_controller:
            self.kl_ctl.load_state_dict(self.state.kl_controller)
        self.stream.position = self.state.prompt_position
        self.rollout_buffer.pending = list(self.state.buffered_positions)  # generated again first (prompts.py)
        self.logger.truncate_after(self.state.global_step)
        print(resume_line(path, self.state.global_step, self.plan.total_steps, details=self._resume_details()))

    def _resume_details(self) -> str:
        """Where the prompt stream continues, what is generated again, and what async changes."""
        n, pos = max(len(self.prompts), 1), self.state.prompt_position
        parts = [f"prompts continue at stream position {pos} (episode {pos // n + 1}, prompt {pos % n + 1} of {n})"]
        if self.state.buffered_positions:
            parts.append(f"{len(self.state.buffered_positions)} prompt group(s) generated before the checkpoint but not "
                         "trained (oversampling) are generated again first")
        if self.cfg.train.async_enable:
            parts.append("async: batches the old run had queued past this step are generated again from here with "
                         "this step's weights (same prompts and seeds; an uninterrupted run generated them with "
                         "older weights, so the curve continues but is not bit-identical)")
        return "; ".join(parts)

    # -- one optimizer step's result -------------------------------------------------------------
    def _add_update(self, sums: dict[str, list[float]], model: str, results: list[dict], chunk) -> None:
        """Metrics of one ``map_train`` (rank 0's: reduced, equal on every rank) into ``sums``; a skipped
        (non-finite) update is counted by the guard, which logs the chunk's prompts."""
        stats = dict(results[0])
        skipped = bool(stats.pop("skipped", 0.0))
        self.guard.record(self.state.global_step + 1, skipped, model=model, grad_norm=stats.get("grad_norm"),
                          batch=lambda: {"samples": [self._describe(s) for s in chunk]})
        for k, v in stats.items():
            sums.setdefault(f"{model}/{k}", []).append(v)

    def _describe(self, sample) -> dict:
        first = next((i for i, m in enumerate(sample.loss_mask) if m), len(sample.input_ids))
        return {"prompt": self.tokenizer.decode(sample.input_ids[:first], skip_special_tokens=False),
                "reward": sample.reward, "tokens": len(sample.input_ids)}
