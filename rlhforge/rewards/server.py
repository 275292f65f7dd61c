"""HTTP reward server over a reward model, speaking OpenRLHF's remote-RM protocol.

``POST /get_reward`` with JSON ``{"query": [str, ...], "prompts": [str, ...], "labels": [...]}``
(``prompts``/``labels`` optional; when given, as long as ``query``) returns::

    {"rewards": [float, ...], "scores": [float, ...], "extra_logs": {"raw_reward": [float, ...]}}

``query[i]`` is the whole text to score (prompt + response, already chat-formatted). It is
tokenised like the reward model's training sequences (:func:`rlhforge.models.reward.encode_reward_text`:
EOS appended unless present, truncated to ``max_len`` tokens keeping the start; a text far longer
than ``max_len`` tokens is cut before tokenising, see :meth:`RewardScorer.encode`), and the reward
is the value head at the last token. ``rewards`` and ``scores`` are the same list (normalised to
``(r - mean) / std`` with ``normalize``); ``extra_logs.raw_reward`` always holds the unnormalised rewards.

``GET /health`` returns ``{"status": "ok", ...}`` with request/batch counters (no key needed).

Every request is checked on its own before it joins a batch, so a bad one never touches the
requests batched with it:

- 401: missing or wrong API key (``Authorization: Bearer KEY`` or ``X-API-Key: KEY``);
- 503 with ``Retry-After`` (seconds): ``max_queue`` requests are already admitted and unanswered;
- 413: the body is longer than ``max_request_bytes`` (checked against ``Content-Length`` before
  reading, and counted while a chunked body streams; the body is never parsed);
- 408: the body did not arrive within ``body_timeout_s`` (``--body_timeout_s``);
- 400 ``{"error": "<reason>"}``: not JSON (bad syntax or encoding, empty, nesting too deep, an integer
  with more than 4300 digits; :func:`rlhforge.net.payload.parse_json`), not an object, no ``query`` list
  of strings, a query that is not valid Unicode (a lone surrogate such as ``"\ud800"``),
  ``prompts``/``labels`` not lists of the same length, a query the tokenizer refuses;
- 500: the model failed on this request (a failed batch is re-run request by request, so only the
  requests that fail themselves get it), or produced a non-finite reward.

Every answer is a complete HTTP response, so a keep-alive connection stays usable after an error
(except an answer sent before a body of more than 1 MiB, or of unknown length, was read: that one
closes the connection). A client that disconnects mid-body is one log line, never a 500 (nor counted
as one in ``/health``); request headers must arrive within ``--header_timeout_s``
(:mod:`rlhforge.net.server`, :mod:`rlhforge.net.guard`).

Batching: parsing and tokenising run on one worker thread, the model on another; a batcher pools
the queries of every request that arrives within ``max_wait_ms`` of the first (up to
``batch_size`` queries), runs them sorted by length in forward passes of at most ``batch_size``
sequences, and answers each request with its own slice. The event loop stays responsive meanwhile.

Shutdown (``rlhforge serve-rm``): SIGTERM or SIGINT stops accepting connections, finishes every
request already received (up to ``--graceful_shutdown_s``), then exits with status 0.

:func:`start_server_thread` runs a server in a background thread (tests, in-process use).
"""

# No ``from __future__ import annotations``: FastAPI must see the real ``Request`` annotation of the
# route functions, which are defined inside ``create_app`` (fastapi is imported lazily).
import asyncio
import contextlib
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from rlhforge.net.errors import BadRequest, ClientGone, HTTPError
from rlhforge.net.guard import BodyLimits, RequestGuard
from rlhforge.net.payload import check_text, parse_json
from rlhforge.net.server import ServerHandle, ServerLimits, key_matches, run_server, start_server_thread

__all__ = ["RewardScorer", "create_app", "start_server_thread", "ServerHandle", "serve", "DEFAULT_MAX_REQUEST_BYTES",
           "DEFAULT_MAX_QUEUE"]

logger = logging.getLogger(__name__)

