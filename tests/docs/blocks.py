"""Fenced blocks of the docs, found by a piece of their text, so a test runs exactly what a page shows."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)


def fenced_blocks(page: str) -> list[tuple[str, str]]:
    """``(language, text)`` of every fenced block of ``page`` (a path relative to the repository root)."""
    return [(m.group(1), m.group(2)) for m in _FENCE.finditer((ROOT / page).read_text())]


def fenced_block(page: str, contains: str, language: str | None = None) -> str:
    """The one fenced block of ``page`` whose text holds ``contains`` (and whose language is ``language``)."""
    found = [text for lang, text in fenced_blocks(page) if contains in text and (language is None or lang == language)]
    assert len(found) == 1, f"{page}: {len(found)} fenced block(s) hold {contains!r} (want exactly one)"
    return found[0]


def command_argv(block: str) -> list[str]:
    """The single shell command of a block (continuation lines joined; ``#`` comments dropped) as argv."""
    return shlex.split(block.replace("\\\n", " "), comments=True)
