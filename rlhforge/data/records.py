"""Typed access to fields of a data record, with errors that say where.

Used by every sample builder (SFT, reward model, DPO, RL prompts) so that a bad record always
fails the same way: ``DataError("data/train.jsonl, record 17, field 'output': ... [line 18]")``.
A record's location comes from the ``_source``/``_index``/``_line`` keys that
:func:`rlhforge.data.loading.load_dataset_spec` adds; records from elsewhere (a plain list, a
``datasets.Dataset`` built in code) are located as ``<dataset>`` and their position. The line
(JSON Lines, JSON and CSV files) is appended to the message as ``[line N]``, so the message starts
with the same ``source, record N, field 'x':`` prefix whatever the format.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from rlhforge.data.errors import DataError, describe_value
from rlhforge.data.loading import INDEX_COLUMN, LINE_COLUMN, SOURCE_COLUMN

__all__ = ["RecordRef", "record_ref", "get_field", "get_text", "get_messages", "MESSAGE_ROLES", "json_label"]

MESSAGE_ROLES = ("system", "user", "assistant", "tool", "developer", "function", "ipython")

#: hints shown when the configured key is missing but the record looks like a known format
_FORMAT_HINTS = (
    ({"prompt", "completion"}, "prompt/completion data: use input_key='prompt', output_key='completion'"),
    ({"messages"}, "conversational data: use input_key='messages' with apply_chat_template=True"),
    (
        {"prompt", "chosen", "rejected"},
        "preference data: use prompt_key='prompt', chosen_key='chosen', rejected_key='rejected'",
    ),
    ({"text"}, "language-modelling data: use input_key='text' (pretrain mode)"),
    ({"instruction", "output"}, "Alpaca-style data: use input_key='instruction', output_key='output'"),
)


class RecordRef:
    """Where a record came from: ``source`` (file, builtin or hub id), 0-based ``index`` and, for
    line-based files, the 1-based ``line`` where it starts."""

    __slots__ = ("source", "index", "line")

    def __init__(self, source: str, index: int, line: int | None = None):
        self.source, self.index, self.line = source, index, line

    def error(self, message: str, field: str | None = None) -> DataError:
        if self.line is not None:
            message = f"{message} [line {self.line}]"
        err = DataError(message, source=self.source, index=self.index, field=field)
        err.line = self.line
        return err

    def __repr__(self) -> str:
        return DataError.where(self.source, index=self.index)


def record_ref(record: Mapping[str, Any], position: int) -> RecordRef:
    """The record's provenance (``_source``/``_index`` columns), else ``<dataset>`` and ``position``."""
    source = record.get(SOURCE_COLUMN)
    index = record.get(INDEX_COLUMN)
    line = record.get(LINE_COLUMN) if source is not None else None
    return RecordRef(str(source) if source is not None else "<dataset>", int(index) if index is not None else position,
                     int(line) if line is not None else None)


def _user_keys(record: Mapping[str, Any]) -> list[str]:
    return [k for k in record if k not in (SOURCE_COLUMN, INDEX_COLUMN, LINE_COLUMN)]


def get_field(record: Mapping[str, Any], key: str, ref: RecordRef) -> Any:
    """``record[key]``; a missing key (or None) names the keys the record does have, with a format hint."""
    if key in record and record[key] is not None:
        return record[key]
    keys = _user_keys(record)
    what = "is missing" if key not in record else "is missing (null)"
    hint = ""
    present = set(keys)
    for needed, text in _FORMAT_HINTS:
        if needed <= present and key not in needed:
            hint = f"; this looks like {text}"
            break
    raise ref.error(f"{what} (record has: {', '.join(keys) or 'no fields'}){hint}", field=key)


def get_text(record: Mapping[str, Any], key: str, ref: RecordRef, *, allow_empty: bool = False) -> str:
    """A string field; numbers, lists, ``None`` and (unless ``allow_empty``) blank strings are errors."""
    value = get_field(record, key, ref)
    if not isinstance(value, str):
        extra = ""
        if isinstance(value, list):
            extra = " (a list of messages needs apply_chat_template=True)"
        raise ref.error(f"expected a string, got {describe_value(value)}{extra}", field=key)
    if not allow_empty and not value.strip():
        raise ref.error("is an empty string", field=key)
    return value


def get_messages(
    record: Mapping[str, Any], key: str, ref: RecordRef, *, value: Any = None
) -> list[dict[str, Any]]:
    """A conversation: a non-empty list of ``{"role": str, "content": str}`` dicts.

    ``content`` may also be a list of parts (multimodal-style ``[{"type": "text", ...}]``) or
    ``None`` on an assistant message carrying ``tool_calls``. Other keys (``tool_calls``, ``name``...)
    pass through; keys whose value is ``None`` are dropped. ``value`` overrides the lookup (already fetched).
    """
    value = get_field(record, key, ref) if value is None else value
    if not isinstance(value, list):
        raise ref.error(f"expected a list of {{'role', 'content'}} messages, got {describe_value(value)}", field=key)
    if not value:
        raise ref.error("is an empty list of messages", field=key)
    out = []
    for i, message in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(message, Mapping):
            raise ref.error(f"expected a {{'role', 'content'}} dict, got {describe_value(message)}", field=where)
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ref.error(f"missing or non-string 'role' (got {describe_value(role)})", field=where)
        content = message.get("content")
        if content is None and not (role == "assistant" and message.get("tool_calls")):
            raise ref.error("missing 'content'", field=where)
        if content is not None and not isinstance(content, (str, list)):
            raise ref.error(f"'content' must be a string, got {describe_value(content)}", field=where)
        # Arrow stores a list of structs with the union of keys, filling absent ones with None;
        # drop those so templates testing `message.name is defined` behave as on the raw JSON
        out.append({k: v for k, v in message.items() if v is not None or k in ("role", "content")})
    return out


def check_truncation_drops(dropped: list, kept: int, *, what: str, max_len: int, logger) -> None:
    """Samples whose targets all lie beyond ``max_len`` are dropped: warn with examples, or fail
    naming them when nothing is left (``what``: e.g. "SFT samples", "preference pairs")."""
    if not dropped:
        return
    examples = "; ".join(repr(r) for r in dropped[:3])
    if not kept:
        raise DataError(
            f"all {len(dropped)} {what} have their response beyond max_len={max_len} tokens "
            f"(e.g. {examples}); raise max_len or shorten the prompts"
        )
    logger.warning("dropped %d of %d %s whose response starts beyond max_len=%d tokens (e.g. %s)",
                   len(dropped), len(dropped) + kept, what, max_len, examples)


def json_label(label: Any) -> Any:
    """A label as an environment or reward function takes it: a JSON-object string parsed into a dict, anything
    else (a dict, a number, plain text) unchanged."""
    if isinstance(label, str) and label.lstrip().startswith("{"):
        try:
            return json.loads(label)
        except json.JSONDecodeError:
            return label
    return label
