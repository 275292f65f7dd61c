"""The HTTP routes of ``rlhforge serve-tinker`` (FastAPI): the endpoints the ``tinker`` SDK 0.38 calls.

Every refusal is a 4xx whose ``detail`` names the field (``data[0].loss_fn_inputs.weights: missing ...``);
a wrong or missing key is 401. Long work answers with a future (:mod:`rlhforge.tinker_server.state`).
"""

from __future__ import annotations

import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import rlhforge.tinker_server.schemas as S
from rlhforge.net.guard import BodyLimits, RequestGuard
from rlhforge.net.payload import decompress_zstd
from rlhforge.net.server import match_key
from rlhforge.tinker_server.codec import (PayloadError, decode_forward_backward, encode_forward_backward_output,
                                          encode_sample_response, json_forward_backward_output, json_sample_response)
from rlhforge.tinker_server.state import (ModelEntry, SamplerEntry, ServerState, base_dir_of, check_ids, check_name,
                                          checkpoint_dir_of, folder_config, vocab_size)
from rlhforge.tinker_server.training import LoraSpec, TrainedModel, check_loss, read_meta

__all__ = ["create_app"]

PROTO = "application/x-protobuf"
OPEN_PATHS = ("/api/v1/healthz",)


def create_app(cfg, api_keys: tuple[str, ...]):
    state = ServerState(cfg)

    @asynccontextmanager
    async def lifespan(_app):
        import asyncio

        state.loop = asyncio.get_running_loop()
        yield
        state.shutdown()

    app = FastAPI(title="rlhforge serve-tinker", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.tinker = state

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if request.url.path not in OPEN_PATHS and match_key(request.headers, api_keys) is None:
            return JSONResponse({"detail": "X-API-Key: missing or not an accepted key"}, status_code=401)
        try:
            return await call_next(request)
        except PayloadError as err:
            return JSONResponse({"detail": str(err)}, status_code=err.status)

    # outermost: body size counted while it streams, read deadline, mid-body disconnects (rlhforge.net.guard)
    app.add_middleware(RequestGuard, limits=BodyLimits(cfg.max_request_bytes, cfg.body_timeout_s), error_key="detail")

    @app.exception_handler(PayloadError)
    async def payload_error(_request, err: PayloadError):
        return JSONResponse({"detail": str(err)}, status_code=err.status)

    async def body_of(request: Request) -> bytes:
        body = await request.body()  # size and read time bounded by RequestGuard
        if request.headers.get("content-encoding", "").lower() == "zstd":
            # output bounded while it is produced; the frame's declared size only refuses early
            body = decompress_zstd(body, cfg.max_request_bytes, max_ratio=cfg.max_zstd_ratio)
        return body

    def future(rec, **extra) -> dict:
        return {"request_id": rec.request_id, **extra}

    # -- service ------------------------------------------------------------------------------------------
    @app.get("/api/v1/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities():
        models = []
        for name, folder in sorted(cfg.model_table.items()):
            models.append({"model_name": name, "trainable": True, "sampleable": True,
                           "max_context_length": folder_config(folder).get("max_position_embeddings")})
        return {"supported_models": models}

    @app.post("/api/v1/client/config")
    async def client_config():
        return {"pjwt_auth_enabled": False, "credential_default_source": "api_key", "proto_compress_fwdbwd": True,
                "use_pyqwest_transport": False, "parallel_fwdbwd_chunks": True, "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False, "sample_join_sampling_session": False}

    @app.post("/api/v1/client/dynamic_config")
    async def client_dynamic_config():
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request):
        S.parse(S.CreateSession, await body_of(request))
        session_id = uuid.uuid4().hex
        state.sessions[session_id] = {"finished": False, "created": time.time()}
        return {"type": "create_session", "session_id": session_id}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request):
        req = S.parse(S.SessionRef, await body_of(request))
        state.session(req.session_id)["heartbeat"] = time.time()
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str):
        state.sessions.setdefault(session_id, {"created": time.time()})["finished"] = True
        return {}

    @app.post("/api/v1/telemetry")
    async def telemetry():
        return {"status": "accepted"}

    # -- models ---------------------------------------------------------------------------------------------
    def lora_of(lora: S.LoraIn | None) -> LoraSpec:
        if lora is None:
            raise PayloadError("lora_config", "required: rlhforge serve-tinker trains LoRA adapters only")
        return LoraSpec(rank=lora.rank, seed=lora.seed, train_mlp=lora.train_mlp, train_attn=lora.train_attn,
                        train_unembed=lora.train_unembed, alpha=cfg.lora_alpha)

    def check_optimizer(opt, field_name="optimizer_config.type"):
        if opt is not None and opt.type != "adamw":
            raise PayloadError(field_name, f"{opt.type!r} is not supported (adamw is)")

    def new_model(session_id: str, model_seq_id: int, base_model: str, base_dir: str, spec: LoraSpec) -> ModelEntry:
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id in state.models:
            raise PayloadError("model_seq_id", f"{model_seq_id} is already a model of session {session_id}")
        entry = state.models[model_id] = ModelEntry(model_id, base_model, base_dir, spec)
        return entry

    def build(entry: ModelEntry) -> TrainedModel:
        entry.trained = TrainedModel(entry.base_dir, entry.lora, device=cfg.device, param_dtype=cfg.param_dtype)
        return entry.trained

    def trained(entry: ModelEntry) -> TrainedModel:
        if entry.trained is None:
            raise PayloadError("model_id", f"model {entry.model_id} failed to load")
        return entry.trained

    @app.post("/api/v1/create_model")
    async def create_model(request: Request):
        req = S.parse(S.CreateModel, await body_of(request))
        state.session(req.session_id)
        spec = lora_of(req.lora_config)
        check_optimizer(req.optimizer_config)
        base_dir = state.resolve_base(req.base_model)
        entry = new_model(req.session_id, req.model_seq_id, req.base_model, base_dir, spec)

        def run():
            build(entry)
            return {"model_id": entry.model_id, "type": "create_model"}

        rec = state.submit("json", run)
        entry.creation = rec.request_id
        return future(rec, model_id=entry.model_id)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request):
        entry = state.model(S.parse(S.ModelRef, await body_of(request)).model_id)
        return {"type": "get_info", "model_id": entry.model_id, "model_name": entry.base_model,
                "is_lora": True, "lora_rank": entry.lora.rank, "optimizer_config": {"type": "adamw"},
                "model_data": {"arch": folder_config(entry.base_dir).get("model_type"), "model_name": entry.base_model,
                               "tokenizer_id": entry.base_dir}}

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        return await _fwdbwd(request, None)

    @app.post("/api/v1/forward")
    async def forward(request: Request):
        return await _fwdbwd(request, True)

    async def _fwdbwd(request: Request, forward_only: bool | None):
        if PROTO not in request.headers.get("content-type", ""):
            raise PayloadError("Content-Type", f"forward_backward takes the SDK's protobuf body ({PROTO})", status=415)
        req = decode_forward_backward(await body_of(request))
        if forward_only:
            req.forward_only = True
        entry = state.model(req.model_id)
        if req.seq_id < 1:
            raise PayloadError("seq_id", f"must be >= 1 (got {req.seq_id})")
        check_loss(req.loss_fn, req.config, req.data)
        vocab = vocab_size(entry.base_dir)
        for i, d in enumerate(req.data):
            for where, ids in ((f"data[{i}].model_input", d.tokens),
                               (f"data[{i}].loss_fn_inputs.target_tokens", d.inputs["target_tokens"])):
                check_ids(where, ids, vocab)
        rec = state.submit_ordered(entry, req.seq_id, "fwdbwd", lambda: trained(entry).forward_backward(
            req.data, req.loss_fn, req.config, req.forward_only))
        return future(rec, model_id=entry.model_id)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request):
        req = S.parse(S.OptimStep, await body_of(request))
        if req.optimizer_params is not None:
            raise PayloadError("optimizer_params", f"{req.optimizer_params.get('type')!r} is not supported "
                                                   "(AdamParams are)")
        adam = req.adam_params or req.optim_params
        if adam is None:
            raise PayloadError("adam_params", "required")
        entry = state.model(req.model_id)
        rec = state.submit_ordered(entry, req.seq_id, "json", lambda: {
            "type": "optim_step", "metrics": trained(entry).optim_step(adam.model_dump())})
        return future(rec, model_id=entry.model_id)

    # -- weights --------------------------------------------------------------------------------------------
    def save_path(entry: ModelEntry, kind: str, name: str) -> tuple[str, Path]:
        tinker_path = f"tinker://{entry.model_id}/{kind}/{check_name(name)}"
        return tinker_path, checkpoint_dir_of(state.root, tinker_path)[0]

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request):
        req = S.parse(S.SaveWeights, await body_of(request))
        entry = state.model(req.model_id)
        tinker_path, directory = save_path(entry, "weights", req.path or f"step-{uuid.uuid4().hex[:8]}")

        def run():
            trained(entry).save(directory, base_model=entry.base_model, optimizer=True)
            return {"path": tinker_path, "type": "save_weights"}

        return future(state.submit_ordered(entry, req.seq_id, "json", run), model_id=entry.model_id)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request):
        req = S.parse(S.SaveForSampler, await body_of(request))
        entry = state.model(req.model_id)
        if req.path is not None:
            tinker_path, directory = save_path(entry, "sampler_weights", req.path)

            def run():
                trained(entry).save(directory, base_model=entry.base_model, optimizer=False)
                return {"path": tinker_path, "type": "save_weights_for_sampler"}
        else:
            if req.sampling_session_seq_id is None:
                raise PayloadError("path", "give a path (a name), or sampling_session_seq_id for an ephemeral sampler")
            session_id = entry.model_id.split(":train:")[0]
            sampler_id = f"{session_id}:sample:{req.sampling_session_seq_id}"
            if sampler_id in state.samplers:
                raise PayloadError("sampling_session_seq_id", f"sampler {sampler_id} exists already")
            sampler = state.samplers[sampler_id] = SamplerEntry(sampler_id, entry.base_model, entry.base_dir)

            def run():
                from rlhforge.tinker_server.sampling import Sampler

                sampler.sampler = Sampler.from_training(trained(entry), state.device)
                return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

        return future(state.submit_ordered(entry, req.seq_id, "json", run), model_id=entry.model_id)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request):
        req = S.parse(S.LoadWeights, await body_of(request))
        directory, _, kind = checkpoint_dir_of(state.root, req.path)
        meta = read_meta(directory)
        if req.optimizer and kind != "weights":
            raise PayloadError("optimizer", "sampler_weights checkpoints hold no optimizer state")
        if req.session_id is not None:  # create-via-load: the model's first request
            if req.model_seq_id is None:
                raise PayloadError("model_seq_id", "required with session_id")
            state.session(req.session_id)
            check_optimizer(req.optimizer_config)
            base_model = req.base_model or meta["base_model"]
            base_dir = state.resolve_base(base_model) if req.base_model else base_dir_of(state, meta)
            spec = LoraSpec(**{**meta["lora"], "alpha": meta["lora"].get("alpha", cfg.lora_alpha)})
            entry = new_model(req.session_id, req.model_seq_id, base_model, base_dir, spec)

            def run():
                build(entry).load(directory, optimizer=req.optimizer)
                return {"type": "load_weights", "path": req.path, "model_id": entry.model_id}

            rec = state.submit("json", run)
            entry.creation = rec.request_id
            return future(rec, model_id=entry.model_id)
        if req.model_id is None or req.seq_id is None:
            raise PayloadError("model_id", "give model_id and seq_id, or session_id and model_seq_id")
        entry = state.model(req.model_id)
        if meta["lora"]["rank"] != entry.lora.rank:
            raise PayloadError("path", f"checkpoint has LoRA rank {meta['lora']['rank']}, the model {entry.lora.rank}")
        rec = state.submit_ordered(entry, req.seq_id, "json", lambda: (
            trained(entry).load(directory, optimizer=req.optimizer),
            {"type": "load_weights", "path": req.path, "model_id": entry.model_id})[1])
        return future(rec, model_id=entry.model_id)

    # -- sampling -------------------------------------------------------------------------------------------
    def sampler_from(base_model: str | None, model_path: str | None, sampler_id: str) -> SamplerEntry:
        if model_path:
            directory, _, _ = checkpoint_dir_of(state.root, model_path, "model_path")
            meta = read_meta(directory)
            return SamplerEntry(sampler_id, base_model or meta["base_model"], base_dir_of(state, meta),
                                model_path=model_path, adapter_dir=directory)
        if not base_model:
            raise PayloadError("base_model", "give base_model or model_path")
        return SamplerEntry(sampler_id, base_model, state.resolve_base(base_model))

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request):
        req = S.parse(S.CreateSamplingSession, await body_of(request))
        state.session(req.session_id)
        sampler_id = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
        if sampler_id not in state.samplers:
            state.samplers[sampler_id] = sampler_from(req.base_model, req.model_path, sampler_id)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str):
        entry = state.samplers.get(sampler_id)
        if entry is None:
            raise PayloadError("sampler_id", f"unknown sampler {sampler_id!r}", status=404)
        return {"sampler_id": sampler_id, "base_model": entry.base_model, "model_path": entry.model_path}

    @app.post("/api/v1/asample")
    async def asample(request: Request):
        req = S.parse(S.Sample, await body_of(request))
        for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if getattr(req, name):
                raise PayloadError(name, "not supported by rlhforge serve-tinker (0 only)")
        if req.target_prompt_logprobs is not None:
            raise PayloadError("target_prompt_logprobs", "not supported by rlhforge serve-tinker")
        if req.sampling_session_id:
            entry = state.samplers.get(req.sampling_session_id)
            if entry is None:
                raise PayloadError("sampling_session_id", f"unknown sampler {req.sampling_session_id!r}", status=404)
        else:
            entry = sampler_from(req.base_model, req.model_path, f"adhoc-{uuid.uuid4().hex[:8]}")
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

        rec = state.submit("sample", run)
        return future(rec, sample_sequence_ids=[f"{rec.request_id}:{i}" for i in range(req.num_samples)])

    # -- futures --------------------------------------------------------------------------------------------
    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request):
        req = S.parse(S.RetrieveFuture, await body_of(request))
        rec = await state.wait(req.request_id, cfg.retrieve_wait_s)
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

    return app

