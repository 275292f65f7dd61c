"""vLLM's token route over rlhforge's engines: ``POST /inference/v1/generate`` (token ids in, token ids
and per-token log-probs out), for environments that render their own prompts (verifiers 0.4's
``TrainClient`` and anything else written against vLLM's token-in-token-out server).

Request (vLLM's ``GenerateRequest``; the fields rlhforge reads)::

    {"model": "policy", "token_ids": [...],
     "sampling_params": {"max_tokens": 64, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                         "stop_token_ids": [...], "seed": 3, "logprobs": 1}}

Response (vLLM's ``GenerateTokensResponse``)::

    {"request_id": "...", "model": "policy", "prompt_token_ids": [...], "output_mode": "tokens",
     "choices": [{"index": 0, "token_ids": [...], "finish_reason": "stop" | "length",
                  "logprobs": {"content": [{"token_id": 17, "token": "token_id:17",
                                            "logprob": -0.52, "top_logprobs": []}, ...]}}],
     "usage": {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}}

Each log-prob entry carries both vLLM 0.32's ``token_id`` and the ``"token_id:<id>"`` string that
``renderers.client`` (verifiers' train client) checks. The prompt tokens are the caller's, never
re-tokenised, so the chat template and tokenizer are exactly the caller's (for verifiers: the
trained model's own, loaded from ``--actor.model_name_or_path``).

**Sessions.** ``/sessions/<id>/inference/v1/generate`` (base URL ``.../sessions/<id>/v1``, as
OpenAI-style clients are configured) records one episode, as the OpenAI-compatible server does
(:mod:`rlhforge.agents.serving.chat`): the first call's ``token_ids`` are the trajectory's prompt;
every later call must start with every token recorded so far (the new tokens after them are
environment feedback, mask 0), and the generated ids and log-probs are appended as an action span.
A call that does not extend the session answers HTTP 400 and fails the sample
(``--train.agent_openai_prefix_mismatch new_segment`` restarts from it instead). ``max_tokens`` is
capped by what is left of ``--rollout.max_new_tokens``; a call past the budget returns no tokens
with ``finish_reason="length"``. ``/inference/v1/generate`` without a session generates without
recording. ``GET /v1/models`` reports ``max_model_len`` (``--data.max_len``) when set.
"""

import math
import time
import uuid
from dataclasses import replace

from rlhforge.agents.serving.routes import AgentServerLimits, _HTTPError, add_generation_route
from rlhforge.agents.serving.chat import ChatServer, ChatSession
from rlhforge.agents.serving.checks import SamplingRequest, parse_sampling
from rlhforge.agents.episode import turn_seed

__all__ = ["TokenServer"]


class TokenServer(ChatServer):
    """:class:`ChatServer` (OpenAI chat routes) plus vLLM's token route (module docstring)."""

    def __init__(self, tokenizer, model_name: str = "policy", tokenizer_lock=None, max_model_len: int | None = None,
                 limits: AgentServerLimits | None = None):
        self.max_model_len = max_model_len
        super().__init__(tokenizer, model_name, tokenizer_lock, limits)

    async def token_generate(self, body: dict, sid: str | None) -> dict:
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not ids or not all(type(i) is int and i >= 0 for i in ids):
            raise _HTTPError(400, "'token_ids' must be a non-empty list of non-negative integers")
        vocab = len(self.tokenizer)
        if max(ids) >= vocab:
            raise _HTTPError(400, f"token_ids holds {max(ids)}, beyond the tokenizer's {vocab} tokens")
        sp_body = body.get("sampling_params")
        sr = parse_sampling({} if sp_body is None else sp_body, "sampling_params.")
        if sid is None:
            sess = ChatSession("", self._default_sampling(), budget=10**9, max_len=self.max_model_len)
            return await self._generate_tokens(sess, ids, sr, body, record=False)
        sess = self._session(sid)
        async with sess.lock:
            if sess.error:
                raise _HTTPError(400, f"session failed earlier: {sess.error}")
            if sess.tokens is None:
                sess.start_segment(ids)
            elif ids[: len(sess.tokens)] == sess.tokens:
                sess.extend(ids[len(sess.tokens):])
            elif sess.prefix_mismatch == "new_segment":
                sess.start_segment(ids)
            else:
                i = next((k for k, (a, b) in enumerate(zip(sess.tokens, ids)) if a != b), min(len(ids), len(sess.tokens)))
                sess.error = (f"the new prompt's token_ids do not extend the episode: they differ from the "
                              f"{len(sess.tokens)} recorded tokens at position {i} (recorded "
                              f"{sess.tokens[max(0, i - 3):i + 3]} vs new {ids[max(0, i - 3):i + 3]}); "
                              "--train.agent_openai_prefix_mismatch new_segment trains on the last segment instead")
                raise _HTTPError(400, sess.error)
            return await self._generate_tokens(sess, list(sess.tokens), sr, body, record=True)

    def _default_sampling(self):
        from rlhforge.rollout.engine import SamplingParams

        return SamplingParams(max_new_tokens=1)

    async def _generate_tokens(self, sess: ChatSession, prompt_ids, sr: SamplingRequest, body, *, record: bool) -> dict:
        left = sess.remaining() if record else (10**9 if self.max_model_len is None
                                               else max(self.max_model_len - len(prompt_ids), 0))
        max_new = left if sr.max_tokens is None else min(sr.max_tokens, left)
        if max_new <= 0:
            if record:
                sess.cut, sess.last_finish = True, "length"
            ids, lps, finish = [], [], "length"
        else:
            base = sess.sampling
            stops = tuple(dict.fromkeys(base.stop_token_ids + sr.stop_token_ids))
            sp = replace(base, max_new_tokens=max_new, stop_token_ids=stops,
                         seed=turn_seed(base.seed, sess.calls) if sr.seed is None else sr.seed, **sr.overrides())
            out = await self._engine_generate(prompt_ids, sp)
            ids, lps, finish = list(out.token_ids), [float(x) for x in out.logprobs], out.finish_reason
            if len(ids) != len(lps) or not all(math.isfinite(x) for x in lps):
                raise _HTTPError(500, f"the engine returned {len(ids)} tokens with {len(lps)} log-probs")
            if record:
                sess.record(prompt_ids, ids, lps, finish)
        sess.calls += 1
        content = [{"token_id": t, "token": f"token_id:{t}", "logprob": lp, "top_logprobs": []}
                   for t, lp in zip(ids, lps)]
        return {
            "request_id": str(body.get("request_id") or uuid.uuid4().hex), "model": body.get("model") or self.model_name,
            "created": int(time.time()), "output_mode": "tokens", "prompt_token_ids": list(prompt_ids),
            "choices": [{"index": 0, "token_ids": ids, "finish_reason": finish, "stop_reason": None,
                         "logprobs": {"content": content}}],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                      "total_tokens": len(prompt_ids) + len(ids)},
        }

    def _model_card(self) -> dict:
        card = super()._model_card()
        if self.max_model_len:
            card["max_model_len"] = self.max_model_len
        return card

    def _add_routes(self, app) -> None:
        super()._add_routes(app)
        server = self

        async def generate(body: dict, sid: str | None, request):
            return await server.token_generate(body, sid)

        add_generation_route(app, "/inference/v1/generate", generate)
