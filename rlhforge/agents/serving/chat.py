"""Train any agent written against the official ``openai`` client: an OpenAI-compatible HTTP server
over the generation engine that records the exact tokens of every call.

A user file (``--train.agent_func_path my_agent.py``) defines::

    async def run_agent(prompt, label, client):      # or a plain function (gets a sync client)
        messages = [{"role": "user", "content": prompt}]
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=64)
        ...                                           # tools, more turns, anything
        return {"reward": 1.0, "scores": 1.0, "extra_logs": {...}}   # or just a number

``prompt`` is the record's prompt field as given (text or chat messages), ``label`` its label,
``client`` an ``openai.AsyncOpenAI`` (or ``openai.OpenAI``) whose base URL names this sample's
session. Every request of the session is tokenised *incrementally*:

1. The request's messages are rendered with the tokenizer's chat template
   (``add_generation_prompt=True``; ``tools`` are passed to the template when it renders them, and
   refused with HTTP 400 when it does not).
2. The first call's rendering is tokenised once: the trajectory's prompt.
3. A later call must *extend* the session: its rendering must start with the exact text of every
   token recorded so far (``decode`` with special tokens kept). Only the new text after it is
   tokenised and appended (environment feedback, loss mask 0); recorded tokens are never
   re-tokenised, so BPE merges across the boundary cannot change what was generated.
4. The completion's token ids and log-probs are appended as an action span.

A request whose rendering does *not* extend the session (the agent edited or dropped history, or a
template rewrites earlier turns, e.g. stripping reasoning) is handled by
``--train.agent_openai_prefix_mismatch``: ``error`` (default) answers HTTP 400 and fails the sample
with a message showing where the texts diverge (dropped or fatal like any agent failure);
``new_segment`` starts the trajectory afresh from the new prompt, so only the last segment is
trained on (``rollout/agent_segments_discarded`` counts the discarded ones). Nothing is ever
silently mis-tokenised.

The returned content is the completion's text without its final eos/stop token; any other
special token the model wrote is kept in the text (an agent echoing the content back then extends
the session exactly). ``stop`` strings end the completion at the token where the stop text begins: the recorded tokens
are the engine's tokens up to there, and the returned content is their text (it never contains the
stop string), so the next call extends the session. A call beyond the session's token budget
returns an empty completion with ``finish_reason="length"`` (the sample is truncated).

Endpoints: ``POST /v1/chat/completions`` (also ``/sessions/{id}/v1/chat/completions``; the session
may also come as header ``X-Session-Id`` or body field ``session_id``), ``GET /v1/models``,
``GET /health``. The server binds 127.0.0.1 only, on a free port, in a daemon thread. Responses
have the standard shape plus ``token_ids: {prompt_token_ids, completion_token_ids}``.
"""

import asyncio
import inspect
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from rlhforge.agents.episode import AgentError, Episode, EpisodeContext, EpisodeExecutor, turn_seed
from rlhforge.agents.serving.routes import AgentServerLimits, _HTTPError, add_generation_route, install_guards
from rlhforge.agents.serving.checks import chat_messages, check_length, parse_sampling
from rlhforge.agents.serving.threads import TokenizerThreads
from rlhforge.agents.values import _float_logs, to_float
from rlhforge.agents.types import EngineTurn, Trajectory
from rlhforge.rollout.engine import SamplingParams

__all__ = ["ChatServer", "ChatSession", "OpenAIServerAgentExecutor"]


