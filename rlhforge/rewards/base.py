"""Reward sources behind one interface, and the checks every reward goes through.

A reward source is called once per batch of finished responses::

    out = await source(batch)            # batch: RewardBatch; out: RewardOutput

and must return one finite ``reward`` per sample (the RL signal), optionally a ``score`` in
[0, 1] per sample (used for dynamic filtering and pass@k; defaults to the reward) and
``extra_logs`` (name -> one number per sample, logged as ``rollout/<name>`` means).
:func:`check_reward_output` turns every way a source can misbehave (exception, wrong length,
NaN/inf, non-numbers) into a :class:`RewardError` that names the source and the first bad sample,
so a failing reward stops the run with a clear message instead of training on garbage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

__all__ = ["RewardBatch", "RewardOutput", "RewardError", "RewardSource", "check_reward_output"]


class RewardError(RuntimeError):
    """A reward source failed or returned something unusable; the message names it and the sample."""


@dataclass
class RewardBatch:
    """What a reward source sees for ``B`` samples (texts are decoded once, for the source only)."""

    queries: list[str]
    """Prompt + response text (OpenRLHF's ``queries``)."""
    prompts: list[str]
    """Prompt text."""
    responses: list[str]
    """Response text (special tokens removed)."""
    labels: list[Any]
    """Labels from ``data.label_key`` (None when unset)."""
    datasources: list[str | None]
    """The records' datasource (``data.datasource_key``), for routing."""
    prompt_ids: list[list[int]] = field(default_factory=list)
    response_ids: list[list[int]] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.queries)


@dataclass
class RewardOutput:
    rewards: list[float]
    scores: list[float]
    extra_logs: dict[str, list[float]] = field(default_factory=dict)


class RewardSource(Protocol):
    name: str
    """Shown in error messages (e.g. ``reward_func in rewards/math.py``)."""

    async def __call__(self, batch: RewardBatch) -> RewardOutput: ...


def _sample_hint(batch: RewardBatch, i: int) -> str:
    text = batch.queries[i] if i < len(batch.queries) else ""
    text = text if len(text) <= 160 else text[:80] + " ... " + text[-60:]
    return f"sample {i} (prompt+response {text!r}, label {batch.labels[i] if i < len(batch.labels) else None!r})"


def _as_floats(name: str, what: str, values: Any, batch: RewardBatch, *, finite: bool = True) -> list[float]:
    if hasattr(values, "tolist"):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardError(f"{name} returned {what} of type {type(values).__name__}; expected a list of {len(batch)} numbers")
    if len(values) != len(batch):
        raise RewardError(f"{name} returned {len(values)} {what} for {len(batch)} samples")
    out = []
    for i, v in enumerate(values):
        if hasattr(v, "item"):
            v = v.item()
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise RewardError(f"{name} returned {what}[{i}] = {v!r} (not a number) for {_sample_hint(batch, i)}")
        if finite and not math.isfinite(v):
            raise RewardError(f"{name} returned {what}[{i}] = {v} for {_sample_hint(batch, i)}")
        out.append(float(v))
    return out


_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        print(message, flush=True)


def check_reward_output(name: str, raw: Any, batch: RewardBatch) -> RewardOutput:
    """Normalise what a source returned (a dict ``{"rewards", "scores", "extra_logs"}``, a
    :class:`RewardOutput` or a plain list of rewards) and check it; raises :class:`RewardError`."""
    if isinstance(raw, RewardOutput):
        raw = {"rewards": raw.rewards, "scores": raw.scores, "extra_logs": raw.extra_logs}
    if raw is None:
        raise RewardError(f"{name} returned None; expected {{'rewards': [...], 'scores': [...], 'extra_logs': {{...}}}}")
    if not isinstance(raw, dict):
        raw = {"rewards": raw}
    if "rewards" not in raw:
        raise RewardError(f"{name} returned a dict without 'rewards' (keys: {sorted(raw)})")
    rewards = _as_floats(name, "rewards", raw["rewards"], batch)
    scores = rewards if raw.get("scores") is None else _as_floats(name, "scores", raw["scores"], batch)
    extra: dict[str, list[float]] = {}
    for key, values in (raw.get("extra_logs") or {}).items():
        if hasattr(values, "tolist"):
            values = values.tolist()
        if isinstance(values, (int, float)):
            values = [float(values)] * len(batch)
        try:  # NaN/inf are kept: the metrics logger writes them (as null) and warns
            extra[str(key)] = _as_floats(name, f"extra_logs[{key!r}]", values, batch, finite=False)
        except RewardError as err:  # informational: a malformed one is dropped with a warning, not fatal
            _warn_once(f"extra_logs[{key!r}]", f"[rlhforge] warning: {err}; that metric is not logged")
    return RewardOutput(rewards, scores, extra)


async def call_source(source: RewardSource, batch: RewardBatch) -> RewardOutput:
    """Call ``source`` and check its output; any exception becomes a RewardError naming the source."""
    try:
        raw = await source(batch)
    except RewardError:
        raise
    except Exception as err:  # noqa: BLE001 - any failure of user code stops the run, with context
        raise RewardError(f"{source.name} raised {type(err).__name__}: {err} (batch of {len(batch)} samples; "
                          f"first: {_sample_hint(batch, 0) if len(batch) else 'none'})") from err
    return check_reward_output(source.name, raw, batch)


def per_sample_lists(seq: Sequence[Any], n: int) -> list[Any]:
    return list(seq) if seq is not None else [None] * n
