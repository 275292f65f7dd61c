"""Client of remote sandbox services (``rlhforge serve-sandbox``), with the local sandbox's call::

    client = SandboxClient("endpoints:/shared/sandboxes.txt", timeout_s=5)   # or "http://h1:10003,http://h2:10003"
    result = await client.run("print(2 ** 10)")          # SandboxResult, as Sandbox.run returns
    format_feedback(result)

Servers: a comma-separated list of URLs, or ``endpoints:FILE``, a live endpoints file
(:class:`rlhforge.net.endpoints.EndpointsFile`: one URL a line, ``#`` comments) that is checked on
every call, so sandbox servers can be added, moved or removed while a run goes on (the fork's
"nginx file"). A URL is a server's base (``http://10.0.0.5:10003``) or its ``/run`` address.

Each call goes to the next server in turn (round robin). A server that cannot be reached, times out
(``timeout_s`` of the code + ``request_margin_s``), is busy (503) or fails (5xx, 404) is skipped for
``cooldown_s`` and the call moves to the next one (a warning names the URL and the cause), up to
``max_attempts`` tries (default: each listed server once, at least two tries; a second round waits
``backoff_s``, doubling, or the server's ``Retry-After``). A request every server would refuse (400,
401/403 for the API key, 413) stops at once. When no server could run the code the call does not
raise: it returns a result with ``error`` set (``"sandbox service unavailable: URL: cause; ..."``),
as the local sandbox does when it cannot start a process, and counts it in ``counters["failures"]``.

API key: ``api_key=`` or ``$RLHFORGE_SANDBOX_API_KEY``, sent as ``Authorization: Bearer KEY``
(never logged). Per-call limits (``limits=``, any of ``PER_CALL_LIMITS``) are requests: the server
lowers them to its own maxima (``result.time_limit_s`` is the time limit applied).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from typing import Any, Mapping, Sequence

from .config import PER_CALL_LIMITS, SandboxResult, result_from_dict

__all__ = ["SandboxClient", "sandbox_endpoints", "API_KEY_ENV", "URL_ENV"]

logger = logging.getLogger("rlhforge.agents.sandbox.client")

API_KEY_ENV = "RLHFORGE_SANDBOX_API_KEY"
"""Environment variable with the sandbox services' API key (client and ``serve-sandbox``)."""
URL_ENV = "RLHFORGE_SANDBOX_URL"
"""Environment variable naming the sandbox servers of the built-in ``math_tir`` environment."""

_FATAL = {400: "the server refused the request", 401: "the API key was refused", 403: "the API key was refused",
          413: "the code is too large for the server"}


def sandbox_endpoints(spec: str | Sequence[str]):
    """The endpoint source of ``spec``: ``endpoints:FILE`` (re-read when it changes) or URLs (a
    comma-separated string or a list). Raises :class:`~rlhforge.net.endpoints.EndpointsFileError`
    (a ValueError) for a missing or invalid file or URL."""
    from rlhforge.net.endpoints import EndpointsFile, StaticEndpoints

    if isinstance(spec, str):
        spec = spec.strip()
        if spec.startswith("endpoints:"):
            return EndpointsFile(spec[len("endpoints:"):])
        spec = [u.strip() for u in spec.split(",") if u.strip()]
    return StaticEndpoints(list(spec))


def run_url(url: str) -> str:
    """The ``/run`` address of a server URL (its base, or already ``.../run``)."""
    url = url.rstrip("/")
    return url if url.endswith("/run") else url + "/run"