@dataclass
class ChatSession:
    """The token record of one sample's conversation."""

    sid: str
    sampling: SamplingParams
    budget: int
    max_len: int | None
    prefix_mismatch: str = "error"
    tokens: list[int] | None = None
    prompt_len: int = 0
    action_ranges: list[tuple[int, int]] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    calls: int = 0
    last_finish: str = "stop"
    cut: bool = False
    env_tokens: int = 0
    segments_discarded: int = 0
    discarded_tokens: int = 0
    error: str | None = None
    lock: asyncio.Lock | None = None
    turns: list = field(default_factory=list)
    """Every generation call of the current segment (``agents.token_check.EngineTurn``)."""

    def remaining(self) -> int:
        used = len(self.tokens) - self.prompt_len + self.discarded_tokens
        left = self.budget - used
        if self.max_len is not None:
            left = min(left, self.max_len - len(self.tokens))
        return max(left, 0)

    def start_segment(self, ids: list[int]) -> None:
        if self.tokens is not None:
            self.segments_discarded += 1
            self.discarded_tokens += sum(e - s for s, e in self.action_ranges)
        self.tokens, self.prompt_len = list(ids), len(ids)
        self.action_ranges, self.logprobs, self.turns = [], [], []

    def extend(self, delta: list[int]) -> None:
        """Append environment feedback (new prompt tokens after the recorded ones; mask 0)."""
        self.tokens.extend(delta)
        self.env_tokens += len(delta)

    def record(self, prompt_ids, ids: list[int], lps, finish: str) -> None:
        """Append one generation call: the engine saw ``prompt_ids`` and produced ``ids`` (an action
        span) with log-probs ``lps``."""
        self.turns.append(EngineTurn(tuple(prompt_ids), tuple(ids), tuple(float(x) for x in lps)))
        start = len(self.tokens)
        self.tokens.extend(ids)
        if ids:
            self.action_ranges.append((start, start + len(ids)))
        self.logprobs.extend(float(x) for x in lps)
        self.last_finish = finish


def _free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def _divergence(a: str, b: str) -> str:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return (f"the recorded conversation and the new prompt differ at character {i}: recorded "
            f"{a[max(0, i - 40):i + 40]!r} vs new {b[max(0, i - 40):i + 40]!r}")


