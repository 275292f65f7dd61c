"""Client of remote reward servers (OpenRLHF's protocol; ``rlhforge serve-rm`` or any compatible server).

``RemoteRewardClient("http://h1:5000/get_reward,http://h2:5000/get_reward")`` splits a batch of
queries into contiguous shards, one per URL (sizes differ by at most one), posts them
concurrently (``{"query", "prompts", "labels"}``) and concatenates the answers in order::

    client = RemoteRewardClient(urls, timeout=180, max_attempts=5)
    result = await client.get_rewards(queries, prompts, labels)    # or client.get_rewards_sync(...)
    result.rewards, result.scores, result.extra_logs

Failures: connection errors, timeouts, HTTP 429 and 5xx are retried with exponential backoff
(``backoff_s * 2**k``, capped at ``max_backoff_s``, with +-10% jitter) up to ``max_attempts`` tries
per shard; then :class:`RewardServerError` names the URL, the number of attempts and the last
error. Other 4xx answers (a malformed request) and answers that break the protocol (not JSON, no
``rewards``, wrong length) fail at once, also naming the URL. ``scores`` defaults to ``rewards``
when the server sends none (as OpenRLHF does).

:func:`post_json` is the same retry policy for one URL and one payload (callers that shard and
validate themselves, such as the RL trainer's ``RemoteReward``).

API keys (``rlhforge serve-rm --api_key``): requests carry ``Authorization: Bearer KEY``, the header
the server checks. The key is ``api_key=`` where given (``rlhforge rl`` passes ``--reward.api_key``),
else the ``RLHFORGE_REWARD_API_KEY`` environment variable. The key is never part of a message or log line.

:func:`wait_for_reward_servers` probes servers before a run loads its models (one empty request
each; a refused key, a wrong path or silence is reported at once, or after waiting).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

__all__ = ["RemoteRewardClient", "RewardResult", "RewardServerError", "post_json", "shard_bounds", "API_KEY_ENV",
           "default_api_key", "auth_headers", "wait_for_reward_servers"]

#: environment variable with the reward servers' API key (used when no key is set explicitly)
API_KEY_ENV = "RLHFORGE_REWARD_API_KEY"


def default_api_key() -> str | None:
    """``$RLHFORGE_REWARD_API_KEY``, else None."""
    return os.environ.get(API_KEY_ENV) or None


def auth_headers(api_key: str | None = None) -> dict[str, str]:
    """``{"Authorization": "Bearer KEY"}`` for ``api_key`` (None: :func:`default_api_key`), or ``{}``."""
    key = api_key if api_key is not None else default_api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


class RewardServerError(RuntimeError):
    """A reward server could not be used; ``url`` says which."""

    def __init__(self, message: str, url: str):
        super().__init__(message)
        self.url = url


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


class RemoteRewardClient:
    """Async client for one or several reward-server URLs (see the module docstring)."""

    def __init__(self, urls: str | Sequence[str], *, timeout: float = 180.0, max_attempts: int = 5,
                 backoff_s: float = 1.0, max_backoff_s: float = 30.0, api_key: str | None = None,
                 headers: dict[str, str] | None = None):
        if isinstance(urls, str):
            urls = [u.strip() for u in urls.split(",")]
        self.urls = [u for u in urls if u]
        if not self.urls:
            raise ValueError("no reward server URL given")
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"reward server URL {url!r} must start with http:// or https://")
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1 (got {max_attempts})")
        self.timeout, self.max_attempts = timeout, max_attempts
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.headers = {**auth_headers(api_key), **(headers or {})}

    async def get_rewards(self, queries: Sequence[str], prompts: Sequence[str] | None = None,
                          labels: Sequence[Any] | None = None) -> RewardResult:
        """Rewards of ``queries`` (whole texts), in order."""
        import httpx

        queries = list(queries)
        for name, values in (("prompts", prompts), ("labels", labels)):
            if values is not None and len(values) != len(queries):
                raise ValueError(f"{name} has {len(values)} entries but queries has {len(queries)}")
        bounds = [(s, e) for s, e in shard_bounds(len(queries), len(self.urls))]
        async with httpx.AsyncClient(timeout=self.timeout, headers=self.headers) as http:
            tasks = []
            for url, (s, e) in zip(self.urls, bounds):
                if e == s:
                    continue
                payload = {"query": queries[s:e],
                           "prompts": list(prompts[s:e]) if prompts is not None else None,
                           "labels": list(labels[s:e]) if labels is not None else None}
                tasks.append(self._post(http, url, payload, e - s))
            results = await asyncio.gather(*tasks)
        rewards: list[float] = []
        scores: list[float] = []
        extra: dict[str, Any] = {}
        for part in results:
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

    async def _post(self, http, url: str, payload: dict, expected: int) -> RewardResult:
        response = await _post_with_retries(http, url, payload, timeout=self.timeout, max_attempts=self.max_attempts,
                                            backoff_s=self.backoff_s, max_backoff_s=self.max_backoff_s)
        return self._parse(url, response, expected)

    @staticmethod
    def _parse(url: str, response, expected: int) -> RewardResult:
        try:
            data = response.json()
        except ValueError:
            raise RewardServerError(f"reward server {url} answered with something that is not JSON: "
                                    f"{response.text[:200]!r}", url) from None
        rewards = data.get("rewards") if isinstance(data, dict) else None
        if not isinstance(rewards, list) or len(rewards) != expected:
            got = f"{len(rewards)} rewards" if isinstance(rewards, list) else "no 'rewards' list"
            raise RewardServerError(f"reward server {url} answered with {got} for {expected} queries", url)
        scores = data.get("scores")
        if not isinstance(scores, list) or len(scores) != expected:
            scores = rewards
        extra = data.get("extra_logs") or {}
        return RewardResult([float(r) for r in rewards], [float(s) for s in scores],
                            extra if isinstance(extra, dict) else {})


async def _post_with_retries(http, url: str, payload: dict, *, timeout: float, max_attempts: int, backoff_s: float,
                             max_backoff_s: float):
    """POST ``payload``; retry transport errors, timeouts, 429 and 5xx with exponential backoff;
    return the 200 response. Other 4xx, and exhausting the attempts, raise :class:`RewardServerError`."""
    import httpx

    last = "no attempt made"
    for attempt in range(1, max_attempts + 1):
        try:
            response = await http.post(url, json=payload)
        except httpx.TimeoutException as err:
            last = f"timed out after {timeout:g}s ({type(err).__name__})"
        except httpx.TransportError as err:
            last = f"{type(err).__name__}: {err or 'connection failed'}"
        else:
            if response.status_code == 200:
                return response
            reason = _reason(response)
            if response.status_code != 429 and response.status_code < 500:
                raise RewardServerError(
                    f"reward server {url} rejected the request: HTTP {response.status_code}: {reason}", url
                )
            last = f"HTTP {response.status_code}: {reason}"
        if attempt < max_attempts:
            delay = min(max_backoff_s, backoff_s * 2 ** (attempt - 1)) * random.uniform(0.9, 1.1)
            await asyncio.sleep(delay)
    raise RewardServerError(f"reward server {url} failed after {max_attempts} attempts; last error: {last}", url)


async def post_json(url: str, payload: dict, timeout: float = 180.0, *, max_attempts: int = 5, backoff_s: float = 1.0,
                    max_backoff_s: float = 30.0, headers: dict[str, str] | None = None) -> Any:
    """POST one JSON payload to ``url`` with the client's retry policy; returns the decoded answer.

    For callers that shard and validate themselves (``rlhforge.rewards.sources.RemoteReward``).
    ``headers=None`` sends the environment's API key (:func:`auth_headers`). Raises
    :class:`RewardServerError` (naming ``url``) when every attempt fails or the answer is not JSON."""
    import httpx

    async with httpx.AsyncClient(timeout=timeout, headers=auth_headers() if headers is None else headers) as http:
        response = await _post_with_retries(http, url, payload, timeout=timeout, max_attempts=max_attempts,
                                            backoff_s=backoff_s, max_backoff_s=max_backoff_s)
    try:
        return response.json()
    except ValueError:
        raise RewardServerError(f"reward server {url} answered with something that is not JSON: "
                                f"{response.text[:200]!r}", url) from None


def _reason(response) -> str:
    try:
        data = response.json()
        if isinstance(data, dict) and ("error" in data or "detail" in data):
            return str(data.get("error") or data.get("detail"))
    except ValueError:
        pass
    return response.text[:200] or response.reason_phrase


def _probe(url: str, headers: dict[str, str], timeout: float) -> tuple[str, str]:
    """One empty request to ``url``: ``("ok" | "retry" | "fatal", reason)``."""
    import httpx

    try:
        response = httpx.post(url, json={"query": [], "prompts": [], "labels": []}, headers=headers,
                              timeout=httpx.Timeout(timeout, connect=min(timeout, 3.0)))
    except httpx.ConnectTimeout:
        return "retry", "connection timed out"
    except httpx.TimeoutException:
        return "ok", "connected, but the answer took longer than the probe waits"
    except httpx.TransportError as err:
        return "retry", f"{type(err).__name__}: {err or 'connection failed'}"
    code = response.status_code
    if code in (401, 403):
        sent = "the API key sent was refused" if "Authorization" in headers else "no API key was sent"
        return "fatal", f"rejected the request: HTTP {code}: {_reason(response)} ({sent})"
    if code == 404:
        return "fatal", ("HTTP 404: the server has no such path (rlhforge serve-rm and OpenRLHF's server answer "
                         "on /get_reward)")
    if code in (502, 503, 504):
        return "retry", f"HTTP {code}: {_reason(response)}"
    return "ok", f"HTTP {code}"  # any other answer: the server is up (an empty batch may be a 4xx/5xx there)


def wait_for_reward_servers(urls: Sequence[str], *, api_key: str | None = None, wait_s: float = 0.0,
                            timeout: float = 5.0, require: str = "all",
                            log: Callable[[str], None] = lambda msg: print(msg, flush=True)) -> None:
    """Probe each of ``urls`` with an empty request (``{"query": [], ...}``) before a run starts.

    A refused API key (401/403) or an unknown path (404) raises :class:`RewardServerError` at once;
    no connection (or 502-504) is retried until ``wait_s`` seconds have passed (0: no retry), with a
    progress line through ``log`` about every 10 s. ``require="any"``: one answering server is
    enough (a live endpoints list). The key is sent as :func:`auth_headers` does; it never appears
    in a message."""
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
            if status == "ok":
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
