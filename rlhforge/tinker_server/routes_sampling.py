"""serve-tinker routes of samplers (sampling sessions, ``asample``) and of futures (``retrieve_future``). A
sampler and a future belong to the tenant that created them; a sampler loads checkpoints of that tenant only."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

import rlhforge.tinker_server.schemas as S
from rlhforge.tinker_server.context import PROTO
from rlhforge.tinker_server.codec import (PayloadError, encode_forward_backward_output, encode_sample_response,
                                          json_forward_backward_output, json_sample_response)
from rlhforge.tinker_server.state import SamplerEntry, base_dir_of, check_ids, checkpoint_dir_of, vocab_size
from rlhforge.tinker_server.training import read_meta

__all__ = ["router"]


def router(ctx) -> APIRouter:
    cfg, state = ctx.cfg, ctx.state
    api = APIRouter()

    def sampler_from(tenant: str, base_model: str | None, model_path: str | None, sampler_id: str) -> SamplerEntry:
        if model_path:
            directory, _, _ = checkpoint_dir_of(state.root_of(tenant), model_path, "model_path")
            meta = read_meta(directory, model_path, "model_path")
            return SamplerEntry(sampler_id, base_model or meta["base_model"], base_dir_of(state, meta),
                                model_path=model_path, adapter_dir=directory, tenant=tenant)
        if not base_model:
            raise PayloadError("base_model", "give base_model or model_path")
        return SamplerEntry(sampler_id, base_model, state.resolve_base(base_model), tenant=tenant)

    @api.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        req = S.parse(S.CreateSamplingSession, await ctx.body_of(request))
        tenant = ctx.tenant(request)
        state.session(req.session_id, tenant)
        sampler_id = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
        if not state.has_sampler(tenant, sampler_id):
            state.add_sampler(sampler_from(tenant, req.base_model, req.model_path, sampler_id))
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    @api.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str, request: Request):
        entry = state.sampler(sampler_id, ctx.tenant(request))
        return {"sampler_id": sampler_id, "base_model": entry.base_model, "model_path": entry.model_path}

    @api.post("/api/v1/asample")
    async def asample(request: Request):
        req = S.parse(S.Sample, await ctx.body_of(request))
        tenant = ctx.tenant(request)
        for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if getattr(req, name):
                raise PayloadError(name, "not supported by rlhforge serve-tinker (0 only)")
        if req.target_prompt_logprobs is not None:
            raise PayloadError("target_prompt_logprobs", "not supported by rlhforge serve-tinker")
        if req.sampling_session_id:
            entry = state.sampler(req.sampling_session_id, tenant, "sampling_session_id")
        else:
            entry = sampler_from(tenant, req.base_model, req.model_path, f"adhoc-{uuid.uuid4().hex[:8]}")
        prompt = []
        for j, chunk in enumerate(req.prompt.chunks):
            if chunk.type != "encoded_text":
                raise PayloadError(f"prompt.chunks[{j}].type", f"{chunk.type!r} chunks are not supported")
            prompt.extend(chunk.tokens)
        if not prompt:
            raise PayloadError("prompt", "no tokens")
        check_ids("prompt", prompt, vocab_size(entry.base_dir))
        last_n = req.prompt_logprobs_last_n
        if last_n is not None and (not req.prompt_logprobs or last_n > len(prompt) - 1):
            raise PayloadError("prompt_logprobs_last_n", f"needs prompt_logprobs and 1..{len(prompt) - 1}")
        params = req.sampling_params.model_dump()
        params["max_tokens"] = params["max_tokens"] or cfg.default_max_tokens

        def run():
            from rlhforge.tinker_server.sampling import Sampler

            if entry.sampler is None:
                entry.sampler = Sampler(entry.base_dir, device=state.device, adapter_dir=entry.adapter_dir)
            seqs, plp = entry.sampler.sample(prompt, req.num_samples, params, bool(req.prompt_logprobs))
            if plp is not None and last_n is not None:
                plp[: len(prompt) - last_n] = float("nan")
            return seqs, plp

        rec = state.submit("sample", run, tenant)
        return ctx.future(rec, sample_sequence_ids=[f"{rec.request_id}:{i}" for i in range(req.num_samples)])

    @api.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        req = S.parse(S.RetrieveFuture, await ctx.body_of(request))
        rec = await state.wait(req.request_id, cfg.retrieve_wait_s, ctx.tenant(request))
        if not rec.done.is_set():
            return {"type": "try_again", "request_id": rec.request_id, "queue_state": "active"}
        if rec.error is not None:
            return {"error": rec.error[0], "category": rec.error[1]}
        proto = PROTO in request.headers.get("accept", "")
        if rec.kind == "fwdbwd":
            outputs, metrics = rec.result
            if proto:
                return Response(encode_forward_backward_output(outputs, metrics), media_type=PROTO)
            return json_forward_backward_output(outputs, metrics)
        if rec.kind == "sample":
            seqs, plp = rec.result
            if proto:
                return Response(encode_sample_response(seqs, plp), media_type=PROTO)
            return json_sample_response(seqs, plp)
        return rec.result

    return api