class ChatServer:
    """FastAPI app + uvicorn thread; generation runs on the trainer's event loop through
    ``bind(loop, generate_one)``. Chat-template rendering, tokenisation and decoding run in the server's
    own ``TOKENIZER_THREADS`` worker threads (:class:`~rlhforge.agents.serving.threads.TokenizerThreads`),
    never on its event loop: a request that makes the tokenizer work (at most ``limits.max_message_chars``
    of new text) holds neither the event loop, nor the tokenizer lock the trainer shares, nor the other
    threads. ``limits``: body and message limits, the
    optional key (:class:`~rlhforge.agents.serving.routes.AgentServerLimits`; docs/security.md)."""

    TOKENIZER_THREADS = 4

    def __init__(self, tokenizer, model_name: str = "policy", tokenizer_lock: Any = None,
                 limits: AgentServerLimits | None = None):
        self.tokenizer, self.model_name = tokenizer, model_name
        self.limits = limits or AgentServerLimits()
        self.lock = tokenizer_lock or threading.RLock()
        self.tok = TokenizerThreads(tokenizer, self.lock, self.TOKENIZER_THREADS)
        self.sessions: dict[str, ChatSession] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._generate: Callable | None = None
        self._handle = None  # the running server (rlhforge.net.server.ServerHandle)
        self.port: int | None = None
        template = getattr(tokenizer, "chat_template", None) or ""
        self.renders_tools = "tools" in template
        self.app = self._build_app()

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def session_url(self, sid: str) -> str:
        return f"{self.url}/sessions/{sid}/v1"

    def start(self) -> str:
        if self._handle is not None:
            return self.url
        from rlhforge.net.server import ServerLimits, start_server_thread

        self.tok.start()
        sock = _free_socket()
        self.port = sock.getsockname()[1]
        try:  # header deadline, header size and keep-alive bounds of every rlhforge service (rlhforge.net.server)
            self._handle = start_server_thread(self.app, sock=sock, name="OpenAI-compatible server", route="/v1",
                                               lifespan="off", access_log=False,
                                               limits=ServerLimits(header_timeout_s=self.limits.header_timeout_s))
        except RuntimeError as err:
            raise AgentError(f"the OpenAI-compatible server did not start: {err}") from err
        return self.url

    def stop(self) -> None:
        self.tok.stop()
        if self._handle is not None:
            self._handle.stop(timeout=10)
        self._handle = None

    def bind(self, loop: asyncio.AbstractEventLoop | None, generate_one: Callable | None) -> None:
        """Generation requests are run as ``generate_one(ids, sampling)`` on ``loop``."""
        self._loop, self._generate = loop, generate_one

    def open_session(self, sampling: SamplingParams, budget: int, max_len: int | None,
                     prefix_mismatch: str = "error", sid: str | None = None) -> ChatSession:
        sid = sid or uuid.uuid4().hex
        s = ChatSession(sid, sampling, budget, max_len, prefix_mismatch)
        self.sessions[sid] = s
        return s

    def close_session(self, sid: str) -> ChatSession | None:
        return self.sessions.pop(sid, None)

    # -- tokenizer (TokenizerThreads: a private copy in the server's threads, else the shared one locked) -
    def _render(self, messages, tools) -> str:
        return self.tok.render(messages, tools)

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def _decode(self, ids, skip_special_tokens=False) -> str:
        return self.tok.decode(ids, skip_special_tokens)

    # -- shared by the generation routes ---------------------------------------------------------
    def _session(self, sid: str) -> ChatSession:
        """The open session ``sid`` (HTTP 404 when there is none), its lock made on first use."""
        sess = self.sessions.get(sid)
        if sess is None:
            raise _HTTPError(404, f"unknown or finished session {sid!r}")
        if sess.lock is None:
            sess.lock = asyncio.Lock()
        return sess

    async def _engine_generate(self, prompt_ids, sp: SamplingParams):
        """One engine call on the bound loop (HTTP 503 when no rollout is in progress)."""
        if self._generate is None or self._loop is None:
            raise _HTTPError(503, "the server is not bound to a generation engine (no rollout in progress)")
        fut = asyncio.run_coroutine_threadsafe(self._generate(list(prompt_ids), sp), self._loop)
        return await asyncio.wrap_future(fut)

    # -- the chat call --------------------------------------------------------------------------
    async def chat(self, body: dict, sid: str | None) -> dict:
        sid = sid or body.get("session_id")
        if sid is not None and not isinstance(sid, str):
            raise _HTTPError(400, f"'session_id' must be a string (got {type(sid).__name__})")
        if not sid:
            raise _HTTPError(400, "no session: use the client passed to run_agent (its base URL names the session)")
        sess = self._session(sid)
        async with sess.lock:
            return await self._chat(sess, body)

    async def _chat(self, sess: ChatSession, body: dict) -> dict:
        if sess.error:
            raise _HTTPError(400, f"session failed earlier: {sess.error}")
        msgs = chat_messages(body.get("messages"), self.limits.max_message_chars)
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise _HTTPError(400, f"'tools' must be a list (got {type(tools).__name__})")
        if tools and not self.renders_tools:
            raise _HTTPError(400, "this tokenizer's chat template does not render 'tools'; describe the tools in "
                                  "the messages or use a model whose template supports them")
        if body.get("stream") not in (None, False):
            raise _HTTPError(400, "stream=true is not supported ('stream' must be false or absent)")
        sr = parse_sampling(body)  # the chat route uses max tokens, temperature, top_p, top_k, stop, logprobs
        prompt_ids = await self.tok.run(self._extend_session, sess, msgs, tools)
        left = sess.remaining()
        max_new = left if sr.max_tokens is None else min(sr.max_tokens, left)
        if max_new <= 0:
            sess.cut, sess.last_finish = True, "length"
            ids, lps, finish = [], [], "length"
        else:
            sp = replace(sess.sampling, max_new_tokens=max_new, seed=turn_seed(sess.sampling.seed, sess.calls),
                         **sr.overrides())
            out = await self._engine_generate(prompt_ids, sp)
            ids, lps, finish = list(out.token_ids), list(out.logprobs), out.finish_reason
            if sr.stop:
                ids, lps, finish = await self.tok.run(self._apply_stop, ids, lps, finish, list(sr.stop))
            sess.record(prompt_ids, ids, lps, finish)
        sess.calls += 1
        content, entries = await self.tok.run(self._completion_text, ids, lps, sess.sampling, sr.logprobs)
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": content},
                                  "finish_reason": finish, "logprobs": None}
        if sr.logprobs:
            choice["logprobs"] = {"content": entries}
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model") or self.model_name, "choices": [choice],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                      "total_tokens": len(prompt_ids) + len(ids)},
            "token_ids": {"prompt_token_ids": prompt_ids, "completion_token_ids": ids},
        }

    def _extend_session(self, sess: ChatSession, msgs: list[dict], tools) -> list[int]:
        """Render the request and append its new tokens to the session (a worker thread: the tokenizer
        never runs on the event loop). The text tokenised for one request (the whole rendering on a
        session's first call, else what follows the recorded text) is at most ``max_message_chars``
        (413 before the tokenizer sees it). Returns the prompt ids of this call."""
        text = self._render(msgs, tools)
        limit = self.limits.max_message_chars
        if sess.tokens is None:
            sess.start_segment(self._encode(check_length(text, "the rendered prompt", limit)))
        else:
            recorded = self._decode(sess.tokens)
            if text.startswith(recorded):
                delta = check_length(text[len(recorded):], "the new text of this request (after the recorded "
                                                           "conversation)", limit)
                sess.extend(self._encode(delta))
            elif sess.prefix_mismatch == "new_segment":
                sess.start_segment(self._encode(check_length(text, "the rendered prompt", limit)))
            else:
                sess.error = _divergence(recorded, text) + (
                    " (the prompt must extend the conversation so far; "
                    "--train.agent_openai_prefix_mismatch new_segment trains on the last segment instead)")
                raise _HTTPError(400, sess.error)
        return list(sess.tokens)

    def _completion_text(self, ids, lps, sp: SamplingParams, logprobs: bool) -> tuple[str, list[dict]]:
        """The returned content and, when asked, its per-token log-prob entries (a worker thread)."""
        content = self._decode(self._strip_stop(ids, sp))
        entries = []
        if logprobs:
            for t, lp in zip(ids, lps):
                tok = self._decode([t])
                entries.append({"token": tok, "logprob": float(lp), "bytes": list(tok.encode("utf-8", "replace")),
                                "top_logprobs": []})
        return content, entries

    def _strip_stop(self, ids: list[int], sp: SamplingParams) -> list[int]:
        """The completion without its final eos/stop token: the content returned. Other special
        tokens the model wrote stay in the text, so an agent that echoes the content back extends
        the session exactly (``skip_special_tokens`` would drop them and break the prefix)."""
        eos = self.tokenizer.eos_token_id
        stops = set(sp.stop_token_ids) | set(eos if isinstance(eos, (list, tuple)) else [eos])
        return ids[:-1] if ids and ids[-1] in stops else ids

    def _apply_stop(self, ids, lps, finish, stops):
        """Cut at the first token where a stop string begins (tokens before it are kept as generated)."""
        ends = [len(self._decode(ids[: k + 1])) for k in range(len(ids))]
        full = self._decode(ids)
        hits = [full.find(s) for s in stops if s and s in full]
        if not hits:
            return ids, lps, finish
        cut_at = min(hits)
        keep = 0
        while keep < len(ids) and ends[keep] <= cut_at:
            keep += 1
        return ids[:keep], lps[:keep], "stop"

    # -- app ------------------------------------------------------------------------------------
    def _model_card(self) -> dict:
        """This server's entry in ``GET /v1/models``."""
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rlhforge"}

    def _add_routes(self, app) -> None:
        """The chat route (:func:`add_generation_route`); a subclass adds its own after these."""
        server = self

        async def completions(body: dict, sid: str | None, request):
            return await server.chat(body, sid or request.headers.get("x-session-id"))

        add_generation_route(app, "/v1/chat/completions", completions, error_type="invalid_request_error")

    def _build_app(self):
        from fastapi import FastAPI

        app = FastAPI(title="rlhforge OpenAI-compatible rollout server")
        server = self
        install_guards(app, self.limits)
        self._add_routes(app)

        def models():
            return {"object": "list", "data": [server._model_card()]}

        app.get("/v1/models")(models)
        app.get("/sessions/{sid}/v1/models")(lambda sid: models())

        @app.get("/health")
        def health():
            return {"status": "ok"}

        return app


