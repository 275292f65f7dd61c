"""Exact readers for local text data files: JSON Lines, JSON and CSV.

Each returns a list of ``(line, record)`` pairs: the 1-based line where the record starts and the
record as a plain dict. Values are exactly what the file holds, decoded by Python's ``json`` module
(JSON) or the ``csv`` module (CSV: every value is a string, as written). No column typing happens:
``"0.50"`` stays the string ``"0.50"``, ``1e3`` (a JSON number) stays ``1000.0``, ``"true"`` stays
the string ``"true"``, ``null`` is ``None``. Files must be UTF-8 (a leading byte-order mark is
skipped); any other byte sequence is a :class:`DataError` naming the file, line and byte offset.
"""

from __future__ import annotations

import csv
import io
import json
import re
import sys
from pathlib import Path
from typing import Any

from rlhforge.data.errors import DataError

__all__ = ["read_jsonl", "read_json", "read_csv", "decode_utf8"]

_BOM = b"\xef\xbb\xbf"
_WS = re.compile(r"[ \t\n\r]*")
_KIND = {str: "string", int: "number", float: "number", bool: "boolean", list: "list", type(None): "null"}


def _kind(value: Any) -> str:
    return _KIND.get(type(value), type(value).__name__)


def _utf8_error(err: UnicodeDecodeError, name: str, line: int, offset: int, column: int) -> DataError:
    bad = err.object[err.start : err.start + 1]
    byte = f"0x{bad[0]:02x}" if bad else "?"
    e = DataError(
        f"is not valid UTF-8: byte {byte} at byte offset {offset} (column {column} in bytes): {err.reason}; "
        "data files must be UTF-8 text (re-encode it, e.g. iconv -f latin1 -t utf-8)",
        source=name, line=line,
    )
    e.offset = offset
    return e


def decode_utf8(data: bytes, name: str) -> str:
    """``data`` as text (a leading BOM dropped); a non-UTF-8 byte is a DataError with line and offset."""
    skip = len(_BOM) if data.startswith(_BOM) else 0
    try:
        return data[skip:].decode("utf-8")
    except UnicodeDecodeError as err:
        offset = skip + err.start
        line_start = data.rfind(b"\n", 0, offset) + 1
        raise _utf8_error(err, name, data.count(b"\n", 0, offset) + 1, offset, offset - line_start + 1) from None


def _check_object(record: Any, name: str, line: int | None, index: int) -> dict:
    if not isinstance(record, dict):
        raise DataError(f"expected a JSON object per record, got {_kind(record)}", source=name, line=line,
                        index=None if line else index)
    return record


def read_jsonl(path: Path, name: str) -> list[tuple[int, dict]]:
    """One JSON object per line; blank lines are skipped."""
    out: list[tuple[int, dict]] = []
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            start = offset
            offset += len(raw)
            skip = len(_BOM) if lineno == 1 and raw.startswith(_BOM) else 0
            try:
                text = raw[skip:].decode("utf-8")
            except UnicodeDecodeError as err:
                raise _utf8_error(err, name, lineno, start + skip + err.start, skip + err.start + 1) from None
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as err:
                raise DataError(f"malformed JSON line: {err.msg} (column {err.colno})", source=name,
                                line=lineno) from None
            out.append((lineno, _check_object(record, name, lineno, len(out))))
    return out


def read_json(path: Path, name: str) -> list[tuple[int, dict]]:
    """A JSON list of objects (each record's line is where it starts), or JSON lines, or one object."""
    text = decode_utf8(path.read_bytes(), name)
    start = _WS.match(text).end()
    if text.startswith("[", start):
        return _read_array(text, start, name)
    try:
        return _read_lines(text, name)
    except DataError:
        try:  # a single (pretty-printed) object is one record
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None
        if isinstance(whole, dict):
            return [(text.count("\n", 0, start) + 1, whole)]
        raise


def _read_lines(text: str, name: str) -> list[tuple[int, dict]]:
    out: list[tuple[int, dict]] = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"malformed JSON line: {err.msg} (column {err.colno})", source=name, line=lineno) from None
        out.append((lineno, _check_object(record, name, lineno, len(out))))
    return out


def _read_array(text: str, pos: int, name: str) -> list[tuple[int, dict]]:
    decoder = json.JSONDecoder()
    out: list[tuple[int, dict]] = []
    line, counted = 1, 0

    def line_of(p: int) -> int:
        nonlocal line, counted
        line += text.count("\n", counted, p)
        counted = p
        return line

    def fail(msg: str, p: int):
        raise DataError(f"malformed JSON: {msg} (column {p - text.rfind(chr(10), 0, p)})", source=name,
                        line=line_of(p)) from None

    pos = _WS.match(text, pos + 1).end()
    if text.startswith("]", pos):
        pos += 1
    else:
        while True:
            try:
                record, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as err:
                raise DataError(f"malformed JSON: {err.msg} (column {err.colno})", source=name,
                                line=err.lineno) from None
            lineno = line_of(pos)
            if not isinstance(record, dict):
                raise DataError(f"expected a JSON object per record, got {_kind(record)}", source=name,
                                line=lineno, index=len(out))
            out.append((lineno, record))
            pos = _WS.match(text, end).end()
            if text.startswith(",", pos):
                pos = _WS.match(text, pos + 1).end()
                continue
            if text.startswith("]", pos):
                pos += 1
                break
            fail("expecting ',' or ']' after a record", pos)
    pos = _WS.match(text, pos).end()
    if pos != len(text):
        fail("extra data after the closing ']'", pos)
    return out


def _raise_csv_limit() -> None:
    limit = sys.maxsize
    while True:  # long texts (SFT responses) exceed csv's default 128 KiB field limit
        try:
            csv.field_size_limit(limit)
            return
        except OverflowError:
            limit //= 2


def read_csv(path: Path, name: str) -> list[tuple[int, dict]]:
    """A header row, then one record per row; every value is the string as written (an empty cell
    is ``""``). Blank rows are skipped; a row with more or fewer cells than the header is an error."""
    _raise_csv_limit()
    text = decode_utf8(path.read_bytes(), name)
    reader = csv.reader(io.StringIO(text, newline=""))
    header: list[str] | None = None
    out: list[tuple[int, dict]] = []
    last = 0
    try:
        for row in reader:
            start, last = last + 1, reader.line_num
            if not row:
                continue
            if header is None:
                header = row
                dupes = sorted({c for c in header if header.count(c) > 1})
                if dupes:
                    raise DataError(f"the header names column(s) {dupes} more than once", source=name, line=start)
                continue
            if len(row) != len(header):
                raise DataError(f"has {len(row)} cells but the header has {len(header)} columns ({', '.join(header)})",
                                source=name, line=start)
            out.append((start, dict(zip(header, row))))
    except csv.Error as err:
        raise DataError(f"malformed CSV: {err}", source=name, line=reader.line_num) from None
    return out
