"""Request bodies turned into values. Every way a body can be broken is a :class:`~rlhforge.net.errors.BadRequest`
(HTTP 400) whose message says what is wrong; nothing here ever raises anything else for bad input.

- :func:`parse_json`: strict JSON. Refused with the reason: bad syntax, an empty body, bytes that are not
  UTF-8/16/32, ``NaN``/``Infinity`` (not JSON; allowed with ``allow_nan=True``), a string holding a lone
  surrogate (``"\\ud800"``: JSON accepts the escape, but no UTF-8 encoder or tokenizer does), an integer over
  Python's 4300-digit conversion limit, nesting deeper than the interpreter's recursion limit.
- :func:`decompress_zstd`: a zstd body decompressed with its OUTPUT bounded while it is produced (64 KiB at a
  time): the frame's declared size is only used to refuse early, never trusted, so a 32 KB frame that
  expands to 1 GiB costs at most the bound before its 413.
"""

from __future__ import annotations

import io
import json
import re
from typing import Any

from rlhforge.net.errors import BadRequest, BodyTooLarge

__all__ = ["parse_json", "decompress_zstd", "check_text"]

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_NO_VALUE = object()


def _refuse_constant(name: str):
    raise BadRequest(f"malformed JSON: {name} is not a JSON number (send a finite number)")


def parse_json(body: bytes, *, allow_nan: bool = False, empty: Any = _NO_VALUE) -> Any:
    """The JSON value of ``body``; :class:`BadRequest` naming the reason for anything else (module docstring).
    ``empty``: the value of an empty body (default: an empty body is refused)."""
    if not body or not body.strip():
        if empty is not _NO_VALUE:
            return empty
        raise BadRequest("malformed JSON: the body is empty (expected a JSON value)")
    try:
        value = json.loads(body) if allow_nan else json.loads(body, parse_constant=_refuse_constant)
    except BadRequest:
        raise
    except RecursionError:
        raise BadRequest("malformed JSON: nested too deeply") from None
    except json.JSONDecodeError as err:
        raise BadRequest(f"malformed JSON: {err}") from None
    except UnicodeDecodeError as err:
        raise BadRequest(f"malformed JSON: the body is not UTF-8/16/32 text ({err.reason} at byte {err.start})") from None
    except ValueError as err:  # an integer over Python's int-digit limit (sys.set_int_max_str_digits)
        raise BadRequest(f"malformed JSON: {err}") from None
    if _SURROGATE_ESCAPE.search(body):  # only then can a decoded string hold a lone surrogate
        _check_strings(value)
    return value


def _check_strings(value: Any) -> None:
    """Walks ``value`` (iteratively: depth is already bounded by the parser) refusing lone surrogates."""
    stack = [(value, "")]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            check_text(item, where or "body")
        elif isinstance(item, dict):
            for key, sub in item.items():
                check_text(key, f"a key of {where or 'the body'}")
                name = (f"{where}.{key}" if where else f"'{key}'") if len(where) < 200 else where
                stack.append((sub, name))
        elif isinstance(item, list):
            stack.extend(((f"{where}[{i}]" if len(where) < 200 else where), sub)[::-1] for i, sub in enumerate(item))


def check_text(text: str, where: str = "body") -> str:
    """``text`` if it can be encoded as UTF-8; else :class:`BadRequest` naming ``where`` and the character."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise BadRequest(f"{where} is not valid Unicode: {err.reason} (U+{ord(text[err.start]):04X} at character "
                         f"{err.start})") from None
    return text


def decompress_zstd(body: bytes, max_output: int, *, max_ratio: float | None = None,
                    flag: str = "--max_request_bytes") -> bytes:
    """``body`` (one or more zstd frames) decompressed, refusing (:class:`BodyTooLarge`, 413) output over
    ``max_output`` bytes or over ``max_ratio`` times the compressed size, as soon as it is produced; a body
    that is not zstd is a 400."""
    import zstandard

    limit = max_output if max_ratio is None else min(max_output, int(max_ratio * max(1, len(body))))
    why = (f"over {flag} {max_output}" if limit == max_output else
           f"over {max_ratio:g} times its compressed size of {len(body)} bytes (--max_zstd_ratio)")
    try:
        declared = zstandard.frame_content_size(body)
    except zstandard.ZstdError as err:
        raise BadRequest(f"body: Content-Encoding zstd, but not a zstd frame ({err})") from None
    if declared > limit:  # -1: not declared. A declared size is only used to refuse early, never trusted.
        raise BodyTooLarge(f"body: declares {declared} bytes once decompressed, {why}", close=False)
    out, total = [], 0
    reader = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body), read_across_frames=True)
    try:
        while True:
            chunk = reader.read(min(65536, limit + 1 - total))
            if not chunk:
                break
            total += len(chunk)
            if total > limit:
                raise BodyTooLarge(f"body: decompresses to more than {limit} bytes, {why}", close=False)
            out.append(chunk)
    except zstandard.ZstdError as err:
        raise BadRequest(f"body: not valid zstd ({err})") from None
    finally:
        reader.close()
    return b"".join(out)