#: default ``--max_request_bytes`` (32 MiB) and ``--max_queue``
DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20
DEFAULT_MAX_QUEUE = 256


class RewardScorer:
    """Scores whole texts with a reward model (thread-compatible: one call at a time)."""

    def __init__(self, model, tokenizer, *, max_len: int = 2048, batch_size: int = 32, batch_tokens: int = 16384,
                 packed: bool = False,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 value_head_prefix: str = "score", normalize: tuple[float, float] | None = None):
        from rlhforge.models.reward import value_head

        self.model, self.tokenizer = model.eval(), tokenizer
        self.max_len, self.batch_size, self.packed = max_len, batch_size, packed
        self.batch_tokens = batch_tokens
        self.device, self.dtype = torch.device(device), dtype
        self.value_head_prefix, self.normalize = value_head_prefix, normalize
        value_head(model, value_head_prefix)
        if tokenizer.pad_token_id is None:
            raise ValueError("the reward model's tokenizer has no pad token")

    @classmethod
    def from_config(cls, cfg) -> "RewardScorer":
        """Load the model of a :class:`rlhforge.config.serve_rm.ServeRMConfig`."""
        from rlhforge.backend.device import resolve_device, resolve_dtype
        from rlhforge.config.components import DSConfig, ModelConfig
        from rlhforge.models.loading import load_tokenizer
        from rlhforge.models.reward import load_reward_model, reward_stats

        path = cfg.reward.model_name_or_path
        device = resolve_device(cfg.device)
        dtype = resolve_dtype(cfg.ds.param_dtype, device)
        tokenizer = load_tokenizer(path, use_fast=not cfg.data.disable_fast_tokenizer)
        ds = DSConfig(attn_implementation=cfg.ds.attn_implementation, load_in_4bit=cfg.ds.load_in_4bit,
                      param_dtype=cfg.ds.param_dtype)
        model = load_reward_model(path, ModelConfig(), ds, device, pad_token_id=tokenizer.pad_token_id,
                                  value_head_prefix=cfg.ds.value_head_prefix)
        if not cfg.ds.load_in_4bit:
            model = model.to(device=device, dtype=dtype)
        normalize = None
        if cfg.reward.normalize_enable:
            normalize = reward_stats(model.config)
            if normalize is None:
                from rlhforge.config.parsing import ConfigError

                raise ConfigError(
                    f"--reward.normalize_enable: {path}/config.json has no reward statistics (reward_mean/reward_std, "
                    "written by `rlhforge rm`, or OpenRLHF's mean/std); serve without normalisation or add them"
                )
        return cls(model, tokenizer, max_len=cfg.data.max_len, batch_size=cfg.resolved_batch_size,
                   batch_tokens=cfg.batch_tokens,
                   packed=cfg.ds.packing_samples, device=device, dtype=dtype,
                   value_head_prefix=cfg.ds.value_head_prefix, normalize=normalize)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as :func:`~rlhforge.models.reward.encode_reward_text` gives them, without
        tokenising more of a long text than the ``max_len`` tokens kept need: a prefix of
        ``8 * max_len`` characters (x4 until it yields ``max_len + 16`` tokens, or is the whole text)
        is tokenised instead. The 16 tokens beyond the kept ones absorb the effect of the cut on
        the last words, so the ids are those of the whole text."""
        from rlhforge.models.reward import encode_reward_text

        limit = max(1024, 8 * self.max_len)
        while len(text) > limit:
            ids = encode_reward_text(self.tokenizer, text[:limit], 2**62)  # untruncated
            if len(ids) >= self.max_len + 16:
                ids = ids[: self.max_len]
                if self.tokenizer.eos_token_id is not None:
                    ids[-1] = self.tokenizer.eos_token_id
                return ids
            limit *= 4
        return encode_reward_text(self.tokenizer, text, self.max_len)

    @torch.no_grad()
    def score_ids(self, ids: list[list[int]]) -> tuple[list[float], list[float]]:
        """(rewards, raw rewards) of token-id sequences, in order. Rewards are normalised if asked for."""
        from rlhforge.data.packing import collate_packed, collate_padded
        from rlhforge.models.reward import sequence_rewards

        if not ids:
            return [], []
        raw = [0.0] * len(ids)
        for chunk in length_chunks([len(x) for x in ids], self.batch_size, self.batch_tokens):
            seqs = [{"input_ids": ids[i], "loss_mask": [1] * len(ids[i])} for i in chunk]
            batch = collate_packed(seqs) if self.packed else collate_padded(seqs, self.tokenizer.pad_token_id)
            batch = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            with _autocast(self.device, self.dtype):
                values = sequence_rewards(self.model, batch, self.value_head_prefix).float().cpu().tolist()
            for i, value in zip(chunk, values):
                raw[i] = value
        if self.normalize is None:
            return list(raw), raw
        mean, std = self.normalize
        return [(r - mean) / std for r in raw], raw

    def score(self, texts: list[str]) -> tuple[list[float], list[float]]:
        """(rewards, raw rewards) of ``texts``, in order (:meth:`encode`, then :meth:`score_ids`)."""
        return self.score_ids([self.encode(t) for t in texts])


def length_chunks(lengths: list[int], batch_size: int, batch_tokens: int) -> list[list[int]]:
    """Indices sorted by length, cut into forward passes of at most ``batch_size`` rows whose padded size
    (rows x the longest) stays within ``batch_tokens`` (a row longer than the budget runs alone)."""
    chunks: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        chunk = chunks[-1] if chunks else None
        if chunk is None or len(chunk) >= batch_size or (len(chunk) + 1) * lengths[i] > batch_tokens:
            chunks.append([i])
        else:
            chunk.append(i)
    return chunks


def _autocast(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class _Rejected(HTTPError):
    """A request answered with ``status`` before it reaches the model."""


_BadRequest = BadRequest


def _parse_request(body: bytes) -> tuple[list[str], list | None, list | None]:
    """The request's (query, prompts, labels); :class:`_BadRequest` (400) for any malformed body."""
    payload = parse_json(body, allow_nan=True)  # NaN labels (e.g. a missing value in a dataset) pass through
    if not isinstance(payload, dict):
        raise _BadRequest(f"expected a JSON object with a 'query' list, got {type(payload).__name__}")
    if "query" not in payload:
        raise _BadRequest(f"missing 'query' (a list of strings); keys given: {sorted(payload)[:20]}")
    query = payload["query"]
    if isinstance(query, str):
        raise _BadRequest("'query' must be a list of strings, got a single string (wrap it in a list)")
    if not isinstance(query, list):
        raise _BadRequest(f"'query' must be a list of strings, got {type(query).__name__}")
    for i, q in enumerate(query):
        if not isinstance(q, str):
            raise _BadRequest(f"'query'[{i}] must be a string, got {type(q).__name__}")
        check_text(q, f"'query'[{i}]")
    extras = []
    for key in ("prompts", "labels"):
        value = payload.get(key)
        if value is not None:
            if not isinstance(value, list):
                raise _BadRequest(f"'{key}' must be a list, got {type(value).__name__}")
            if len(value) != len(query):
                raise _BadRequest(f"'{key}' has {len(value)} entries but 'query' has {len(query)}")
        extras.append(value)
    return query, extras[0], extras[1]


