"""Client of remote reward servers (OpenRLHF's protocol; ``rlhforge serve-rm`` or any compatible server).

``RemoteRewardClient("http://h1:5000/get_reward,http://h2:5000/get_reward")`` splits a batch of
queries into contiguous shards, one per live URL (sizes differ by at most one), posts them
concurrently (``{"query", "prompts", "labels"}``) and concatenates the answers in order::

    client = RemoteRewardClient(urls, policy=RetryPolicy(timeout=60, retries=2))
    result = await client.get_rewards(queries, prompts, labels)    # or client.get_rewards_sync(...)
    result.rewards, result.scores, result.extra_logs

Failures (:class:`RetryPolicy`, ``rlhforge rl --reward.timeout / --reward.retries /
--reward.retry_backoff_s``):

- every attempt is bounded by ``timeout`` seconds in all (connect + send + answer), so a server that
  accepts connections and never answers costs at most ``timeout`` per attempt;
- connection errors, timeouts, HTTP 408, 429 and 5xx are retried on the same server ``retries``
  times, waiting ``backoff_s * 2**k`` (capped at ``max_backoff_s``, +-10% jitter; a ``Retry-After``
  header is honoured up to the cap);
- every failed attempt prints one line (stderr): URL, ``attempt k/n``, the cause and what happens
  next (the wait, or the server the shard moves to);
- a server that used up its attempts, answered another 4xx or broke the protocol (not JSON, no
  ``rewards`` list, wrong length) is given up for that shard, which moves to the next server not
  yet failed (failover); the failed server is skipped by later calls for a cool-down (30 s,
  doubling with each consecutive failure up to 10 min) while others are live;
- when every server has failed for a shard, :class:`RewardServerError` names each URL with its
  cause. It is a :class:`~rlhforge.rewards.base.RewardError`: ``rlhforge rl`` stops with exit 3.

``scores`` defaults to ``rewards`` when the server sends none (as OpenRLHF does).

:func:`post_with_failover` is this policy for one payload over a list of URLs (used by the RL
trainer's :class:`~rlhforge.rewards.sources.RemoteReward`, which shards and validates itself);
:func:`post_json` the same for one URL.

API keys (``rlhforge serve-rm --api_key``): requests carry ``Authorization: Bearer KEY``, the header
the server checks. The key is ``api_key=`` where given (``rlhforge rl`` passes ``--reward.api_key``),
else the ``RLHFORGE_REWARD_API_KEY`` environment variable. The key is never part of a message or log line.

:func:`wait_for_reward_servers` probes servers before a run loads its models (one empty request
each; a refused key, a wrong path or silence is reported at once, or after waiting).
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from rlhforge.rewards.base import RewardError

__all__ = ["RemoteRewardClient", "RewardResult", "RewardServerError", "RetryPolicy", "ServerHealth", "FailoverCall",
           "post_with_failover", "check_rewards_answer", "post_json", "shard_bounds", "API_KEY_ENV", "default_api_key", "auth_headers",
           "wait_for_reward_servers"]

#: environment variable with the reward servers' API key (used when no key is set explicitly)
API_KEY_ENV = "RLHFORGE_REWARD_API_KEY"


def default_api_key() -> str | None:
    """``$RLHFORGE_REWARD_API_KEY``, else None."""
    return os.environ.get(API_KEY_ENV) or None


def auth_headers(api_key: str | None = None) -> dict[str, str]:
    """``{"Authorization": "Bearer KEY"}`` for ``api_key`` (None: :func:`default_api_key`), or ``{}``."""
    key = api_key if api_key is not None else default_api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


class RewardServerError(RewardError):
    """Reward servers could not be used. ``url``: the (first) server that failed; ``causes``: URL ->
    why it failed, for every server tried."""

    def __init__(self, message: str, url: str, causes: dict[str, str] | None = None):
        super().__init__(message)
        self.url = url
        self.causes = dict(causes) if causes else {url: message}


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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


@dataclass
class RewardResult:
    rewards: list[float]
    scores: list[float]
    extra_logs: dict[str, Any] = field(default_factory=dict)


def shard_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` ranges splitting ``n`` items into ``parts`` (sizes differ by <= 1;
    empty ranges when ``n < parts``)."""
    base, extra = divmod(n, parts)
    bounds, start = [], 0
    for k in range(parts):
        end = start + base + (1 if k < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def check_rewards_answer(data: Any, expected: int) -> str | None:
    """Why ``data`` is not a valid answer for ``expected`` queries (None: it is)."""
    rewards = data.get("rewards") if isinstance(data, dict) else None
    if not isinstance(rewards, list):
        return f"answered {str(data)[:200]!r}; expected JSON with a 'rewards' list"
    if len(rewards) != expected:
        return f"answered with {len(rewards)} rewards for {expected} queries"
    return None


class RemoteRewardClient:
    """Async client for one or several reward-server URLs (see the module docstring).

    ``policy`` sets timeout, retries and backoff; the older keywords (``timeout``, ``max_attempts`` =
    retries + 1, ``backoff_s``, ``max_backoff_s``) build one when no policy is given."""

    def __init__(self, urls: str | Sequence[str], *, policy: RetryPolicy | None = None, timeout: float = 180.0,
                 max_attempts: int = 3, backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 api_key: str | None = None, headers: dict[str, str] | None = None,
                 log: Callable[[str], None] = _stderr, health: ServerHealth | None = None):
        if isinstance(urls, str):
            urls = [u.strip() for u in urls.split(",")]
        self.urls = [u for u in urls if u]
        if not self.urls:
            raise ValueError("no reward server URL given")
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"reward server URL {url!r} must start with http:// or https://")
        if policy is None:
            if max_attempts < 1:
                raise ValueError(f"max_attempts must be >= 1 (got {max_attempts})")
            policy = RetryPolicy(timeout=timeout, retries=max_attempts - 1, backoff_s=backoff_s,
                                 max_backoff_s=max_backoff_s)
        self.policy = policy
        self.headers = {**auth_headers(api_key), **(headers or {})}
        self.log = log
        self.health = health or ServerHealth()

    @property
    def timeout(self) -> float:
        return self.policy.timeout

    async def get_rewards(self, queries: Sequence[str], prompts: Sequence[str] | None = None,
                          labels: Sequence[Any] | None = None) -> RewardResult:
        """Rewards of ``queries`` (whole texts), in order."""
        import httpx

        queries = list(queries)
        for name, values in (("prompts", prompts), ("labels", labels)):
            if values is not None and len(values) != len(queries):
                raise ValueError(f"{name} has {len(values)} entries but queries has {len(queries)}")
        order = self.health.order(self.urls)
        live = [u for u in order if not self.health.cooling(u)] or order
        bounds = shard_bounds(len(queries), len(live))
        async with httpx.AsyncClient(timeout=_httpx_timeout(self.policy.timeout), headers=self.headers) as http:
            tasks = []
            call = FailoverCall()
            for k, (s, e) in enumerate(bounds):
                if e == s:
                    continue
                payload = {"query": queries[s:e],
                           "prompts": list(prompts[s:e]) if prompts is not None else None,
                           "labels": list(labels[s:e]) if labels is not None else None}
                tasks.append(post_with_failover(http, order, payload, self.policy, start=live[k], health=self.health,
                                                call=call, log=self.log,
                                                check=lambda data, n=e - s: check_rewards_answer(data, n)))
            results = await asyncio.gather(*tasks)
        rewards: list[float] = []
        scores: list[float] = []
        extra: dict[str, Any] = {}
        for _url, data in results:
            part = self._parse(data)
            rewards += part.rewards
            scores += part.scores
            for key, value in part.extra_logs.items():
                if isinstance(value, list):
                    extra.setdefault(key, []).extend(value)
                else:
                    extra.setdefault(key, []).append(value)
        return RewardResult(rewards, scores, extra)

    def get_rewards_sync(self, queries, prompts=None, labels=None) -> RewardResult:
        """Blocking :meth:`get_rewards` (not from inside a running event loop)."""
        return asyncio.run(self.get_rewards(queries, prompts, labels))

    @staticmethod
    def _parse(data: dict) -> RewardResult:
        rewards = data["rewards"]
        scores = data.get("scores")
        if not isinstance(scores, list) or len(scores) != len(rewards):
            scores = rewards
        extra = data.get("extra_logs") or {}
        return RewardResult([float(r) for r in rewards], [float(s) for s in scores],
                            extra if isinstance(extra, dict) else {})


