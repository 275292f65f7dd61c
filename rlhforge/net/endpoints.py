"""Live endpoint lists: service addresses read from a file that may change while training runs.

Environment, verifier and reward services can be moved, added or replaced without stopping a
run: list their URLs in a file and point the run at it. :meth:`EndpointsFile.current` re-reads
the file whenever it changed (it compares modification time, size and inode on every call, a
single ``stat``; the file is only parsed when one of them differs)::

    endpoints = EndpointsFile("services.txt")       # raises EndpointsFileError if missing/bad
    pick = EndpointSelector(endpoints)              # round-robin over the current list
    url = pick()                                    # e.g. "http://10.0.0.5:8000"

File format: one ``http://`` or ``https://`` URL per line; blank lines and ``#`` comments (whole
lines, or after whitespace at the end of a line) are ignored. Alternatively the whole file is a
JSON list of URL strings. Example::

    # reward servers (moved rm-2 to the new node on Tuesday)
    http://rm-1:5000/get_reward
    http://10.0.0.7:5000/get_reward   # rm-2

An edit that leaves the file missing, empty or invalid does not disturb the run: the last good
list stays in use and a warning (``logging.warning``) names the file and the problem, once per
change of the file. Write the file atomically (write a temporary file, then rename it over the
old one) so that readers never see half a file.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Literal, Protocol, Sequence
from urllib.parse import urlsplit

__all__ = ["EndpointsFile", "EndpointsFileError", "EndpointSelector", "StaticEndpoints", "parse_endpoints"]

logger = logging.getLogger(__name__)


class EndpointsFileError(ValueError):
    """An endpoints file (or text) is missing, empty or invalid; the message names the file and
    line."""


class EndpointSource(Protocol):
    def current(self) -> list[str]: ...


def _check_url(url: str, where: str) -> str:
    if any(c.isspace() for c in url):
        raise EndpointsFileError(f"{where}: {url!r} is not a URL (contains whitespace)")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise EndpointsFileError(f"{where}: {url!r} is not an http:// or https:// URL")
    try:
        parts.port  # raises ValueError for a non-numeric or out-of-range port
    except ValueError as err:
        raise EndpointsFileError(f"{where}: {url!r} has an invalid port ({err})") from None
    if not parts.hostname:
        raise EndpointsFileError(f"{where}: {url!r} has no host")
    return url


def _strip_comment(line: str) -> str:
    if line.lstrip().startswith("#"):
        return ""
    for i, c in enumerate(line):  # a '#' after whitespace starts a comment ('#' in a URL fragment does not)
        if c == "#" and i > 0 and line[i - 1].isspace():
            return line[:i]
    return line


def parse_endpoints(text: str, source: str = "<text>") -> list[str]:
    """The URLs of an endpoints file's ``text``; errors name ``source`` and the line (or item)."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            items = json.loads(stripped)
        except json.JSONDecodeError as err:
            raise EndpointsFileError(f"{source}:{err.lineno}: invalid JSON ({err.msg})") from None
        if not isinstance(items, list):
            raise EndpointsFileError(f"{source}: expected a JSON list of URLs")
        urls = []
        for i, item in enumerate(items):
            if not isinstance(item, str):
                raise EndpointsFileError(f"{source}: item {i} is {item!r}, not a URL string")
            urls.append(_check_url(item.strip(), f"{source}: item {i}"))
    else:
        urls = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            line = _strip_comment(line).strip()
            if line:
                urls.append(_check_url(line, f"{source}:{lineno}"))
    if not urls:
        raise EndpointsFileError(f"{source}: no endpoints listed")
    return urls


class StaticEndpoints:
    """A fixed list with the same interface as :class:`EndpointsFile`."""

    def __init__(self, urls: Sequence[str]):
        self._urls = parse_endpoints("\n".join(urls), "<list>")

    def current(self) -> list[str]:
        return list(self._urls)


