"""HTTP reward server over a reward model, speaking OpenRLHF's remote-RM protocol.

``POST /get_reward`` with JSON ``{"query": [str, ...], "prompts": [str, ...], "labels": [...]}``
(``prompts``/``labels`` optional; when given, as long as ``query``) returns::

    {"rewards": [float, ...], "scores": [float, ...], "extra_logs": {"raw_reward": [float, ...]}}

``query[i]`` is the whole text to score (prompt + response, already chat-formatted). It is
tokenised like the reward model's training sequences (:func:`rlhforge.models.reward.encode_reward_text`:
EOS appended unless present, truncated to ``max_len``), and the reward is the value head at the last
token. ``rewards`` and ``scores`` are the same list (normalised to ``(r - mean) / std`` with
``normalize``); ``extra_logs.raw_reward`` always holds the unnormalised rewards.

``GET /health`` returns ``{"status": "ok", ...}`` with request/batch counters (no key needed).

Batching: requests are queued; a batcher pools the queries of every request that arrives within
``max_wait_ms`` of the first (up to ``batch_size`` queries), runs them sorted by length in forward
passes of at most ``batch_size`` sequences on one worker thread, and answers each request with
its own slice. The event loop stays responsive while the model runs.

Errors: a body that is not JSON, not an object, without a ``query`` list of strings, or with
``prompts``/``labels`` of another length gets ``400 {"error": "<reason>"}``; a missing or wrong API
key (``Authorization: Bearer KEY`` or ``X-API-Key: KEY``) gets 401; a failure in the model gets 500.

:func:`start_server_thread` runs a server in a background thread (tests, in-process use).
"""

# No ``from __future__ import annotations``: FastAPI must see the real ``Request`` annotation of the
# route functions, which are defined inside ``create_app`` (fastapi is imported lazily).
import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["RewardScorer", "create_app", "start_server_thread", "ServerHandle", "serve"]

logger = logging.getLogger(__name__)


class RewardScorer:
    """Scores whole texts with a reward model (thread-compatible: one call at a time)."""

    def __init__(self, model, tokenizer, *, max_len: int = 2048, batch_size: int = 32, packed: bool = False,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 value_head_prefix: str = "score", normalize: tuple[float, float] | None = None):
        from rlhforge.models.reward import value_head

        self.model, self.tokenizer = model.eval(), tokenizer
        self.max_len, self.batch_size, self.packed = max_len, batch_size, packed
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
        ds = DSConfig(attn_implementation=cfg.ds.attn_implementation, load_in_4bit=cfg.ds.load_in_4bit)
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
                   packed=cfg.ds.packing_samples, device=device, dtype=dtype,
                   value_head_prefix=cfg.ds.value_head_prefix, normalize=normalize)

    @torch.no_grad()
    def score(self, texts: list[str]) -> tuple[list[float], list[float]]:
        """(rewards, raw rewards) of ``texts``, in order. Rewards are normalised if asked for."""
        from rlhforge.data.packing import collate_packed, collate_padded
        from rlhforge.models.reward import encode_reward_text, sequence_rewards

        if not texts:
            return [], []
        ids = [encode_reward_text(self.tokenizer, t, self.max_len) for t in texts]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        raw = [0.0] * len(ids)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
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


