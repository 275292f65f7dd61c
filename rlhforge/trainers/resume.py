"""Which checkpoint a ``--ckpt.load_enable`` run resumes from, and whether its config allows an
exact resume (docs/reliability.md, "Resume edge cases").

- A missing or empty ``ckpt.path`` (or one holding only interrupted ``step_N.tmp`` saves) starts
  from scratch with one notice line; leftovers of interrupted saves are removed first.
- The checkpoint keeps the run's resolved config (``config.json``). Every setting that differs
  from it is printed; the ones that change which samples each step sees or the step arithmetic
  (:data:`EXACT_RESUME_KEYS`: data, global batch sizes, seed, epochs / steps / episodes, the models
  trained from) are refused with a :class:`ConfigError` (exit 2) listing them, unless
  ``--ckpt.allow_config_change``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rlhforge.backend.checkpoint import CONFIG_FILE, checkpoint_config, latest_checkpoint, remove_partial_saves
from rlhforge.config.parsing import ConfigError
from rlhforge.config.paths import absolute_value

__all__ = ["EXACT_RESUME_KEYS", "config_changes", "check_resume_config", "find_resume_checkpoint"]

#: dotted keys (``x.`` = every key under ``x``) whose change breaks exact resumption
EXACT_RESUME_KEYS = (
    "data.", "train.seed", "train.batch_size", "train.max_epochs", "train.max_steps", "train.num_episodes",
    "rollout.batch_size", "rollout.n_samples_per_prompt", "eval.holdout_ratio",
    "model.model_name_or_path", "actor.model_name_or_path", "critic.model_name_or_path", "ref.model_name_or_path",
    "reward.model_name_or_path",
)
_EXACT_EXEMPT = {"data.dataloader_num_workers"}  # no effect (data is tokenised once)
_NOT_COMPARED = {"ckpt.load_enable", "ckpt.allow_config_change", "logger.wandb.key"}


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _breaks_exact(key: str) -> bool:
    if key in _EXACT_EXEMPT:
        return False
    return any(key.startswith(k) if k.endswith(".") else key == k for k in EXACT_RESUME_KEYS)


def config_changes(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
    """``(dotted key, checkpoint's value, current value)`` for every setting that differs. Model and
    data paths are compared in their absolute form (:func:`rlhforge.config.paths.absolute_value`): the
    RL driver makes local paths absolute, so ``runs/sft`` saved by an older run equals ``/abs/runs/sft``."""
    saved = _flatten(json.loads(json.dumps(saved, default=str)))
    current = _flatten(json.loads(json.dumps(current, default=str)))
    keys = sorted(set(saved) & set(current))  # a field only one side knows (another version) is not compared
    return [(k, saved[k], current[k]) for k in keys
            if k not in _NOT_COMPARED and absolute_value(k, saved[k]) != absolute_value(k, current[k])]


def _fmt(changes) -> str:
    return "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changes)


def check_resume_config(path: Path, current: dict, allow: bool, log=print) -> None:
    """Compare ``current`` (``to_dict(cfg)``) with the checkpoint's config; print the differences;
    raise :class:`ConfigError` for the ones in :data:`EXACT_RESUME_KEYS` unless ``allow``."""
    saved = checkpoint_config(path)
    if saved is None:
        return  # a checkpoint from before config.json was kept
    changes = config_changes(saved, current)
    if not changes:
        return
    breaking = [c for c in changes if _breaks_exact(c[0])]
    log(f"[rlhforge] resume: {len(changes)} setting(s) differ from {path / CONFIG_FILE}: {_fmt(changes)}")
    if breaking and not allow:
        raise ConfigError(
            f"resume from {path}: {len(breaking)} change(s) would break exact resumption (the resumed run would not "
            f"continue the same curve): {_fmt(breaking)}; undo them, or pass --ckpt.allow_config_change to resume "
            "anyway")
    if breaking:
        log(f"[rlhforge] resume: --ckpt.allow_config_change: resuming with {', '.join(c[0] for c in breaking)} "
            "changed; the curve will not match an uninterrupted run")


def find_resume_checkpoint(ckpt_cfg, is_rank0: bool = True, log=print) -> Path | None:
    """The checkpoint to resume from (None: start fresh, after one notice line). Rank 0 removes the
    leftovers of interrupted saves first."""
    if not ckpt_cfg.load_enable:
        return None
    root = Path(ckpt_cfg.checkpoint_dir)
    removed = remove_partial_saves(root) if is_rank0 else []
    path = latest_checkpoint(root)
    if path is None and is_rank0:
        why = "does not exist" if not root.exists() else "holds no complete checkpoint (step_N/trainer_state.json)"
        extra = f"; removed interrupted save(s) {', '.join(removed)}" if removed else ""
        log(f"[rlhforge] --ckpt.load_enable: {root} {why}{extra}; starting from step 0")
    elif removed:
        log(f"[rlhforge] resume: removed interrupted save(s) {', '.join(removed)} in {root}")
    return path


def resume_line(path: Path, step: int, total_steps: int, steps_per_epoch: int | None = None,
                details: str = "") -> str:
    """The one line a resumed run prints: what it continues from and what is left (or that nothing is)."""
    if step >= total_steps:
        return (f"[rlhforge] resume: {path} is the run's last step ({step} of {total_steps}): nothing left to train; "
                "the final model is exported again (raise the step count, with --ckpt.allow_config_change, to train on)")
    where = ""
    if steps_per_epoch:
        epoch, k = divmod(step, steps_per_epoch)
        where = f" (epoch {epoch + 1}, step {k + 1} of {steps_per_epoch} in it)"
    done = f"step 1 of {total_steps} is" if step == 1 else f"steps 1-{step} of {total_steps} are"
    return (f"[rlhforge] resuming from {path}: {done} done; next is step {step + 1}{where}"
            + (f"; {details}" if details else ""))
