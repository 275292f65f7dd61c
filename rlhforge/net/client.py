"""Calling services: how long one attempt may take, how often it is repeated, and where a request goes when
its server fails (the reward client, the sandbox client and the trainers' service calls share it).

- every attempt is bounded by ``RetryPolicy.timeout`` seconds in all (connect + send + answer);
- connection errors, timeouts, HTTP 408, 429 and 5xx are retried on the same server ``retries`` times,
  waiting ``backoff_s * 2**k`` (capped at ``max_backoff_s``, +-10% jitter; a ``Retry-After`` header is
  honoured up to the cap);
- every failed attempt is reported in one line (URL, ``attempt k/n``, the cause, what happens next);
- a server that used up its attempts, answered another 4xx or gave an unusable answer is given up for that
  request, which moves to the next server not yet failed (failover); :class:`ServerHealth` remembers the
  failure across calls (a cool-down, doubling with each consecutive failure);
- when every server has failed, :class:`~rlhforge.net.errors.ServiceError` names each URL with its cause.
"""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from rlhforge.net.errors import ServiceError

__all__ = ["RetryPolicy", "ServerHealth", "FailoverCall", "post_with_failover", "response_reason", "bearer_headers",
           "httpx_timeout"]


def stderr_line(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def bearer_headers(api_key: str | None) -> dict[str, str]:
    """``{"Authorization": "Bearer KEY"}``, or ``{}`` without a key (the header every rlhforge service checks)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@dataclass(frozen=True)
class RetryPolicy:
    """How long one attempt may take and how often a failed one is repeated (module docstring)."""

    timeout: float = 180.0
    """Seconds one attempt may take in all (connect, send, answer)."""
    retries: int = 2
    """Repeats on the same server after a retryable failure (attempts per server = retries + 1)."""
    backoff_s: float = 1.0
    """Wait before the first repeat; doubles each time."""
    max_backoff_s: float = 30.0
    """Longest wait between attempts (also caps a server's Retry-After)."""

    def __post_init__(self):
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds (got {self.timeout})")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0 (got {self.retries})")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ValueError(f"backoff must be >= 0 (got {self.backoff_s}, max {self.max_backoff_s})")

    @property
    def attempts(self) -> int:
        return self.retries + 1

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1-based)."""
        wait = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.9, 1.1)
        if retry_after is not None:
            wait = max(wait, min(self.max_backoff_s, retry_after))
        return wait


class ServerHealth:
    """Remembers servers that failed, so that later calls send their shards to live ones first.

    A server that failed is "cooling" for ``cooldown_s`` seconds, doubled for each consecutive
    failure (at most ``max_cooldown_s``); a success clears it. Cooling servers are still tried, last,
    when no live server is left."""

    def __init__(self, cooldown_s: float = 30.0, max_cooldown_s: float = 600.0):
        self.cooldown_s, self.max_cooldown_s = cooldown_s, max_cooldown_s
        self._until: dict[str, float] = {}
        self._streak: dict[str, int] = {}

    def failed(self, url: str) -> None:
        streak = self._streak.get(url, 0) + 1
        self._streak[url] = streak
        self._until[url] = time.monotonic() + min(self.max_cooldown_s, self.cooldown_s * 2 ** (streak - 1))

    def ok(self, url: str) -> None:
        self._until.pop(url, None)
        self._streak.pop(url, None)

    def cooling(self, url: str) -> bool:
        return self._until.get(url, 0.0) > time.monotonic()

    def order(self, urls: Sequence[str]) -> list[str]:
        """``urls`` with the live ones first (order kept within each group)."""
        urls = list(dict.fromkeys(urls))
        return [u for u in urls if not self.cooling(u)] + [u for u in urls if self.cooling(u)]


def httpx_timeout(timeout: float):
    import httpx

    return httpx.Timeout(timeout, connect=min(timeout, 10.0))


def _retry_after(response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None
    return seconds if seconds is not None and math.isfinite(seconds) and seconds >= 0 else None


async def _attempt(http, url: str, payload: dict, timeout: float) -> tuple[str, Any, float | None]:
    """One POST, bounded by ``timeout`` in all: ``("ok", decoded JSON, None)``, ``("retry", cause,
    retry_after)`` or ``("fail", cause, None)`` (not worth repeating on this server)."""
    import httpx

    try:
        response = await asyncio.wait_for(http.post(url, json=payload), timeout)
    except asyncio.TimeoutError:
        return "retry", f"no answer within {timeout:g} s", None
    except httpx.TimeoutException as err:
        return "retry", f"no answer within {timeout:g} s ({type(err).__name__})", None
    except httpx.TransportError as err:
        return "retry", f"{type(err).__name__}: {err or 'connection failed'}", None
    code = response.status_code
    if code == 200:
        try:
            return "ok", response.json(), None
        except ValueError:
            return "fail", f"answered with something that is not JSON: {response.text[:200]!r}", None
    reason = response_reason(response)
    if code in (408, 429) or code >= 500:
        return "retry", f"HTTP {code}: {reason}", _retry_after(response)
    return "fail", f"rejected the request: HTTP {code}: {reason}", None


class FailoverCall:
    """What the shards of one call share: the servers given up on (``failed``: URL -> cause) and the
    servers being tried right now. A shard looking for another server takes one nobody is trying,
    or waits for the outcome of one being tried, so no two shards wait on the same dead server."""

    def __init__(self):
        self.failed: dict[str, str] = {}
        self._busy: dict[str, int] = {}
        self._event: asyncio.Event | None = None

    def busy(self, url: str) -> bool:
        return self._busy.get(url, 0) > 0

    def enter(self, url: str) -> None:
        self._busy[url] = self._busy.get(url, 0) + 1

    def leave(self, url: str) -> None:
        self._busy[url] -= 1
        if self._event is not None:
            self._event.set()
            self._event = None

    async def changed(self) -> None:
        if self._event is None:
            self._event = asyncio.Event()
        await self._event.wait()


async def post_with_failover(http, urls: Sequence[str], payload: dict, policy: RetryPolicy, *,
                             start: str | None = None, health: ServerHealth | None = None,
                             call: FailoverCall | None = None, log: Callable[[str], None] = stderr_line,
                             check: Callable[[Any], str | None] | None = None, label: str = "server",
                             describe: str = "the request") -> tuple[str, Any]:
    """POST ``payload`` to ``start`` (default: the first of ``urls``) with ``policy``; when that server
    fails, to the next of ``urls`` not yet failed, and so on. Returns ``(url, decoded answer)``.

    ``check(answer)`` returns why an answer is unusable (that server then counts as failed).
    ``call`` (:class:`FailoverCall`) is shared by the shards of one call, so that a server one shard
    gave up on is not tried again by another; ``health`` remembers failures across calls. Every
    failed attempt is reported through ``log`` as ``[rlhforge] {label} URL: ...``. Raises
    :class:`~rlhforge.net.errors.ServiceError` naming every server tried when none succeeds."""
    call = FailoverCall() if call is None else call
    failed = call.failed
    urls = list(dict.fromkeys(urls))
    if start is not None and start in urls:
        k = urls.index(start)
        urls = urls[k:] + urls[:k]
    tried: list[str] = []
    while True:
        candidates = [u for u in urls if u not in failed and u not in tried]
        if not candidates:
            break
        url = next((u for u in candidates if not call.busy(u)), None)
        if url is None:  # every server left is being tried by another shard: wait for an outcome
            await call.changed()
            continue
        tried.append(url)
        call.enter(url)
        try:
            for attempt in range(1, policy.attempts + 1):
                status, value, retry_after = await _attempt(http, url, payload, policy.timeout)
                if status == "ok":
                    problem = check(value) if check is not None else None
                    if problem is None:
                        if health is not None:
                            health.ok(url)
                        return url, value
                    status, value = "fail", problem
                if status == "retry" and attempt < policy.attempts:
                    wait = policy.delay(attempt, retry_after)
                    log(f"[rlhforge] {label} {url}: attempt {attempt}/{policy.attempts} failed: {value}; "
                        f"retrying in {wait:.2g} s")
                    await asyncio.sleep(wait)
                    continue
                cause = value
                if status == "retry":
                    plural = "s" if policy.attempts > 1 else ""
                    cause = f"failed after {policy.attempts} attempt{plural}; last error: {value}"
                failed.setdefault(url, cause)
                if health is not None:
                    health.failed(url)
                nxt = next((u for u in urls if u not in failed and u not in tried), None)
                then = (f"sending {describe} to {nxt}" if nxt else
                        f"no other {label} left" if len(urls) > 1 else "giving up")
                log(f"[rlhforge] {label} {url}: attempt {attempt}/{policy.attempts} failed: {value}; {then}")
                break
        finally:
            call.leave(url)
    causes = {u: failed[u] for u in urls if u in failed}
    first = next(iter(causes), urls[0] if urls else "")
    if len(causes) == 1:
        message = f"{label} {first} {causes[first]}"
    else:
        message = (f"all {len(causes)} {label}s failed: "
                   + "; ".join(f"{u} {c}" for u, c in causes.items()))
    raise ServiceError(message, first, causes)


def response_reason(response) -> str:
    """A short reason from an HTTP error response: its JSON ``error``/``detail``, else its text."""
    try:
        data = response.json()
        if isinstance(data, dict) and ("error" in data or "detail" in data):
            return str(data.get("error") or data.get("detail"))
    except ValueError:
        pass
    return response.text[:200] or response.reason_phrase