class _Batcher:
    """Pools token ids of concurrent requests into forward passes on one worker thread."""

    def __init__(self, scorer: RewardScorer, max_batch: int, max_wait_s: float):
        self.scorer, self.max_batch, self.max_wait_s = scorer, max_batch, max_wait_s
        self.queue: asyncio.Queue | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-model")
        self.counters = {"requests": 0, "queries": 0, "batches": 0}
        self.seconds_per_query = 0.0  # moving average, for Retry-After

    async def submit(self, ids: list[list[int]]) -> tuple[list[float], list[float]]:
        future = asyncio.get_running_loop().create_future()
        await self.queue.put((ids, future))
        return await future

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = [await self.queue.get()]
            total = len(items[0][0])
            deadline = loop.time() + self.max_wait_s
            while total < self.max_batch:
                remaining = deadline - loop.time()
                try:
                    item = self.queue.get_nowait() if remaining <= 0 else await asyncio.wait_for(self.queue.get(), remaining)
                except (asyncio.TimeoutError, asyncio.QueueEmpty):
                    break
                items.append(item)
                total += len(item[0])
            ids = [x for batch, _ in items for x in batch]
            started = time.monotonic()
            try:
                rewards, raw = await loop.run_in_executor(self.executor, self.scorer.score_ids, ids)
            except Exception:  # noqa: BLE001 - re-run request by request: only the culprits fail
                logger.exception("reward model failed on a batch of %d queries from %d requests; re-running them "
                                 "one request at a time", len(ids), len(items))
                await self._one_by_one(loop, items)
                continue
            per_query = (time.monotonic() - started) / max(1, len(ids))
            self.seconds_per_query = per_query if not self.seconds_per_query else \
                0.8 * self.seconds_per_query + 0.2 * per_query
            self.counters["requests"] += len(items)
            self.counters["queries"] += len(ids)
            self.counters["batches"] += 1
            offset = 0
            for batch, future in items:
                n = len(batch)
                if not future.done():
                    future.set_result((rewards[offset : offset + n], raw[offset : offset + n]))
                offset += n

    async def _one_by_one(self, loop, items) -> None:
        for batch, future in items:
            try:
                result = await loop.run_in_executor(self.executor, self.scorer.score_ids, batch)
            except Exception as err:  # noqa: BLE001 - this request's own failure
                if not future.done():
                    future.set_exception(err)
                continue
            self.counters["requests"] += 1
            self.counters["queries"] += len(batch)
            self.counters["batches"] += 1
            if not future.done():
                future.set_result(result)


