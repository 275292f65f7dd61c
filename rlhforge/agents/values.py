"""What user code hands back, made safe: numbers (floats, 1-element tensors or lists), metric dicts,
and sampling parameters (rlhforge's, vLLM-shaped ones, or dicts) merged into the current ones."""

from __future__ import annotations

import math
from dataclasses import fields, replace
from typing import Any

from rlhforge.agents.types import AgentError
from rlhforge.rollout.engine import SamplingParams

__all__ = ["to_float", "merge_sampling", "_float_logs"]


def to_float(value: Any, what: str, *, finite: bool = True) -> float:
    if hasattr(value, "numel") and hasattr(value, "item"):
        if value.numel() != 1:
            raise AgentError(f"{what} is a tensor with {value.numel()} elements; expected one number")
        value = value.item()
    elif isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AgentError(f"{what} = {value!r} is not a number")
    if finite and not math.isfinite(value):
        raise AgentError(f"{what} = {value} is not finite")
    return float(value)


_SP_FIELDS = {f.name for f in fields(SamplingParams)}


def merge_sampling(current: SamplingParams, new: Any) -> SamplingParams:
    """The environment's ``sampling_params`` applied to ``current`` (seed is always kept)."""
    if new is None:
        return current
    if isinstance(new, SamplingParams):
        return replace(new, seed=current.seed)
    if hasattr(new, "max_tokens") and not isinstance(new, dict):  # a vLLM(-shaped) SamplingParams
        new = {k: getattr(new, k) for k in ("max_tokens", "temperature", "top_p", "top_k", "stop_token_ids")
               if hasattr(new, k)}
    if not isinstance(new, dict):
        raise AgentError(f"sampling_params must be a SamplingParams or a dict (got {type(new).__name__})")
    kw = dict(new)
    if "max_tokens" in kw:
        kw["max_new_tokens"] = kw.pop("max_tokens")
    kw.pop("seed", None)
    unknown = sorted(set(kw) - _SP_FIELDS)
    if unknown:
        raise AgentError(f"sampling_params has unknown keys {unknown}; valid: {sorted(_SP_FIELDS - {'seed'})}")
    if kw.get("max_new_tokens") is None:
        kw.pop("max_new_tokens", None)
    if "stop_token_ids" in kw:
        kw["stop_token_ids"] = tuple(kw["stop_token_ids"] or ())
    return replace(current, **kw)


def _float_logs(logs: Any, what: str) -> dict[str, float]:
    if not logs:
        return {}
    if not isinstance(logs, dict):
        raise AgentError(f"{what} must be a dict of numbers (got {type(logs).__name__})")
    out = {}
    for k, v in logs.items():
        try:  # NaN/inf are kept: the metrics logger writes them (as null) and warns
            out[str(k)] = to_float(v, f"{what}[{k!r}]", finite=False)
        except AgentError as err:  # informational: dropped with one warning per key, never fatal
            if str(k) not in _WARNED:
                _WARNED.add(str(k))
                print(f"[rlhforge] warning: {err}; that metric is not logged", flush=True)
    return out


_WARNED: set[str] = set()