def _httpx_timeout(timeout: float):
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
                             call: FailoverCall | None = None, log: Callable[[str], None] = _stderr,
                             check: Callable[[Any], str | None] | None = None) -> tuple[str, Any]:
    """POST ``payload`` to ``start`` (default: the first of ``urls``) with ``policy``; when that server
    fails, to the next of ``urls`` not yet failed, and so on. Returns ``(url, decoded answer)``.

    ``check(answer)`` returns why an answer is unusable (that server then counts as failed).
    ``call`` (:class:`FailoverCall`) is shared by the shards of one call, so that a server one shard
    gave up on is not tried again by another; ``health`` remembers failures across calls. Every
    failed attempt is reported through ``log``. Raises :class:`RewardServerError` naming every server
    tried when none succeeds."""
    call = FailoverCall() if call is None else call
    failed = call.failed
    urls = list(dict.fromkeys(urls))
    if start is not None and start in urls:
        k = urls.index(start)
        urls = urls[k:] + urls[:k]
    n = len(payload.get("query") or [])
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
                    log(f"[rlhforge] reward server {url}: attempt {attempt}/{policy.attempts} failed: {value}; "
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
                then = (f"sending its {n} queries to {nxt}" if nxt else
                        "no other reward server left" if len(urls) > 1 else "giving up")
                log(f"[rlhforge] reward server {url}: attempt {attempt}/{policy.attempts} failed: {value}; {then}")
                break
        finally:
            call.leave(url)
    causes = {u: failed[u] for u in urls if u in failed}
    first = next(iter(causes), urls[0] if urls else "")
    if len(causes) == 1:
        message = f"reward server {first} {causes[first]}"
    else:
        message = (f"all {len(causes)} reward servers failed: "
                   + "; ".join(f"{u} {c}" for u, c in causes.items()))
    raise RewardServerError(message, first, causes)


async def post_json(url: str, payload: dict, timeout: float = 180.0, *, max_attempts: int = 3, backoff_s: float = 1.0,
                    max_backoff_s: float = 30.0, headers: dict[str, str] | None = None,
                    log: Callable[[str], None] = _stderr) -> Any:
    """POST one JSON payload to ``url`` with the client's retry policy; returns the decoded answer.

    ``headers=None`` sends the environment's API key (:func:`auth_headers`). Raises
    :class:`RewardServerError` (naming ``url``) when every attempt fails or the answer is not JSON."""
    import httpx

    policy = RetryPolicy(timeout=timeout, retries=max_attempts - 1, backoff_s=backoff_s, max_backoff_s=max_backoff_s)
    async with httpx.AsyncClient(timeout=_httpx_timeout(timeout),
                                 headers=auth_headers() if headers is None else headers) as http:
        _url, data = await post_with_failover(http, [url], payload, policy, log=log)
    return data


def response_reason(response) -> str:
    """A short reason from an HTTP error response: its JSON ``error``/``detail``, else its text."""
    try:
        data = response.json()
        if isinstance(data, dict) and ("error" in data or "detail" in data):
            return str(data.get("error") or data.get("detail"))
    except ValueError:
        pass
    return response.text[:200] or response.reason_phrase


def _probe(url: str, headers: dict[str, str], timeout: float) -> tuple[str, str]:
    """One empty request to ``url``: ``("ok" | "slow" | "retry" | "fatal", reason)``; ``slow``: it took
    the connection but did not answer within ``timeout`` (a busy or frozen server)."""
    import httpx

    try:
        response = httpx.post(url, json={"query": [], "prompts": [], "labels": []}, headers=headers,
                              timeout=httpx.Timeout(timeout, connect=min(timeout, 3.0)))
    except httpx.ConnectTimeout:
        return "retry", "connection timed out"
    except httpx.TimeoutException:
        return "slow", f"accepted the connection but sent no answer to an empty request within {timeout:g} s"
    except httpx.TransportError as err:
        return "retry", f"{type(err).__name__}: {err or 'connection failed'}"
    code = response.status_code
    if code in (401, 403):
        sent = "the API key sent was refused" if "Authorization" in headers else "no API key was sent"
        return "fatal", f"rejected the request: HTTP {code}: {response_reason(response)} ({sent})"
    if code == 404:
        return "fatal", ("HTTP 404: the server has no such path (rlhforge serve-rm and OpenRLHF's server answer "
                         "on /get_reward)")
    if code in (502, 503, 504):
        return "retry", f"HTTP {code}: {response_reason(response)}"
    return "ok", f"HTTP {code}"  # any other answer: the server is up (an empty batch may be a 4xx/5xx there)


def wait_for_reward_servers(urls: Sequence[str], *, api_key: str | None = None, wait_s: float = 0.0,
                            timeout: float = 5.0, require: str = "all",
                            log: Callable[[str], None] = lambda msg: print(msg, flush=True)) -> None:
    """Probe each of ``urls`` with an empty request (``{"query": [], ...}``) before a run starts.

    A refused API key (401/403) or an unknown path (404) raises :class:`RewardServerError` at once;
    no connection (or 502-504) is retried until ``wait_s`` seconds have passed (0: no retry), with a
    progress line through ``log`` about every 10 s. A server that takes the connection but does not
    answer within ``timeout`` counts as up (it may be busy), with one warning line through ``log``:
    during the run its requests time out and fail over (:class:`RetryPolicy`). ``require="any"``:
    one answering server is enough (a live endpoints list). The key is sent as :func:`auth_headers`
    does; it never appears in a message."""
    headers = auth_headers(api_key)
    pending = list(dict.fromkeys(urls))
    start = time.monotonic()
    deadline = start + max(0.0, wait_s)
    last_log = None
    while True:
        reasons: dict[str, str] = {}
        for url in pending:
            status, reason = _probe(url, headers, timeout)
            if status == "fatal":
                raise RewardServerError(f"reward server {url} {reason}", url)
            if status == "slow":
                log(f"[rlhforge] warning: reward server {url} {reason}; starting anyway (a busy server may be "
                    "slow), its requests during the run are bounded by --reward.timeout")
            if status in ("ok", "slow"):
                if require == "any":
                    return
            else:
                reasons[url] = reason
        pending = [u for u in pending if u in reasons]
        if not pending:
            return
        now = time.monotonic()
        if now >= deadline:
            url = pending[0]
            waited = f" after waiting {wait_s:g} s" if wait_s > 0 else ""
            raise RewardServerError(f"reward server {url} does not answer{waited}: {reasons[url]}", url)
        if last_log is None or now - last_log >= 10.0:
            log(f"[rlhforge] waiting for reward server {', '.join(pending)} ({now - start:.0f} s of {wait_s:g} s): "
                f"{reasons[pending[0]]}")
            last_log = now
        time.sleep(min(1.0, max(0.0, deadline - now)))