async def _read_body(request) -> bytes:
    """The request body; its size and read time are bounded by the app's :class:`RequestGuard` (413 / 408
    raised from the read, before any of it is parsed)."""
    chunks = [chunk async for chunk in request.stream()]
    return b"".join(chunks)


def create_app(scorer: RewardScorer, *, api_key: str | None = None, max_batch: int = 32, max_wait_ms: float = 5.0,
               model_name: str = "", max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               max_queue: int = DEFAULT_MAX_QUEUE, body_timeout_s: float = 60.0):
    """The FastAPI application (routes, checks and batching as in the module docstring)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    if max_request_bytes < 1 or max_queue < 1:
        raise ValueError(f"max_request_bytes and max_queue must be >= 1 (got {max_request_bytes}, {max_queue})")
    batcher = _Batcher(scorer, max_batch, max_wait_ms / 1000.0)
    prep = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-prep")  # one tokenizer user at a time
    state = {"in_flight": 0, "in_flight_queries": 0}
    status_counts = {"400": 0, "401": 0, "413": 0, "500": 0, "503": 0}

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        batcher.queue = asyncio.Queue()
        task = asyncio.create_task(batcher.run())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            batcher.executor.shutdown(wait=False)
            prep.shutdown(wait=False)

    app = FastAPI(title="rlhforge reward server", lifespan=lifespan)
    app.state.batcher = batcher
    app.add_middleware(RequestGuard, limits=BodyLimits(max_request_bytes, body_timeout_s, "--max_request_bytes"))

    def authorised(request: Request) -> bool:
        return key_matches(request.headers, api_key)

    def error(status: int, message: str, headers: dict[str, str] | None = None):
        status_counts[str(status)] = status_counts.get(str(status), 0) + 1
        return JSONResponse({"error": message}, status_code=status, headers=headers)

    def prepare(body: bytes) -> list[list[int]]:
        query, _prompts, _labels = _parse_request(body)
        ids = []
        for i, text in enumerate(query):
            try:
                ids.append(scorer.encode(text))
            except Exception as err:  # noqa: BLE001 - this query's own problem
                raise _BadRequest(f"'query'[{i}] could not be tokenised: {type(err).__name__}: {err}") from None
        return ids

    def retry_after() -> str:
        backlog = state["in_flight_queries"] * batcher.seconds_per_query
        return str(min(60, max(1, math.ceil(backlog))))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "normalize": scorer.normalize is not None, **batcher.counters,
                "in_flight": state["in_flight"], "max_queue": max_queue, "max_request_bytes": max_request_bytes,
                "max_len": scorer.max_len, "errors": dict(status_counts)}

    @app.post("/get_reward")
    async def get_reward(request: Request):
        if not authorised(request):
            return error(401, "missing or invalid API key (send 'Authorization: Bearer KEY')")
        if state["in_flight"] >= max_queue:
            return error(503, f"server busy: {state['in_flight']} requests queued (--max_queue {max_queue}); retry "
                              "later", {"Retry-After": retry_after()})
        state["in_flight"] += 1
        n_queries = 0
        try:
            body = await _read_body(request)
            ids = await asyncio.get_running_loop().run_in_executor(prep, prepare, body)
            if not ids:
                return {"rewards": [], "scores": [], "extra_logs": {"raw_reward": []}}
            n_queries = len(ids)
            state["in_flight_queries"] += n_queries
            try:
                rewards, raw = await batcher.submit(ids)
            except Exception as err:  # noqa: BLE001 - the model failed on this request itself
                return error(500, f"reward model failed: {type(err).__name__}: {err}")
            bad = next((i for i, r in enumerate(raw) if not math.isfinite(r)), None)
            if bad is not None:
                return error(500, f"reward model produced a non-finite reward ({raw[bad]}) for 'query'[{bad}]")
            return {"rewards": rewards, "scores": rewards, "extra_logs": {"raw_reward": raw}}
        except HTTPError as err:
            return error(err.status, str(err), err.headers)
        except ClientGone:
            raise  # one log line (RequestGuard); nobody to answer, not a server error
        except Exception as err:  # noqa: BLE001 - never an unanswered request (keeps the connection usable)
            logger.exception("reward server: unexpected failure")
            return error(500, f"internal error: {type(err).__name__}: {err}")
        finally:
            state["in_flight"] -= 1
            state["in_flight_queries"] -= n_queries

    return app


def serve(cfg) -> None:
    """Load the model of ``cfg`` (:class:`ServeRMConfig`) and serve until SIGTERM/SIGINT, which finish the
    requests already received (up to ``cfg.graceful_shutdown_s``) and return normally."""
    scorer = RewardScorer.from_config(cfg)
    app = create_app(scorer, api_key=cfg.resolved_api_key, max_batch=cfg.resolved_batch_size,
                     max_wait_ms=cfg.max_wait_ms, model_name=cfg.reward.model_name_or_path,
                     max_request_bytes=cfg.max_request_bytes, max_queue=cfg.max_queue,
                     body_timeout_s=cfg.body_timeout_s)
    norm = f", normalised with mean {scorer.normalize[0]:.4g} std {scorer.normalize[1]:.4g}" if scorer.normalize else ""
    print(f"[rlhforge] serve-rm: {cfg.reward.model_name_or_path} on {scorer.device}{norm}; "
          f"POST http://{cfg.host}:{cfg.port}/get_reward"
          f"{' (API key required)' if cfg.resolved_api_key else ''}", flush=True)
    if cfg.host not in ("127.0.0.1", "localhost", "::1") and not cfg.resolved_api_key:
        print(f"[rlhforge] serve-rm: warning: listening on {cfg.host} without an API key; anyone who can reach this "
              "port can query the model", flush=True)
    stopped = run_server(app, cfg.host, cfg.port, log_level=cfg.log_level, graceful_shutdown_s=cfg.graceful_shutdown_s,
                         limits=ServerLimits(header_timeout_s=cfg.header_timeout_s))
    if stopped:
        print(f"[rlhforge] serve-rm: stopped ({stopped}) after finishing the requests in flight", flush=True)