def _autocast(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class _BadRequest(ValueError):
    pass


def _parse_request(body: bytes) -> tuple[list[str], list | None, list | None]:
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise _BadRequest(f"malformed JSON: {err}") from None
    if not isinstance(payload, dict):
        raise _BadRequest(f"expected a JSON object with a 'query' list, got {type(payload).__name__}")
    if "query" not in payload:
        raise _BadRequest(f"missing 'query' (a list of strings); keys given: {sorted(payload)}")
    query = payload["query"]
    if isinstance(query, str):
        raise _BadRequest("'query' must be a list of strings, got a single string (wrap it in a list)")
    if not isinstance(query, list):
        raise _BadRequest(f"'query' must be a list of strings, got {type(query).__name__}")
    for i, q in enumerate(query):
        if not isinstance(q, str):
            raise _BadRequest(f"'query'[{i}] must be a string, got {type(q).__name__}")
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
    """Pools queries of concurrent requests into forward passes on one worker thread."""

    def __init__(self, scorer: RewardScorer, max_batch: int, max_wait_s: float):
        self.scorer, self.max_batch, self.max_wait_s = scorer, max_batch, max_wait_s
        self.queue: asyncio.Queue | None = None
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-model")
        self.counters = {"requests": 0, "queries": 0, "batches": 0}

    async def submit(self, texts: list[str]) -> tuple[list[float], list[float]]:
        future = asyncio.get_running_loop().create_future()
        await self.queue.put((texts, future))
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
            texts = [t for batch, _ in items for t in batch]
            try:
                rewards, raw = await loop.run_in_executor(self.executor, self.scorer.score, texts)
            except Exception as err:  # noqa: BLE001 - forwarded to every waiting request
                logger.exception("reward model failed on a batch of %d queries", len(texts))
                for _, future in items:
                    if not future.done():
                        future.set_exception(err)
                continue
            self.counters["requests"] += len(items)
            self.counters["queries"] += len(texts)
            self.counters["batches"] += 1
            offset = 0
            for batch, future in items:
                n = len(batch)
                if not future.done():
                    future.set_result((rewards[offset : offset + n], raw[offset : offset + n]))
                offset += n


def create_app(scorer: RewardScorer, *, api_key: str | None = None, max_batch: int = 32, max_wait_ms: float = 5.0,
               model_name: str = ""):
    """The FastAPI application (routes and batching as in the module docstring)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    batcher = _Batcher(scorer, max_batch, max_wait_ms / 1000.0)

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

    app = FastAPI(title="rlhforge reward server", lifespan=lifespan)
    app.state.batcher = batcher

    def authorised(request: Request) -> bool:
        if not api_key:
            return True
        given = request.headers.get("x-api-key") or ""
        auth = request.headers.get("authorization") or ""
        if auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        return hmac.compare_digest(given.encode(), api_key.encode())

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "normalize": scorer.normalize is not None, **batcher.counters}

    @app.post("/get_reward")
    async def get_reward(request: Request):
        if not authorised(request):
            return JSONResponse({"error": "missing or invalid API key (send 'Authorization: Bearer KEY')"},
                                status_code=401)
        try:
            query, _prompts, _labels = _parse_request(await request.body())
        except _BadRequest as err:
            return JSONResponse({"error": str(err)}, status_code=400)
        try:
            rewards, raw = await batcher.submit(query)
        except Exception as err:  # noqa: BLE001
            return JSONResponse({"error": f"reward model failed: {type(err).__name__}: {err}"}, status_code=500)
        return {"rewards": rewards, "scores": rewards, "extra_logs": {"raw_reward": raw}}

    return app


@dataclass
class ServerHandle:
    """A server running in a background thread: ``url`` of /get_reward, ``stop()``."""

    server: Any
    thread: threading.Thread
    host: str
    port: int

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.base_url}/get_reward"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server_thread(app, host: str = "127.0.0.1", port: int = 0, timeout: float = 30.0,
                        log_level: str = "warning") -> ServerHandle:
    """Run ``app`` with uvicorn in a daemon thread; returns once it accepts connections. ``port=0``
    picks a free port."""
    import socket

    import uvicorn

    if port == 0:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on"))
    thread = threading.Thread(target=server.run, name=f"reward-server-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"reward server on {host}:{port} did not start")
        time.sleep(0.02)
    return ServerHandle(server, thread, host, port)


def serve(cfg) -> None:
    """Load the model of ``cfg`` (:class:`ServeRMConfig`) and serve until interrupted."""
    import uvicorn

    scorer = RewardScorer.from_config(cfg)
    app = create_app(scorer, api_key=cfg.resolved_api_key, max_batch=cfg.resolved_batch_size,
                     max_wait_ms=cfg.max_wait_ms, model_name=cfg.reward.model_name_or_path)
    norm = f", normalised with mean {scorer.normalize[0]:.4g} std {scorer.normalize[1]:.4g}" if scorer.normalize else ""
    print(f"[rlhforge] serve-rm: {cfg.reward.model_name_or_path} on {scorer.device}{norm}; "
          f"POST http://{cfg.host}:{cfg.port}/get_reward"
          f"{' (API key required)' if cfg.resolved_api_key else ''}", flush=True)
    if cfg.host not in ("127.0.0.1", "localhost", "::1") and not cfg.resolved_api_key:
        print(f"[rlhforge] serve-rm: warning: listening on {cfg.host} without an API key; anyone who can reach this "
              "port can query the model", flush=True)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level)
