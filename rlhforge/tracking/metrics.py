"""Metrics sinks: ``metrics.jsonl`` in the run directory always; TensorBoard and W&B on request.

Only rank 0 writes. Each line is ``{"step": N, "name": value, ...}``. On resume from step N the file
keeps lines up to N and moves later ones (from the interrupted run) to ``metrics.discarded.jsonl``,
so the curve continues without duplicates and nothing is lost.

A non-finite value (NaN, inf: e.g. a reward function's ``extra_logs``) is kept, never dropped: JSON
has no NaN, so ``metrics.jsonl`` holds the string ``"nan"`` / ``"inf"`` / ``"-inf"``, TensorBoard
and W&B get the float; the first time a metric is non-finite one warning names it.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any


def _number(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else value


def _plain(value: Any) -> Any:
    """A JSON-safe value: non-finite floats as the strings ``nan`` / ``inf`` / ``-inf``."""
    value = _number(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _nonfinite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


class MetricsLogger:
    def __init__(self, run_dir: str | Path, logger_cfg=None, *, enabled: bool = True, config: dict | None = None):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb = None
        self._wandb = None
        self._warned: set[str] = set()  # metrics already reported as non-finite
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if logger_cfg is not None and logger_cfg.tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(logger_cfg.tensorboard_dir)
        if logger_cfg is not None and logger_cfg.wandb.key:
            try:
                import wandb
            except ImportError as err:
                raise ImportError("--logger.wandb.key needs W&B: pip install 'rlhforge[wandb]'") from err
            w = logger_cfg.wandb
            if w.key != "env":
                wandb.login(key=w.key)
            self._wandb = wandb.init(
                project=w.project, entity=w.org, group=w.group,
                name=w.run_name or Path(run_dir).resolve().name, config=config, reinit=True,
            )

    def truncate_after(self, step: int) -> None:
        """Resume: keep lines with ``step <= step``; move the rest to metrics.discarded.jsonl."""
        if not self.enabled or not self.path.is_file():
            return
        keep, drop = [], []
        for line in self.path.read_text().splitlines():
            try:
                record_step = json.loads(line).get("step", 0)
            except json.JSONDecodeError:
                drop.append(line)
                continue
            (keep if record_step <= step else drop).append(line)
        if drop:
            with open(self.path.with_name("metrics.discarded.jsonl"), "a") as f:
                f.write("\n".join(drop) + "\n")
        tmp = self.path.with_suffix(".jsonl.tmp")
        try:
            tmp.write_text("".join(line + "\n" for line in keep))
            tmp.replace(self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        numbers = {k: _number(v) for k, v in metrics.items()}
        self._warn_nonfinite(step, numbers)
        record = {"step": step, "time": round(time.time(), 3), **{k: _plain(v) for k, v in numbers.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self._tb is not None:
            for key, value in numbers.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({"time": record["time"], **numbers}, step=step)

    def _warn_nonfinite(self, step: int, numbers: dict[str, Any]) -> None:
        new = sorted(k for k, v in numbers.items() if _nonfinite(v) and k not in self._warned)
        if not new:
            return
        self._warned.update(new)
        names = ", ".join(f"{k} = {numbers[k]}" for k in new)
        print(f"[rlhforge] warning: step {step}: non-finite metric(s) {names}; written as the string \"nan\"/\"inf\" "
              f"in {self.path} (warned once per metric)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