class SandboxClient:
    """Runs code on remote sandbox services; ``run()`` has :meth:`Sandbox.run`'s signature and
    contract (see the module docstring). Thread-safe; usable from any event loop."""

    def __init__(self, endpoints, *, timeout_s: float = 10.0, limits: Mapping[str, Any] | None = None,
                 api_key: str | None = None, request_margin_s: float = 30.0, connect_timeout_s: float = 3.0,
                 max_attempts: int | None = None, backoff_s: float = 0.5, max_backoff_s: float = 5.0,
                 cooldown_s: float = 30.0):
        self.source = endpoints if hasattr(endpoints, "current") else sandbox_endpoints(endpoints)
        if timeout_s <= 0:
            raise ValueError(f"SandboxClient timeout_s must be > 0 (got {timeout_s})")
        if max_attempts is not None and max_attempts < 1:
            raise ValueError(f"SandboxClient max_attempts must be >= 1 (got {max_attempts})")
        self.limits = dict(limits or {})
        unknown = sorted(set(self.limits) - set(PER_CALL_LIMITS))
        if unknown:
            raise ValueError(f"SandboxClient limits {unknown} cannot be set per call "
                             f"(choose from {', '.join(PER_CALL_LIMITS)})")
        self.timeout_s, self.request_margin_s, self.connect_timeout_s = timeout_s, request_margin_s, connect_timeout_s
        self.max_attempts, self.backoff_s, self.max_backoff_s = max_attempts, backoff_s, max_backoff_s
        self.cooldown_s = cooldown_s
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._lock = threading.Lock()
        self._turn = 0
        self._failed_until: dict[str, float] = {}
        self.counters = {"calls": 0, "failovers": 0, "failures": 0}
        """``calls`` answered, ``failovers`` (tries that moved on to another server), ``failures``
        (calls no server could run)."""
        self.last_url: str | None = None
        """The server that answered the latest call."""

    # ---- server order --------------------------------------------------------------------
    def _order(self) -> list[str]:
        """The current servers, starting at this call's turn; those cooling down after a failure last."""
        urls = list(dict.fromkeys(self.source.current()))
        now = time.monotonic()
        with self._lock:
            start = self._turn % len(urls)
            self._turn += 1
            rotated = urls[start:] + urls[:start]
            healthy = [u for u in rotated if self._failed_until.get(u, 0.0) <= now]
            return healthy + [u for u in rotated if u not in healthy]

    def _mark(self, url: str, ok: bool) -> None:
        with self._lock:
            if ok:
                self._failed_until.pop(url, None)
            else:
                self._failed_until[url] = time.monotonic() + self.cooldown_s

    # ---- calls -----------------------------------------------------------------------------
    async def run(self, code: str, *, timeout_s: float | None = None,
                  limits: Mapping[str, Any] | None = None) -> SandboxResult:
        """Run ``code`` on one of the servers; never raises for what the code does or for
        unreachable servers (the result's ``error`` says what happened)."""
        import httpx

        if not isinstance(code, str):
            raise TypeError(f"SandboxClient.run(code): code must be str, got {type(code).__name__}")
        wanted = {**self.limits, **(limits or {})}
        if timeout_s is not None:
            wanted["timeout_s"] = timeout_s
        wanted.setdefault("timeout_s", self.timeout_s)
        payload = {"code": code, "limits": wanted}
        order = self._order()
        attempts = self.max_attempts or max(2, len(order))
        timeout = httpx.Timeout(float(wanted["timeout_s"]) + self.request_margin_s, connect=self.connect_timeout_s)
        failures: list[str] = []
        t0 = time.monotonic()
        retry_after = 0.0
        async with httpx.AsyncClient(timeout=timeout, headers=self._headers) as http:
            for k in range(attempts):
                url = order[k % len(order)]
                if k and k % len(order) == 0:  # every server failed once: wait before the next round
                    delay = min(self.max_backoff_s, max(retry_after, self.backoff_s * 2 ** (k // len(order) - 1)))
                    await asyncio.sleep(delay)
                result, cause, fatal, retry_after = await self._try(http, url, payload, timeout)
                if result is not None:
                    self._mark(url, True)
                    with self._lock:
                        self.counters["calls"] += 1
                        self.last_url = url
                    return result
                self._mark(url, False)
                failures.append(f"{url}: {cause}")
                last = fatal or k + 1 == attempts
                if not last:
                    with self._lock:
                        self.counters["failovers"] += 1
                logger.warning("sandbox service %s failed: %s%s", url, cause,
                               "" if last else f"; trying {order[(k + 1) % len(order)]}")
                if fatal:
                    break
        with self._lock:
            self.counters["failures"] += 1
        message = "sandbox service unavailable: " + "; ".join(failures)
        logger.error("%s", message)
        return SandboxResult(stdout="", stderr="", exit_code=None, timed_out=False, memory_exceeded=False,
                             truncated=False, duration=time.monotonic() - t0, error=message, isolation="remote",
                             time_limit_s=float(wanted["timeout_s"]))

    async def _try(self, http, url: str, payload: dict, timeout) -> tuple[SandboxResult | None, str, bool, float]:
        """One POST: ``(result, "", False, 0)`` or ``(None, cause, fatal, retry_after_s)``."""
        import httpx

        try:
            response = await http.post(run_url(url), json=payload)
        except httpx.ConnectTimeout:
            return None, f"no connection within {self.connect_timeout_s:g} s", False, 0.0
        except httpx.TimeoutException as err:
            return None, f"no answer within {timeout.read:g} s ({type(err).__name__})", False, 0.0
        except httpx.HTTPError as err:
            return None, f"{type(err).__name__}: {err or 'connection failed'}", False, 0.0
        code = response.status_code
        if code == 200:
            try:
                return result_from_dict(response.json()["result"]), "", False, 0.0
            except (ValueError, KeyError, TypeError) as err:
                return None, f"answered with something that is not a sandbox result ({err}): " \
                             f"{response.text[:200]!r}", False, 0.0
        from rlhforge.net.client import response_reason

        reason = response_reason(response)
        if code in _FATAL:
            return None, f"HTTP {code}: {_FATAL[code]}: {reason}", True, 0.0
        try:
            retry_after = float(response.headers.get("retry-after", 0))
        except ValueError:
            retry_after = 0.0
        return None, f"HTTP {code}: {reason}", False, retry_after

    def run_sync(self, code: str, *, timeout_s: float | None = None,
                 limits: Mapping[str, Any] | None = None) -> SandboxResult:
        """:meth:`run` without an event loop (do not call from inside one)."""
        return asyncio.run(self.run(code, timeout_s=timeout_s, limits=limits))
