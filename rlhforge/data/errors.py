"""The one exception type for bad training data.

Every problem with user data (a missing file, a malformed JSON line, a record whose field has the
wrong type, an empty response...) raises :class:`DataError`, a ``ValueError`` whose message says
*where*: the file (or ``builtin:NAME@split`` / hub id), the line or the 0-based record index, and
the field. ``DataError.where(...)`` builds that prefix so every message reads the same way::

    data/train.jsonl, record 17, field 'output': expected a non-empty string, got int (5)
"""

from __future__ import annotations

from typing import Any


class DataError(ValueError):
    """Bad input data; the message names the file, line or record, and field.

    Attributes (``None`` when not applicable): ``source`` (file path, hub id or builtin name),
    ``index`` (0-based record index within ``source``), ``line`` (1-based line number),
    ``field`` (the key in the record), ``offset`` (0-based byte offset in the file, for bytes that
    are not UTF-8).
    """

    def __init__(
        self,
        message: str,
        *,
        source: str | None = None,
        index: int | None = None,
        line: int | None = None,
        field: str | None = None,
    ):
        self.source, self.index, self.line, self.field = source, index, line, field
        self.offset: int | None = None
        self.reason = message
        prefix = self.where(source, index=index, line=line, field=field)
        super().__init__(f"{prefix}: {message}" if prefix else message)

    @staticmethod
    def where(
        source: str | None, *, index: int | None = None, line: int | None = None, field: str | None = None
    ) -> str:
        """``"file.jsonl, line 3"`` / ``"file.jsonl, record 17, field 'output'"`` (parts that are set)."""
        parts = []
        if source is not None:
            parts.append(str(source))
        if line is not None:
            parts.append(f"line {line}")
        if index is not None:
            parts.append(f"record {index}")
        if field is not None:
            parts.append(f"field {field!r}")
        return ", ".join(parts)


def describe_value(value: Any, limit: int = 60) -> str:
    """Short ``type (repr)`` description of a bad value for error messages."""
    text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(value).__name__} ({text})"
