"""``--deadline.*``: the one flag family of every wait a run makes (docs/reliability.md, "Deadlines").

Three deadlines live here; five more kept their older names and answer to ``--deadline.*`` aliases
(:data:`DEADLINE_ALIASES`), so every wait is set from this one family:

| flag | the wait | on expiry |
| --- | --- | --- |
| ``--deadline.collective_s`` | every collective of the training groups (gloo's timeout; NCCL's watchdog) | the rank raises, the driver names it (WorkerError, exit 4) |
| ``--deadline.worker_call_s`` | the driver's wait on any call of a model group (a step, log-probs, a save) | WorkerError naming the ranks that gave no answer, exit 4 |
| ``--deadline.startup_s`` | placement groups, each model group's load, each engine's start | WorkerError naming what did not start, exit 4 |
| ``--deadline.engine_request_s`` = ``--vllm.request_timeout_s`` | one generate call of an engine actor | the engine is restarted (``--vllm.max_restarts``) |
| ``--deadline.weight_sync_s`` = ``--vllm.sync_timeout_s`` | every weight-sync collective and engine RPC | the engine is restarted, the group rebuilt |
| ``--deadline.reward_s`` = ``--reward.timeout`` | one HTTP reward request | retried (``--reward.retries``), then RewardServerError, exit 3 |
| ``--deadline.env_step_s`` = ``--train.agent_step_timeout`` | one environment step | counted, the sample dropped |
| ``--deadline.env_episode_s`` = ``--train.agent_episode_timeout`` | one whole episode | counted, the sample dropped |
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from rlhforge.config.parsing import ConfigError
from rlhforge.config.aliases import DEADLINE_ALIASES  # noqa: F401 (re-exported: the tables live in config/aliases.py)

__all__ = ["DeadlineConfig", "DEADLINE_ALIASES", "check_deadlines", "COLLECTIVE_TIMEOUT_ENV", "collective_timeout_s"]

#: the environment variable that carries ``--deadline.collective_s`` into every rank (Ray workers, torchrun)
COLLECTIVE_TIMEOUT_ENV = "RLHFORGE_COLLECTIVE_TIMEOUT_S"


@dataclass(frozen=True)
class DeadlineConfig:
    collective_s: float = 1800.0
    """Timeout of every collective of the training process groups (each model group's default group,
    DeepSpeed's and FSDP2's): gloo's timeout, NCCL's watchdog. A rank whose peer died or hung raises
    instead of waiting for ever. rlhforge-specific (torch's defaults: 10 min NCCL, 30 min gloo)."""
    worker_call_s: float = 7200.0
    """The driver's wait on any call of a model group (a training step, log-probs, a gather, a save):
    ranks with no answer by then are named and the run stops (exit 4; checkpoints already written are
    intact). Longer than ``collective_s``, so a hung collective is reported by its rank first."""
    startup_s: float = 1800.0
    """Placement groups, each model group's load and each engine's start-up."""


def check_deadlines(d: DeadlineConfig) -> None:
    for name in ("collective_s", "worker_call_s", "startup_s"):
        value = getattr(d, name)
        if not 0 < value < float("inf"):
            raise ConfigError(f"--deadline.{name} must be a number of seconds > 0 (got {value})")


def collective_timeout_s(default: float | None = None) -> float | None:
    """``--deadline.collective_s`` as the launcher passed it (None: torch's default)."""
    raw = os.environ.get(COLLECTIVE_TIMEOUT_ENV)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{COLLECTIVE_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ConfigError(f"{COLLECTIVE_TIMEOUT_ENV} must be > 0 (got {raw})")
    return value
