"""One Tinker training model: a base HF folder + a peft LoRA adapter, trained by rlhforge's own strategy
(:func:`rlhforge.backend.factory.build_strategy`; the plain-torch one in a single process) with Tinker's
semantics: ``forward_backward`` *adds* the gradient of a summed loss, ``optim_step`` runs AdamW with the
step's own ``AdamParams`` and clears the gradients.

Losses (the SDK's documented formulas; ``logp`` are the model's log-probs of ``target_tokens``, summed over
every token of every datum, no normalisation):

- ``cross_entropy``: ``-sum(weights * logp)``;
- ``importance_sampling``: ``-sum(exp(logp - logprobs) * advantages)`` (``logprobs``: the sampler's);
- ``ppo``: ``-sum(min(r * A, clip(r, clip_low_threshold, clip_high_threshold) * A))``, ``r = exp(logp -
  logprobs)``, thresholds from ``loss_fn_config`` (default 0.8 / 1.2), through
  :func:`rlhforge.algorithms.policy_losses.ppo_loss`;
- ``cispo``: ``-sum(sg(clip(r, clip_low_threshold, clip_high_threshold)) * A * logp)`` (default 0.8 / 1.2),
  through :func:`rlhforge.algorithms.cispo_loss`;
- ``dro``: ``-sum(A * logp - beta / 2 * (logp - logprobs)^2)`` (``beta`` default 0.05), through
  :func:`rlhforge.algorithms.dro_loss` with the sampler's ``logprobs`` as its ``old_log_probs``;
- ``gspo`` (GSPO-token): ``s = exp(mean over sequence_ratio_mask of (logp - logprobs))``, every token's ratio
  ``r_t = sg(s) * exp(logp_t - sg(logp_t))``, then ``ppo``'s clipped objective on ``r_t`` over every token
  (default 0.8 / 1.2), through ``ppo_loss`` with ``old_log_probs = sg(logp) - log s``.

Others are refused (:data:`REFUSED_LOSSES`) with the reason.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from rlhforge.tinker_server.codec import Datum, PayloadError

__all__ = ["LoraSpec", "TrainedModel", "SUPPORTED_LOSSES", "REFUSED_LOSSES", "check_loss", "lora_targets"]

SUPPORTED_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")
REFUSED_LOSSES = {
    "stable_reinforce": "its formula and the stability records it reads are not public",
    "custom": "server-side custom losses (create_custom_loss graphs) are not supported; "
              "TrainingClient.forward_backward_custom runs the loss client-side and works",
}
LOSS_INPUTS = {"cross_entropy": ("target_tokens", "weights"),
               "importance_sampling": ("target_tokens", "logprobs", "advantages"),
               "ppo": ("target_tokens", "logprobs", "advantages"),
               "cispo": ("target_tokens", "logprobs", "advantages"),
               "dro": ("target_tokens", "logprobs", "advantages"),
               "gspo": ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask")}
# loss_fn_config keys and their defaults (Tinker's names; the thresholds bound the ratio r itself)
LOSS_CONFIG = {"ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
               "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
               "dro": {"beta": 0.05},
               "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}}


def check_loss(loss_fn: str, config: dict, data: list[Datum]) -> None:
    """Refuse (PayloadError, HTTP 400) what cannot run, before anything is queued."""
    if loss_fn not in SUPPORTED_LOSSES:
        why = REFUSED_LOSSES.get(loss_fn, "unknown loss function")
        raise PayloadError("loss_fn", f"{loss_fn!r}: {why}; supported: {', '.join(SUPPORTED_LOSSES)}")
    known = LOSS_CONFIG.get(loss_fn, {})
    for key, value in config.items():
        if key not in known:
            raise PayloadError(f"loss_fn_config.{key}", f"not a parameter of {loss_fn} (parameters: {list(known)})")
        if not isinstance(value, float) or not np.isfinite(value):
            raise PayloadError(f"loss_fn_config.{key}", f"must be a finite number (got {value!r})")
    params = loss_params(loss_fn, config)
    if loss_fn in ("ppo", "cispo", "gspo"):
        lo = params["clip_low_threshold"]
        if loss_fn != "cispo" and not 0 < lo <= 1:
            raise PayloadError("loss_fn_config.clip_low_threshold", f"must be in (0, 1] (got {lo})")
        if loss_fn == "cispo" and not 0 <= lo <= 1:  # CISPO's weight may be floored at 0: no lower clip
            raise PayloadError("loss_fn_config.clip_low_threshold", f"must be in [0, 1] (got {lo})")
        if params["clip_high_threshold"] < 1:
            raise PayloadError("loss_fn_config.clip_high_threshold",
                               f"must be >= 1 (got {params['clip_high_threshold']})")
    if loss_fn == "dro" and params["beta"] < 0:
        raise PayloadError("loss_fn_config.beta", f"must be >= 0 (got {params['beta']})")
    for i, d in enumerate(data):
        need = LOSS_INPUTS[loss_fn]
        for name in d.inputs:
            if name not in need:
                raise PayloadError(f"data[{i}].loss_fn_inputs.{name}", f"not an input of {loss_fn} (inputs: {list(need)})")
        for name in need:
            if name not in d.inputs:
                raise PayloadError(f"data[{i}].loss_fn_inputs.{name}", f"missing (required by {loss_fn})")
            arr = d.inputs[name]
            if arr.ndim != 1 or arr.shape[0] != d.tokens.shape[0]:
                raise PayloadError(f"data[{i}].loss_fn_inputs.{name}",
                                   f"shape {list(arr.shape)} must be [{d.tokens.shape[0]}] (the model_input length)")
            if name != "target_tokens" and not np.isfinite(arr).all():
                raise PayloadError(f"data[{i}].loss_fn_inputs.{name}", "holds NaN or infinity")
        if loss_fn == "gspo" and not (d.inputs["sequence_ratio_mask"] != 0).any():
            raise PayloadError(f"data[{i}].loss_fn_inputs.sequence_ratio_mask",
                               "marks no token (the sequence ratio is a mean over the marked tokens)")


def loss_params(loss_fn: str, config: dict) -> dict[str, float]:
    """``loss_fn_config`` over the loss's defaults (:data:`LOSS_CONFIG`)."""
    return {key: float(config.get(key, default)) for key, default in LOSS_CONFIG.get(loss_fn, {}).items()}


