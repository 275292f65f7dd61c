"""serve-tinker routes of checkpoints: save (for training or sampling) and load. Checkpoints are named
``tinker://RUN/weights/NAME`` (``RUN``: the model's own random run name, not its model id) and live in the
tenant's folder; answers and errors show these names, never the server's folders."""

from __future__ import annotations

import uuid
from pathlib import Path

from fastapi import APIRouter, Request

import rlhforge.tinker_server.schemas as S
from rlhforge.tinker_server.codec import PayloadError
from rlhforge.tinker_server.routes_training import ModelOps
from rlhforge.tinker_server.state import ModelEntry, SamplerEntry, base_dir_of, check_name, checkpoint_dir_of
from rlhforge.tinker_server.training import LoraSpec, read_meta

__all__ = ["router"]


def router(ctx) -> APIRouter:
    cfg, state = ctx.cfg, ctx.state
    ops = ModelOps(ctx)
    api = APIRouter()

    def save_path(entry: ModelEntry, kind: str, name: str) -> tuple[str, Path]:
        tinker_path = f"tinker://{entry.run}/{kind}/{check_name(name)}"
        return tinker_path, checkpoint_dir_of(state.root_of(entry.tenant), tinker_path)[0]

    @api.post("/api/v1/save_weights")
    async def save_weights(request: Request):
        body = await ctx.body_of(request)
        req = S.parse(S.SaveWeights, body)
        entry = state.model(req.model_id, ctx.tenant(request))
        where: list = []

        def check():
            where.extend(save_path(entry, "weights", req.path or f"step-{uuid.uuid4().hex[:8]}"))

        def run():
            ops.trained(entry).save(where[1], base_model=entry.base_model, optimizer=True)
            return {"path": where[0], "type": "save_weights"}

        rec = state.submit_ordered(entry, req.seq_id, "json", run, digest=ctx.digest(request, body), check=check)
        return ctx.future(rec, model_id=entry.model_id)

    @api.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request):
        body = await ctx.body_of(request)
        req = S.parse(S.SaveForSampler, body)
        entry = state.model(req.model_id, ctx.tenant(request))
        plan: dict = {}

        def check():
            if req.path is not None:
                plan["path"], plan["dir"] = save_path(entry, "sampler_weights", req.path)
                return
            if req.sampling_session_seq_id is None:
                raise PayloadError("path", "give a path (a name), or sampling_session_seq_id for an ephemeral sampler")
            session_id = entry.model_id.split(":train:")[0]
            sampler_id = f"{session_id}:sample:{req.sampling_session_seq_id}"
            if state.has_sampler(entry.tenant, sampler_id):
                raise PayloadError("sampling_session_seq_id", f"sampler {sampler_id} exists already")
            plan["sampler"] = state.add_sampler(SamplerEntry(sampler_id, entry.base_model, entry.base_dir,
                                                             tenant=entry.tenant))

        def run():
            if "path" in plan:
                ops.trained(entry).save(plan["dir"], base_model=entry.base_model, optimizer=False)
                return {"path": plan["path"], "type": "save_weights_for_sampler"}
            from rlhforge.tinker_server.sampling import Sampler

            plan["sampler"].sampler = Sampler.from_training(ops.trained(entry), state.device)
            return {"sampling_session_id": plan["sampler"].sampler_id, "type": "save_weights_for_sampler"}

        rec = state.submit_ordered(entry, req.seq_id, "json", run, digest=ctx.digest(request, body), check=check)
        return ctx.future(rec, model_id=entry.model_id)

    def checkpoint(tenant: str, path: str, optimizer: bool) -> tuple[Path, dict]:
        directory, _, kind = checkpoint_dir_of(state.root_of(tenant), path)
        meta = read_meta(directory, path)
        if optimizer and kind != "weights":
            raise PayloadError("optimizer", "sampler_weights checkpoints hold no optimizer state")
        return directory, meta

    @api.post("/api/v1/load_weights")
    async def load_weights(request: Request):
        body = await ctx.body_of(request)
        req = S.parse(S.LoadWeights, body)
        tenant = ctx.tenant(request)
        if req.session_id is not None:  # create-via-load: a new model (any session of the tenant may resume)
            directory, meta = checkpoint(tenant, req.path, req.optimizer)
            if req.model_seq_id is None:
                raise PayloadError("model_seq_id", "required with session_id")
            state.session(req.session_id, tenant)
            ops.check_optimizer(req.optimizer_config)
            base_model = req.base_model or meta["base_model"]
            base_dir = state.resolve_base(base_model) if req.base_model else base_dir_of(state, meta)
            spec = LoraSpec(**{**meta["lora"], "alpha": meta["lora"].get("alpha", cfg.lora_alpha)})
            entry = ops.new_model(tenant, req.session_id, req.model_seq_id, base_model, base_dir, spec)

            def run():
                ops.build(entry).load(directory, optimizer=req.optimizer)
                return {"type": "load_weights", "path": req.path, "model_id": entry.model_id}

            rec = state.submit("json", run, tenant)
            entry.creation = rec.request_id
            return ctx.future(rec, model_id=entry.model_id)
        if req.model_id is None or req.seq_id is None:
            raise PayloadError("model_id", "give model_id and seq_id, or session_id and model_seq_id")
        entry = state.model(req.model_id, tenant)  # loading into a live model: its own session only
        found: list = []

        def check():
            directory, meta = checkpoint(tenant, req.path, req.optimizer)
            if meta["lora"]["rank"] != entry.lora.rank:
                raise PayloadError("path", f"checkpoint has LoRA rank {meta['lora']['rank']}, the model "
                                           f"{entry.lora.rank}")
            found.append(directory)

        rec = state.submit_ordered(entry, req.seq_id, "json", lambda: (
            ops.trained(entry).load(found[0], optimizer=req.optimizer),
            {"type": "load_weights", "path": req.path, "model_id": entry.model_id})[1],
            digest=ctx.digest(request, body), check=check)
        return ctx.future(rec, model_id=entry.model_id)

    return api