class EndpointsFile:
    """The endpoints listed in ``path``, re-read when the file changes (see the module docstring).

    The first load happens here and raises :class:`EndpointsFileError` if the file is missing,
    empty or invalid; later failures keep the last good list (and warn once per change).
    Thread-safe.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._signature: tuple | None = None
        self._warned_for: tuple | str | None = None
        self.last_error: str | None = None
        """Why the latest version of the file was not used (None when it was)."""
        self.reloads = 0
        """How many times a changed file was read (successfully or not)."""
        signature = self._stat()
        if signature is None:
            raise EndpointsFileError(f"endpoints file {self.path} does not exist")
        self._urls = self._read(signature)  # raises on a bad first version
        self._signature = signature

    def _stat(self) -> tuple | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev)

    def _read(self, signature: tuple) -> list[str]:
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise EndpointsFileError(f"endpoints file {self.path}: cannot read it ({err})") from None
        return parse_endpoints(text, str(self.path))

    def current(self) -> list[str]:
        """The endpoints now (re-reads the file if it changed since the last call)."""
        signature = self._stat()
        with self._lock:
            if signature == self._signature:
                return list(self._urls)
            self._signature = signature
            self.reloads += 1
            if signature is None:
                self._problem("missing", f"endpoints file {self.path} disappeared")
                return list(self._urls)
            try:
                urls = self._read(signature)
            except EndpointsFileError as err:
                self._problem(signature, str(err))
                return list(self._urls)
            if urls != self._urls:
                logger.info("endpoints file %s changed: %d endpoint(s): %s", self.path, len(urls), ", ".join(urls))
            self._urls, self.last_error, self._warned_for = urls, None, None
            return list(self._urls)

    def _problem(self, key, message: str) -> None:
        self.last_error = message
        if self._warned_for != key:
            self._warned_for = key
            logger.warning("%s; keeping the last good list (%s)", message, ", ".join(self._urls))


class EndpointSelector:
    """Spreads requests over the current endpoints of ``source``.

    ``round_robin`` cycles through the list; ``least_recently_used`` picks the endpoint not
    picked for the longest time (new endpoints first). An endpoint reported with
    :meth:`report_failure` is skipped for ``cooldown_s`` seconds unless every endpoint is cooling
    down. Changes of the list (an :class:`EndpointsFile` edit) apply from the next pick. Thread-safe.
    """

    def __init__(self, source: EndpointSource | Sequence[str],
                 strategy: Literal["round_robin", "least_recently_used"] = "round_robin", *,
                 cooldown_s: float = 30.0):
        if strategy not in ("round_robin", "least_recently_used"):
            raise ValueError(f"EndpointSelector strategy must be round_robin or least_recently_used (got {strategy!r})")
        self.source = source if hasattr(source, "current") else StaticEndpoints(source)
        self.strategy = strategy
        self.cooldown_s = cooldown_s
        self._lock = threading.Lock()
        self._turn = 0
        self._clock = 0
        self._last_used: dict[str, int] = {}
        self._failed_until: dict[str, float] = {}

    def __call__(self) -> str:
        return self.pick()

    def pick(self) -> str:
        urls = self.source.current()
        now = time.monotonic()
        with self._lock:
            healthy = [u for u in urls if self._failed_until.get(u, 0.0) <= now] or urls
            if self.strategy == "round_robin":
                url = healthy[self._turn % len(healthy)]
                self._turn += 1
            else:
                url = min(healthy, key=lambda u: self._last_used.get(u, -1))
            self._clock += 1
            self._last_used[url] = self._clock
            if len(self._last_used) > 4 * len(urls) + 16:  # forget endpoints long gone
                keep = set(urls)
                self._last_used = {u: t for u, t in self._last_used.items() if u in keep}
            return url

    def report_failure(self, url: str) -> None:
        """Skip ``url`` for ``cooldown_s`` seconds (e.g. after a connection error)."""
        with self._lock:
            self._failed_until[url] = time.monotonic() + self.cooldown_s

    def report_success(self, url: str) -> None:
        with self._lock:
            self._failed_until.pop(url, None)
