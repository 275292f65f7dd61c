"""How a training run ends when something outside the step goes wrong (docs/reliability.md).

:class:`RunGuard` wraps a trainer's loop (SFT, RM, DPO, RL; in the RL driver for Ray runs too):

- **Preemption.** SIGTERM or SIGINT sets a flag; at the next step boundary (all ranks agree on it)
  the trainer saves a checkpoint and the run exits with 143 (SIGTERM) or 130 (SIGINT), the shell's
  codes for those signals. ``--train.preempt_grace_s`` bounds the wait for the step to end: when it
  runs out, the process exits at once, with the same code and without saving (the last good
  checkpoint stays the latest; a killed save leaves only a ``step_N.tmp`` that the next resume
  removes). A second signal exits at once as well. Without the guard (start-up, loading) a signal
  has its default effect.
- **Non-finite steps.** The strategies skip a step whose loss or gradient norm is not finite
  (:mod:`rlhforge.backend.guards`); :meth:`RunGuard.record` counts it (``train/skipped_steps``),
  writes the batch to ``skipped_steps.jsonl`` in the run directory and, after
  ``--train.max_skipped_steps_in_row`` skipped optimizer steps in a row, stops the run with exit
  code 5, naming the last good checkpoint.
- **Checkpoint write failures** (:class:`~rlhforge.backend.checkpoint.CheckpointWriteError`) end
  the run with exit code 6 and the message naming the folder and the cause.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import torch

from rlhforge.backend.checkpoint import CheckpointWriteError, latest_checkpoint

__all__ = ["RunGuard", "RunStop", "Preempted", "NonFiniteStop", "EXIT_SIGTERM", "EXIT_SIGINT", "EXIT_NONFINITE",
           "EXIT_CKPT_WRITE", "SKIPPED_FILE"]

EXIT_SIGTERM, EXIT_SIGINT, EXIT_NONFINITE, EXIT_CKPT_WRITE = 143, 130, 5, 6
SKIPPED_FILE = "skipped_steps.jsonl"
_CODES = {signal.SIGTERM: EXIT_SIGTERM, signal.SIGINT: EXIT_SIGINT}


class RunStop(SystemExit):
    """The run ends with a documented exit code (``code``); ``message`` was printed on rank 0."""

    def __init__(self, code: int, message: str):
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return self.message


class Preempted(RunStop):
    """SIGTERM / SIGINT: a checkpoint was saved at the step boundary (exit 143 / 130)."""


class NonFiniteStop(RunStop):
    """Too many non-finite steps in a row (exit 5)."""


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _say_raw(text: str) -> None:
    """One line to file descriptor 2 without Python's buffered streams (safe in a signal handler,
    which may interrupt a print, and from the grace timer's thread)."""
    os.write(2, (text.rstrip("\n") + "\n").encode())