def policy_loss(loss_fn: str, config: dict, lp: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per-token loss [T] of the ratio losses (``ppo``, ``cispo``, ``dro``, ``gspo``): ``lp`` the model's
    log-probs (differentiable), ``inputs`` the datum's float inputs (``logprobs`` the sampler's, ``advantages``,
    gspo's ``sequence_ratio_mask``); the thresholds bound the ratio itself."""
    from rlhforge.algorithms import cispo_loss, dro_loss
    from rlhforge.algorithms.policy_losses import ppo_loss

    p = loss_params(loss_fn, config)
    q, adv = inputs["logprobs"], inputs["advantages"]
    if loss_fn == "gspo":  # old = sg(lp) - log s makes ppo_loss's ratio sg(s) * exp(lp - sg(lp))
        in_ratio = inputs["sequence_ratio_mask"] != 0
        q = lp.detach() - (lp.detach() - q)[in_ratio].mean()
    args = (lp[None], q[None], adv[None], torch.ones_like(lp[None]))
    if loss_fn in ("ppo", "gspo"):
        per_token, _ = ppo_loss(*args, eps_low=1.0 - p["clip_low_threshold"], eps_high=p["clip_high_threshold"] - 1.0)
    elif loss_fn == "cispo":
        per_token, _ = cispo_loss(*args, eps_low=1.0 - p["clip_low_threshold"],
                                  eps_high=p["clip_high_threshold"] - 1.0)
    elif loss_fn == "dro":  # Tinker's DRO measures against the sampler: q is old_log_probs here
        per_token, _ = dro_loss(*args, beta=p["beta"])
    else:
        raise ValueError(f"not a ratio loss: {loss_fn!r}")
    return per_token[0]


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    alpha: int = 32


def lora_targets(model, spec: LoraSpec) -> list[str]:
    """Full names of the ``nn.Linear`` modules the SDK's ``train_attn`` / ``train_mlp`` / ``train_unembed`` select."""
    head = model.get_output_embeddings()
    names = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        parts = name.split(".")
        if module is head:
            chosen = spec.train_unembed
        elif any("attn" in p or "attention" in p for p in parts):
            chosen = spec.train_attn
        elif any("mlp" in p or "feed_forward" in p for p in parts):
            chosen = spec.train_mlp
        else:
            chosen = False
        if chosen:
            names.append(name)
    if not names:
        raise PayloadError("lora_config", "selects no linear layer of this model")
    return names


class TrainedModel:
    """A LoRA model under a strategy. Not thread-safe: the server runs every call on one worker thread."""

    def __init__(self, base_dir: str, spec: LoraSpec, *, device: str = "auto", param_dtype: str = "auto"):
        from peft import get_peft_model

        from rlhforge.backend.factory import build_strategy
        from rlhforge.config.components import (AdamConfig, DSConfig, LoraConfig, ModelConfig, OptimConfig,
                                                TrainConfig)
        from rlhforge.models.loading import load_causal_lm, load_tokenizer, lora_config

        self.base_dir, self.spec = base_dir, spec
        ds = DSConfig(strategy="torch", param_dtype=param_dtype)
        optim = OptimConfig(adam=AdamConfig(lr=1e-4, eps=1e-12, weight_decay=0.0), lr_scheduler="constant",
                            lr_warmup_ratio=0.0, max_norm=0.0)
        self.strategy = build_strategy(ds, optim, TrainConfig(device=device), None)
        self.tokenizer = load_tokenizer(base_dir)
        model = load_causal_lm(base_dir, ModelConfig(model_name_or_path=base_dir), ds, self.strategy.device)
        targets = lora_targets(model, spec)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0 if spec.seed is None else spec.seed)
            model = get_peft_model(model, lora_config(LoraConfig(rank=spec.rank, alpha=spec.alpha,
                                                                  target_modules=tuple(targets)), "CAUSAL_LM"))
        self.strategy.prepare(model, total_steps=1)
        self.steps = 0

    @property
    def module(self):
        return self.strategy.module

    # -- forward / backward -------------------------------------------------------------------------------
    def _target_logprobs(self, data: list[Datum]) -> list[torch.Tensor]:
        """log p(target_tokens[t] | model_input[: t + 1]) per datum, differentiable."""
        from rlhforge.models.forward import token_logprobs

        dev = self.strategy.device
        targets = [torch.as_tensor(d.inputs["target_tokens"], dtype=torch.long) for d in data]
        aligned = all(torch.equal(torch.as_tensor(d.tokens[1:]), t[:-1]) for d, t in zip(data, targets))
        # aligned (the usual next-token layout): the sequence is model_input + the last target, and
        # token_logprobs' position t + 1 is the target of position t (no full-vocabulary logits kept)
        seqs = [torch.cat([torch.as_tensor(d.tokens), t[-1:]]) if aligned else torch.as_tensor(d.tokens)
                for d, t in zip(data, targets)]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)], mask[i, : len(s)] = s, 1
        batch = {"input_ids": ids.to(dev), "attention_mask": mask.to(dev)}
        with self.strategy.autocast():
            if aligned:
                lp = token_logprobs(self.module, batch)
                return [lp[i, 1: len(s)].float() for i, s in enumerate(seqs)]
            _, logits = token_logprobs(self.module, batch, return_logits=True)
        logp = torch.log_softmax(logits.float(), dim=-1)
        return [logp[i, : len(t)].gather(-1, t.to(dev)[:, None])[:, 0] for i, t in enumerate(targets)]

    def forward_backward(self, data: list[Datum], loss_fn: str, config: dict, forward_only: bool):
        """Per-datum outputs (``logprobs``, ``elementwise_loss``: float32 [T]) and ``{"loss:sum": ...}``;
        unless ``forward_only``, the gradient of the summed loss is added to the parameters' ``.grad``."""
        self.strategy.train()
        grad = torch.enable_grad() if not forward_only else torch.no_grad()
        with grad:
            logps = self._target_logprobs(data)
            losses = []
            for d, lp in zip(data, logps):
                f = {k: torch.as_tensor(v, dtype=torch.float32, device=lp.device) for k, v in d.inputs.items()
                     if k != "target_tokens"}
                if loss_fn == "cross_entropy":
                    per_token = -f["weights"] * lp
                elif loss_fn == "importance_sampling":
                    per_token = -torch.exp(lp - f["logprobs"]) * f["advantages"]
                else:  # ppo, cispo, dro, gspo
                    per_token = policy_loss(loss_fn, config, lp, f)
                losses.append(per_token)
            total = torch.stack([loss.sum() for loss in losses]).sum()
            if not forward_only:
                self.strategy.backward(total, True)
        outputs = [{"logprobs": lp.detach().cpu().numpy().astype(np.float32),
                    "elementwise_loss": loss.detach().cpu().numpy().astype(np.float32)}
                   for lp, loss in zip(logps, losses)]
        return outputs, {"loss:sum": float(total.detach())}

    def optim_step(self, adam: dict) -> dict[str, float]:
        """One AdamW step with the SDK's ``AdamParams`` (lr, beta1, beta2, eps, weight_decay, grad_clip_norm)."""
        from rlhforge.backend.strategy import clip_and_step

        for group in self.strategy.optimizer.param_groups:
            group.update(lr=adam["learning_rate"], betas=(adam["beta1"], adam["beta2"]), eps=adam["eps"],
                         weight_decay=adam["weight_decay"])
        out = clip_and_step(self.module, self.strategy.optimizer, self.strategy.scheduler, adam["grad_clip_norm"])
        self.steps += 1
        return {"grad_norm:mean": out["grad_norm"], "learning_rate:mean": adam["learning_rate"],
                "skipped:sum": out["skipped"]}

    # -- checkpoints ----------------------------------------------------------------------------------------
    def save(self, directory: Path, *, base_model: str, optimizer: bool) -> None:
        """The adapter (peft folder), ``meta.json`` and, with ``optimizer``, the AdamW state; written into a
        temporary folder that is renamed into place, so a checkpoint is whole or absent."""
        import shutil

        from rlhforge.backend.checkpoint import torch_save

        directory.parent.mkdir(parents=True, exist_ok=True)
        tmp = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.module.save_pretrained(tmp, save_embedding_layers=False)  # the base stays frozen
        meta = {"base_model": base_model, "base_dir": self.base_dir, "lora": asdict(self.spec), "steps": self.steps}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if optimizer:
            torch_save({"optimizer": self.strategy.optimizer.state_dict(),
                        "scheduler": self.strategy.scheduler.state_dict()}, tmp / "optimizer.pt")
        shutil.rmtree(directory, ignore_errors=True)
        tmp.rename(directory)

    def load(self, directory: Path, *, optimizer: bool) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        state = load_file(str(directory / "adapter_model.safetensors"), device=str(self.strategy.device))
        result = set_peft_model_state_dict(self.module, state)
        if getattr(result, "unexpected_keys", None):
            raise PayloadError("path", f"checkpoint does not fit this model (unexpected {result.unexpected_keys[:3]})")
        if optimizer:
            opt = directory / "optimizer.pt"
            if not opt.is_file():
                raise PayloadError("path", "this checkpoint has no optimizer state (saved for sampling?)")
            saved = torch.load(opt, map_location="cpu", weights_only=False)
            self.strategy.optimizer.load_state_dict(saved["optimizer"])
            self.strategy.scheduler.load_state_dict(saved["scheduler"])
        self.steps = json.loads((directory / "meta.json").read_text()).get("steps", 0)
        self.module.zero_grad(set_to_none=True)


def read_meta(directory: Path, tinker_path: str = "", field_name: str = "path") -> dict:
    """The ``meta.json`` of a checkpoint folder; a 404 naming ``tinker_path`` (never the server's folder)."""
    path = directory / "meta.json"
    if not path.is_file():
        raise PayloadError(field_name, f"no checkpoint {tinker_path or directory.name!r}", status=404)
    return json.loads(path.read_text())
