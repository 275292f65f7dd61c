"""What the agent servers accept in a request (:mod:`~rlhforge.agents.serving.chat`'s chat route and
:mod:`~rlhforge.agents.serving.tokens`'s token route): one check per field, shared by both, each refusal
an HTTP 400 (413 for a message over the limit) naming the field as the client wrote it.

Sampling fields (OpenAI's names at the top of a chat request, vLLM's inside ``sampling_params``):

==========================================  =====================================================
``max_tokens`` / ``max_completion_tokens``  integer >= 1
``temperature``                             finite number >= 0 (0: greedy)
``top_p``                                   finite number in (0, 1]
``top_k``                                   integer, -1 (all tokens) or >= 1
``seed``                                    integer in [0, 2**63)
``stop``                                    string or list of strings
``stop_token_ids``                          list of integers >= 0
``n``                                       1 (one completion per call)
``logprobs``                                boolean or integer >= 0
==========================================  =====================================================

``null`` means "not given" for every field. A boolean is not a number here (JSON ``true`` is not 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from rlhforge.agents.serving.routes import _HTTPError

__all__ = ["SamplingRequest", "parse_sampling", "chat_messages", "check_length"]

_SEED_LIMIT = 2**63


@dataclass(frozen=True)
class SamplingRequest:
    """The sampling fields of one request, checked (None: not given)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False

    def overrides(self) -> dict:
        """The rlhforge ``SamplingParams`` fields this request sets (temperature, top_p, top_k)."""
        return {k: v for k, v in (("temperature", self.temperature), ("top_p", self.top_p), ("top_k", self.top_k))
                if v is not None}


def _bad(where: str, expected: str, value: Any) -> _HTTPError:
    shown = repr(value)
    return _HTTPError(400, f"'{where}' must be {expected} (got {shown[:60] + '...' if len(shown) > 60 else shown})")


def _integer(value: Any, where: str, expected: str, ok) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not ok(value):
        raise _bad(where, expected, value)
    return value


def _number(value: Any, where: str, expected: str, ok) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise _bad(where, expected, value)
    return float(value)


def parse_sampling(d: dict, prefix: str = "") -> SamplingRequest:
    """The checked sampling fields of ``d`` (module docstring); ``prefix`` names where ``d`` sits in the
    body (``"sampling_params."`` for the token route)."""
    if not isinstance(d, dict):
        raise _bad(prefix.rstrip(".") or "body", "an object", d)
    name = "max_completion_tokens" if d.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(d.get(name), prefix + name, "an integer >= 1", lambda v: v >= 1)
    temperature = _number(d.get("temperature"), prefix + "temperature", "a finite number >= 0", lambda v: v >= 0)
    top_p = _number(d.get("top_p"), prefix + "top_p", "a number in (0, 1]", lambda v: 0 < v <= 1)
    top_k = _integer(d.get("top_k"), prefix + "top_k", "an integer, -1 (all tokens) or >= 1", lambda v: v == -1 or v >= 1)
    seed = _integer(d.get("seed"), prefix + "seed", "an integer in [0, 2**63)", lambda v: 0 <= v < _SEED_LIMIT)
    stop = d.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise _bad(prefix + "stop", "a string or a list of strings", stop)
    ids = d.get("stop_token_ids")
    if ids is not None and not (isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                                              and t >= 0 for t in ids)):
        raise _bad(prefix + "stop_token_ids", "a list of integers >= 0", ids)
    n = d.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise _HTTPError(400, f"'{prefix}n' must be 1: one completion per call (got {n!r})")
    logprobs = d.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        _integer(logprobs, prefix + "logprobs", "a boolean or an integer >= 0", lambda v: v >= 0)
    return SamplingRequest(max_tokens, temperature, top_p, top_k, seed, stops, tuple(ids or ()), bool(logprobs))


def check_length(text: str, where: str, max_chars: int, flag: str = "--train.agent_server_max_message_chars") -> str:
    """``text`` if it has at most ``max_chars`` characters, else 413 naming ``where`` and ``flag``."""
    if len(text) > max_chars:
        raise _HTTPError(413, f"{where} has {len(text)} characters, over this server's limit of {max_chars} ({flag})")
    return text


def _content_text(content: Any, where: str) -> str:
    """OpenAI message content (a string, null, or a list of text parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "a string, null or a list of text parts", content)
    parts = []
    for i, p in enumerate(content):
        if isinstance(p, str):
            parts.append(p)
        elif isinstance(p, dict) and p.get("type") == "text":
            text = p.get("text", "")
            if not isinstance(text, str):
                raise _bad(f"{where}[{i}].text", "a string", text)
            parts.append(text)
        else:
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise _HTTPError(400, f"'{where}[{i}]': unsupported content part {kind!r} (only text parts)")
    return "".join(parts)


def chat_messages(messages: Any, max_chars: int) -> list[dict]:
    """The request's ``messages`` with every content as one string, checked: a non-empty list of objects
    with a string ``role``; each content at most ``max_chars`` characters (413 otherwise)."""
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", "a non-empty list", messages)
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}]", "an object with a string 'role'", m)
        text = check_length(_content_text(m.get("content"), f"messages[{i}].content"), f"messages[{i}].content",
                            max_chars)
        out.append({**m, "content": text})
    return out