class OpenAIServerAgentExecutor(EpisodeExecutor):
    """Runs ``run_agent(prompt, label, client)`` per sample against a :class:`ChatServer` and
    stitches the session into one trajectory (module docstring). Subclass and override
    :meth:`run_agent`, or pass the function."""

    name = "OpenAI-client agent"

    def __init__(self, run_agent: Callable | None = None, model_name: str = "policy"):
        if run_agent is not None:
            self._run_agent = run_agent
        self.model_name = model_name
        self.server: ChatServer | None = None

    async def run_agent(self, prompt, label, client):
        fn = getattr(self, "_run_agent", None)
        if fn is None:
            raise NotImplementedError("define run_agent(prompt, label, client)")
        return fn(prompt, label, client)

    def _agent_fn(self) -> Callable:
        if type(self).run_agent is not OpenAIServerAgentExecutor.run_agent:
            return self.run_agent
        return self._run_agent

    async def before_batch(self, ctx: EpisodeContext) -> None:
        if self.server is None:
            self.server = ChatServer(self.tokenizer, self.model_name, ctx.lock,
                                     limits=AgentServerLimits.from_settings(self.settings))
            await asyncio.to_thread(self.server.start)
        self.server.bind(asyncio.get_running_loop(), ctx.engine.generate_one)

    async def after_batch(self, ctx: EpisodeContext) -> None:
        if self.server is not None:
            self.server.bind(None, None)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    async def run_episode(self, ep: Episode, ctx: EpisodeContext) -> Trajectory:
        import httpx
        import openai

        req = ep.request
        s = self.settings
        sess = self.server.open_session(ep.sampling, ep.budget, s.max_len, s.prefix_mismatch)
        fn = self._agent_fn()
        is_async = inspect.iscoroutinefunction(fn)
        prompt = req.raw_prompt if req.raw_prompt is not None else ctx.decode(req.prompt_ids, skip_special_tokens=True)
        kw = dict(base_url=self.server.session_url(sess.sid), api_key=self.server.limits.api_key or "rlhforge", max_retries=0,
                  timeout=s.episode_timeout)
        # one small connection pool per session: a pool shared by hundreds of concurrent sessions
        # spends its time scanning connections; verify=False skips loading CA certificates (the
        # server is plain http on 127.0.0.1)
        http = (httpx.AsyncClient if is_async else httpx.Client)(verify=False, timeout=s.episode_timeout)
        client = (openai.AsyncOpenAI if is_async else openai.OpenAI)(**kw, http_client=http)
        try:
            result = await ctx.call(fn, prompt, req.label, client, what="run_agent", timeout=s.episode_timeout)
        finally:
            self.server.close_session(sess.sid)
            if is_async:
                await http.aclose()
            else:
                http.close()
        if sess.tokens is None:
            raise AgentError("run_agent made no chat completion call")
        if sess.error:
            raise AgentError(sess.error)
        reward, score, logs = _agent_result(result)
        traj = Trajectory(
            token_ids=list(sess.tokens), prompt_len=sess.prompt_len, action_ranges=list(sess.action_ranges),
            rollout_logprobs=list(sess.logprobs),
            finish_reason="length" if (sess.cut or sess.last_finish == "length") else "stop",
            label=req.label, datasource=req.datasource, prompt_index=req.prompt_index, sample_index=req.sample_index,
            reward=reward, score=score,
            extra={"agent_turns": float(sess.calls), "agent_env_tokens": float(sess.env_tokens),
                   "agent_segments_discarded": float(sess.segments_discarded), **logs},
            engine_turns=list(sess.turns) if s.check_tokens else None,
        )
        return traj


def _agent_result(result) -> tuple[float, float, dict[str, float]]:
    if isinstance(result, dict):
        key = "reward" if "reward" in result else "rewards"
        if key not in result:
            raise AgentError(f"run_agent returned a dict without 'reward' (keys: {sorted(result)})")
        reward = to_float(result[key], "run_agent reward")
        score = to_float(result["scores"], "run_agent scores") if result.get("scores") is not None else reward
        return reward, score, _float_logs(result.get("extra_logs"), "run_agent extra_logs")
    reward = to_float(result, "run_agent result")
    return reward, reward, {}
