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
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from rlhforge.net import client as _net
from rlhforge.net.client import FailoverCall, RetryPolicy, ServerHealth, response_reason
from rlhforge.net.client import httpx_timeout as _httpx_timeout
from rlhforge.net.client import stderr_line as _stderr
from rlhforge.net.errors import ServiceError
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


class RewardServerError(RewardError, ServiceError):
    """Reward servers could not be used. ``url``: the (first) server that failed; ``causes``: URL ->
    why it failed, for every server tried."""

    def __init__(self, message: str, url: str, causes: dict[str, str] | None = None):
        ServiceError.__init__(self, message, url, causes)


async def post_with_failover(http, urls: Sequence[str], payload: dict, policy: RetryPolicy, *,
                             start: str | None = None, health: ServerHealth | None = None,
                             call: FailoverCall | None = None, log: Callable[[str], None] = _stderr,
                             check: Callable[[Any], str | None] | None = None) -> tuple[str, Any]:
    """:func:`rlhforge.net.client.post_with_failover` for reward servers: lines and errors say "reward server",
    a shard that moves says how many queries it carries, and the final failure is a :class:`RewardServerError`
    (a :class:`~rlhforge.rewards.base.RewardError`: ``rlhforge rl`` stops with exit 3)."""
    n = len(payload.get("query") or [])
    try:
        return await _net.post_with_failover(http, urls, payload, policy, start=start, health=health, call=call,
                                             log=log, check=check, label="reward server",
                                             describe=f"its {n} queries")
    except RewardServerError:
        raise
    except ServiceError as err:
        raise RewardServerError(str(err), err.url, err.causes) from None


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
