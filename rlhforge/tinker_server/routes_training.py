"""serve-tinker routes of training models: create, info, forward(_backward), optim_step. Every request of a live
model goes through :meth:`ServerState.submit_ordered` (seq_id order, window, de-duplication by content); its
checks run there, so a refused request still takes its seq_id."""

from __future__ import annotations

import secrets

from fastapi import APIRouter, Request

import rlhforge.tinker_server.schemas as S
from rlhforge.tinker_server.context import PROTO
from rlhforge.tinker_server.codec import PayloadError, decode_forward_backward
from rlhforge.tinker_server.state import ModelEntry, check_ids, folder_config, vocab_size
from rlhforge.tinker_server.training import LoraSpec, TrainedModel, check_loss

__all__ = ["router", "ModelOps"]


class ModelOps:
    """Creating and reaching the training models of one server (shared with :mod:`.routes_weights`)."""

    def __init__(self, ctx):
        self.cfg, self.state = ctx.cfg, ctx.state

    def lora_of(self, lora: S.LoraIn | None) -> LoraSpec:
        if lora is None:
            raise PayloadError("lora_config", "required: rlhforge serve-tinker trains LoRA adapters only")
        return LoraSpec(rank=lora.rank, seed=lora.seed, train_mlp=lora.train_mlp, train_attn=lora.train_attn,
                        train_unembed=lora.train_unembed, alpha=self.cfg.lora_alpha)

    @staticmethod
    def check_optimizer(opt, field_name="optimizer_config.type"):
        if opt is not None and opt.type != "adamw":
            raise PayloadError(field_name, f"{opt.type!r} is not supported (adamw is)")

    def new_model(self, tenant: str, session_id: str, model_seq_id: int, base_model: str, base_dir: str,
                  spec: LoraSpec) -> ModelEntry:
        model_id = f"{session_id}:train:{model_seq_id}"  # the SDK derives this id itself (create-via-load)
        entry = ModelEntry(model_id, base_model, base_dir, spec, tenant=tenant, run=f"run-{secrets.token_hex(8)}")
        self.state.add_model(entry)
        return entry

    def build(self, entry: ModelEntry) -> TrainedModel:
        entry.trained = TrainedModel(entry.base_dir, entry.lora, device=self.cfg.device, param_dtype=self.cfg.param_dtype)
        return entry.trained

    @staticmethod
    def trained(entry: ModelEntry) -> TrainedModel:
        if entry.trained is None:
            raise PayloadError("model_id", f"model {entry.model_id} failed to load")
        return entry.trained


def router(ctx) -> APIRouter:
    cfg, state = ctx.cfg, ctx.state
    ops = ModelOps(ctx)
    api = APIRouter()

    @api.post("/api/v1/create_model")
    async def create_model(request: Request):
        req = S.parse(S.CreateModel, await ctx.body_of(request))
        tenant = ctx.tenant(request)
        state.session(req.session_id, tenant)
        spec = ops.lora_of(req.lora_config)
        ops.check_optimizer(req.optimizer_config)
        base_dir = state.resolve_base(req.base_model)
        entry = ops.new_model(tenant, req.session_id, req.model_seq_id, req.base_model, base_dir, spec)

        def run():
            ops.build(entry)
            return {"model_id": entry.model_id, "type": "create_model"}

        rec = state.submit("json", run, tenant)
        entry.creation = rec.request_id
        return ctx.future(rec, model_id=entry.model_id)

    @api.post("/api/v1/get_info")
    async def get_info(request: Request):
        entry = state.model(S.parse(S.ModelRef, await ctx.body_of(request)).model_id, ctx.tenant(request))
        # the base model as the client named it (a mapped name or its own folder); the server's folder only with
        # --expose_base_folders (auto: on loopback, where the SDK's get_tokenizer() can load it from disk)
        tokenizer_id = entry.base_dir if cfg.shows_base_folders else entry.base_model
        return {"type": "get_info", "model_id": entry.model_id, "model_name": entry.base_model,
                "is_lora": True, "lora_rank": entry.lora.rank, "optimizer_config": {"type": "adamw"},
                "model_data": {"arch": folder_config(entry.base_dir).get("model_type"), "model_name": entry.base_model,
                               "tokenizer_id": tokenizer_id}}

    @api.post("/api/v1/forward_backward")
    async def forward_backward(request: Request):
        return await _fwdbwd(request, None)

    @api.post("/api/v1/forward")
    async def forward(request: Request):
        return await _fwdbwd(request, True)

    async def _fwdbwd(request: Request, forward_only: bool | None):
        if PROTO not in request.headers.get("content-type", ""):
            raise PayloadError("Content-Type", f"forward_backward takes the SDK's protobuf body ({PROTO})", status=415)
        body = await ctx.body_of(request)
        req = decode_forward_backward(body)
        if forward_only:
            req.forward_only = True
        entry = state.model(req.model_id, ctx.tenant(request))

        def check():
            check_loss(req.loss_fn, req.config, req.data)
            vocab = vocab_size(entry.base_dir)
            for i, d in enumerate(req.data):
                for where, ids in ((f"data[{i}].model_input", d.tokens),
                                   (f"data[{i}].loss_fn_inputs.target_tokens", d.inputs["target_tokens"])):
                    check_ids(where, ids, vocab)

        rec = state.submit_ordered(entry, req.seq_id, "fwdbwd", lambda: ops.trained(entry).forward_backward(
            req.data, req.loss_fn, req.config, req.forward_only), digest=ctx.digest(request, body), check=check)
        return ctx.future(rec, model_id=entry.model_id)

    @api.post("/api/v1/optim_step")
    async def optim_step(request: Request):
        body = await ctx.body_of(request)
        req = S.parse(S.OptimStep, body)
        entry = state.model(req.model_id, ctx.tenant(request))
        adam = {}

        def check():
            if req.optimizer_params is not None:
                kind = req.optimizer_params.get("type") if isinstance(req.optimizer_params, dict) else None
                raise PayloadError("optimizer_params", f"{kind!r} is not supported (AdamParams are)")
            given = req.adam_params if req.adam_params is not None else req.optim_params
            if given is None:
                raise PayloadError("adam_params", "required")
            adam.update(S.validate(S.AdamIn, given, "adam_params").model_dump())

        rec = state.submit_ordered(entry, req.seq_id, "json", lambda: {
            "type": "optim_step", "metrics": ops.trained(entry).optim_step(adam)},
            digest=ctx.digest(request, body), check=check)
        return ctx.future(rec, model_id=entry.model_id)

    return api