class RunGuard:
    """Preemption signals, non-finite-step accounting and checkpoint-write errors of one run.

    ``with guard:`` around the loop; :meth:`record` after each optimizer step's result;
    :meth:`after_step` at each step boundary (after logging and any periodic save). ``agree``
    (``all_reduce(tensor, op="max")`` of a multi-rank strategy, None for one process) makes all
    ranks stop at the same boundary."""

    def __init__(self, *, grace_s: float, max_skipped_in_row: int, run_dir: str | Path, ckpt_path: str | Path,
                 is_rank0: bool = True, agree: Callable | None = None, device=None):
        self.grace_s, self.max_in_row = float(grace_s), int(max_skipped_in_row)
        self.run_dir, self.ckpt_path = Path(run_dir), Path(ckpt_path)
        self.is_rank0, self.agree, self.device = is_rank0, agree, device
        self.signum: int | None = None
        self.skipped_total = 0
        self.in_row: dict[str, int] = {}
        self._stop_message: str | None = None
        self._timer: threading.Timer | None = None
        self._finishing = False  # past the last step (final checkpoint and export)
        self._previous: dict[int, Any] = {}

    # ------------------------------------------------------------------------------ context
    def __enter__(self) -> "RunGuard":
        if threading.current_thread() is threading.main_thread():
            for sig in _CODES:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self._cancel_timer()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if isinstance(exc, CheckpointWriteError):
            message = f"[rlhforge] error: {exc}"
            if self.is_rank0:
                _say(message)
            raise RunStop(EXIT_CKPT_WRITE, message) from exc
        return False

    # ------------------------------------------------------------------------------ signals
    def _on_signal(self, signum, _frame) -> None:
        name, code = signal.Signals(signum).name, _CODES[signum]
        if self.signum is not None:
            _say_raw(f"[rlhforge] second signal ({name}): exiting now without saving; {self.last_good()}")
            os._exit(code)
        self.signum = signum
        if self._finishing:
            _say_raw(f"[rlhforge] {name} received after the last step: finishing the final save and export first "
                 "(a second signal exits at once)")
            return
        wait = f"up to --train.preempt_grace_s {self.grace_s:g}s" if self.grace_s > 0 else "however long it takes"
        _say_raw(f"[rlhforge] {name} received: finishing this step ({wait}), then saving a checkpoint and exiting "
             f"with {code}; a second signal exits at once")
        if self.grace_s > 0:
            self._timer = threading.Timer(self.grace_s, self._expired, args=(signum,))
            self._timer.daemon = True
            self._timer.start()

    def _expired(self, signum: int) -> None:
        _say_raw(f"[rlhforge] the step did not end within --train.preempt_grace_s {self.grace_s:g}s of "
             f"{signal.Signals(signum).name}: exiting without saving; {self.last_good()}")
        os._exit(_CODES[signum])

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _agreed_signal(self) -> int:
        sig = float(self.signum or 0)
        if self.agree is not None:
            sig = float(self.agree(torch.tensor(sig, device=self.device), op="max"))
        return int(sig)

    # ------------------------------------------------------------------------------ non-finite steps
    def record(self, step: int, skipped: bool, model: str = "train", batch: Callable[[], dict] | None = None,
               grad_norm: float | None = None) -> None:
        """One optimizer step's outcome. ``batch()`` (called only for a skipped step) describes its
        samples for ``skipped_steps.jsonl``."""
        if not skipped:
            self.in_row[model] = 0
            return
        self.skipped_total += 1
        row = self.in_row[model] = self.in_row.get(model, 0) + 1
        if self.is_rank0:
            entry = {"step": step, "model": model, "grad_norm": str(grad_norm), **(batch() if batch else {})}
            with open(self.run_dir / SKIPPED_FILE, "a") as f:
                f.write(json.dumps(entry, default=str) + "\n")
            _say(f"[rlhforge] warning: step {step}{'' if model == 'train' else f' ({model})'}: non-finite loss or "
                 f"gradient norm ({grad_norm}); optimizer step skipped ({row} in a row, {self.skipped_total} in total; "
                 f"batch in {self.run_dir / SKIPPED_FILE})")
        if self.max_in_row > 0 and row >= self.max_in_row and self._stop_message is None:
            self._stop_message = (
                f"[rlhforge] error: {row} optimizer steps in a row had a non-finite loss or gradient norm (up to step "
                f"{step}{'' if model == 'train' else f', {model}'}; --train.max_skipped_steps_in_row "
                f"{self.max_in_row}); stopping. L<LAST_GOOD>; the skipped batches are in {self.run_dir / SKIPPED_FILE}")

    def metrics(self) -> dict[str, float]:
        return {"train/skipped_steps": float(self.skipped_total)}

    def state_dict(self) -> dict:
        return {"skipped_steps": self.skipped_total, "skipped_in_row": dict(self.in_row)}

    def load_state_dict(self, state: dict | None) -> None:
        state = state or {}
        self.skipped_total = int(state.get("skipped_steps", 0))
        self.in_row = {str(k): int(v) for k, v in (state.get("skipped_in_row") or {}).items()}

    # ------------------------------------------------------------------------------ boundaries
    def last_good(self) -> str:
        path = latest_checkpoint(self.ckpt_path)
        return f"last good checkpoint: {path} (resume with --ckpt.load_enable)" if path is not None else \
            f"last good checkpoint: none in {self.ckpt_path}"

    def after_step(self, step: int, save: Callable[[], Path | None]) -> None:
        """At a step boundary: stop for too many non-finite steps, or for a signal (saving first,
        unless this step's checkpoint is already the latest)."""
        if self._stop_message is not None:
            message = self._stop_message.replace("<LAST_GOOD>", self.last_good()[1:])
            if self.is_rank0:
                _say(message)
            raise NonFiniteStop(EXIT_NONFINITE, message)
        sig = self._agreed_signal()
        if not sig:
            return
        self._cancel_timer()
        latest = latest_checkpoint(self.ckpt_path)
        path = latest if latest is not None and latest.name == f"step_{step}" else save()
        name, code = signal.Signals(sig).name, _CODES[sig]
        resumable = path is not None and (Path(path) / "trainer_state.json").is_file()
        where = f"saved {path}" if path is not None else "nothing saved"
        if not resumable:
            where += " (no resumable state: --ckpt.disable_ds)"
        message = f"[rlhforge] preempted by {name} after step {step}: {where}; exiting with {code}"
        if self.is_rank0:
            _say(message + (" (resume with --ckpt.load_enable)" if resumable else ""))
        raise Preempted(code, message)

    def finished(self) -> None:
        """The loop ran to its end: a signal that came during the last step needs no stop, and one that
        comes during the final save and export does not interrupt them."""
        self._finishing = True
        self._cancel_timer()


def guard_for(cfg, strategy) -> RunGuard:
    """The guard of an SFT / RM / DPO run (``cfg.train``, ``cfg.ckpt``; ranks agree through the strategy)."""
    multi = strategy.world_size > 1
    return RunGuard(grace_s=cfg.train.preempt_grace_s, max_skipped_in_row=cfg.train.max_skipped_steps_in_row,
                    run_dir=cfg.ckpt.output_dir, ckpt_path=cfg.ckpt.checkpoint_dir, is_rank0=strategy.is_rank0,
                    agree=strategy.all_reduce if multi else None, device=strategy.device)
