"""AdamW, Muon (with AdamW for the non-matrix parameters) and learning-rate schedules (warm-up then
cosine / cosine-with-floor / linear / constant).

Both follow OpenRLHF 0.11, which builds them with HF ``transformers``:

- weight decay skips biases and norm weights (``get_optimizer_grouped_parameters``: a parameter
  whose name contains one of ``NO_DECAY_NAME_LIST`` goes into a group with ``weight_decay=0``);
- the schedules are HF ``get_scheduler``'s: warm-up rises linearly **from 0** (step ``s`` of
  ``W`` warm-up steps has ``s / W`` of the peak lr, so the first optimizer step has lr 0), and
  ``constant`` has no warm-up at all (``constant_with_warmup`` has).

Muon (``--optim muon``, docs/optim.md): Newton-Schulz-orthogonalised momentum updates for the 2-D
hidden weight matrices, AdamW (the ``adam`` block's lr, betas, eps, weight decay) for embeddings,
the LM / value / score heads and every 1-D parameter (``muon_param_split``). Two well-kept
implementations run it: ``torch.optim.Muon`` under the plain-torch and FSDP2 strategies
(``MuonWithAdamW``), DeepSpeed's ``MuonWithAuxAdam`` under DeepSpeed ZeRO
(``deepspeed_muon_optimizer``), whose ZeRO 1/2/3 optimizers orthogonalise each full matrix.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch

from rlhforge.config.components import OptimConfig

__all__ = ["NO_DECAY_NAME_LIST", "MUON_EXCLUDED_NAMES", "optimizer_param_groups", "muon_param_split", "MuonWithAdamW",
           "muon_param_groups", "deepspeed_muon_optimizer", "build_optimizer", "build_scheduler", "lr_lambda"]

NO_DECAY_NAME_LIST = ("bias", "layer_norm.weight", "layernorm.weight", "norm.weight", "ln_f.weight")
"""OpenRLHF's names (substrings of a parameter's name) exempt from weight decay."""


def lr_lambda(step: int, *, total_steps: int, warmup_steps: int, schedule: str, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr at optimizer step ``step`` (0-based), as HF ``get_scheduler``'s
    lambdas. Past ``total_steps`` the decay stays at its end value. Pure; tested by hand."""
    if schedule == "constant":  # HF ignores the warm-up for "constant"
        return 1.0
    if warmup_steps > 0 and step < warmup_steps:
        return step / warmup_steps
    if schedule == "constant_with_warmup":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if schedule == "linear":
        return 1.0 - progress
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "cosine":
        return cosine
    if schedule == "cosine_with_min_lr":
        return min_lr_ratio + (1.0 - min_lr_ratio) * cosine
    raise ValueError(f"unknown lr_scheduler {schedule!r}")


def optimizer_param_groups(model: torch.nn.Module | Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float,
                           no_decay: Iterable[str] = NO_DECAY_NAME_LIST) -> list[dict]:
    """Trainable parameters in two groups: ``weight_decay`` for most, 0 for those whose name holds
    one of ``no_decay`` (biases, norm weights). Empty groups are left out. ``model``: a module or
    its ``named_parameters()``."""
    named = model.named_parameters() if isinstance(model, torch.nn.Module) else model
    no_decay = tuple(no_decay)
    decay, exempt = [], []
    for name, p in named:
        if p.requires_grad:
            (exempt if any(nd in name for nd in no_decay) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": exempt, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


MUON_EXCLUDED_NAMES = ("embed", "lm_head", "value_head", "score", "wte", "wpe")
"""Name substrings of 2-D parameters that stay on AdamW under Muon: token / position embeddings, the
LM head (tied or not), the critic's value head and a reward model's score head."""


def _named(model) -> list[tuple[str, torch.nn.Parameter]]:
    return list(model.named_parameters() if isinstance(model, torch.nn.Module) else model)


def muon_param_split(model: torch.nn.Module | Iterable[tuple[str, torch.nn.Parameter]]
                     ) -> tuple[list[str], list[str]]:
    """Names of the trainable parameters Muon updates (2-D with both sides > 1, no name in
    ``MUON_EXCLUDED_NAMES``) and of those AdamW updates (the rest: a one-row matrix such as a value head
    under any ``--ds.value_head_prefix`` is a vector). Tied weights appear once (``named_parameters``
    de-duplicates)."""
    muon, adam = [], []
    for name, p in _named(model):
        if not p.requires_grad:
            continue
        lowered = name.lower()
        is_matrix = p.ndim == 2 and min(p.shape) > 1 and not any(x in lowered for x in MUON_EXCLUDED_NAMES)
        (muon if is_matrix else adam).append(name)
    return muon, adam


def muon_param_groups(model, cfg: OptimConfig) -> list[dict]:
    """Param groups tagged ``use_muon``: one Muon group (``cfg.muon`` lr / momentum, the adam block's
    weight decay) and AdamW groups split as ``optimizer_param_groups`` (no decay on biases and norms)."""
    named = _named(model)
    muon_names, _ = muon_param_split(named)
    muon_set = set(muon_names)
    by_name = dict(named)
    groups = []
    if muon_names:
        groups.append({"params": [by_name[n] for n in muon_names], "use_muon": True, "lr": cfg.muon.lr,
                       "momentum": cfg.muon.momentum, "weight_decay": cfg.adam.weight_decay})
    for g in optimizer_param_groups([(n, p) for n, p in named if n not in muon_set], cfg.adam.weight_decay):
        groups.append({**g, "use_muon": False, "lr": cfg.adam.lr, "betas": tuple(cfg.adam.betas), "eps": cfg.adam.eps})
    return groups


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer over every parameter: ``torch.optim.Muon`` steps the groups tagged ``use_muon``,
    ``torch.optim.AdamW`` the others. Both share this optimizer's param-group dicts and state, so the
    lr scheduler, ``state_dict`` / ``load_state_dict`` and FSDP2's optimizer state dicts see one
    ordinary optimizer. Muon's lr is scaled by ``sqrt(max(1, rows / cols))`` (torch's "original"
    adjustment, the same as DeepSpeed's)."""

    def __init__(self, param_groups: list[dict], *, ns_steps: int = 5, nesterov: bool = True):
        super().__init__(param_groups, {})
        for g in self.param_groups:
            if g["use_muon"]:
                g.update(ns_steps=ns_steps, nesterov=nesterov)
        self._bind()

    def _bind(self) -> None:
        muon_groups = [g for g in self.param_groups if g["use_muon"]]
        adam_groups = [g for g in self.param_groups if not g["use_muon"]]
        self._inner = []
        for cls, groups in ((torch.optim.Muon, muon_groups), (torch.optim.AdamW, adam_groups)):
            if not groups:
                continue
            extra = {"weight_decay": groups[0]["weight_decay"]}
            inner = cls([{"params": list(g["params"])} for g in groups], lr=groups[0]["lr"], **extra)
            for g in groups:
                for key, value in inner.defaults.items():
                    g.setdefault(key, value)
            inner.param_groups = groups  # the same dicts: the scheduler's lr reaches the inner step
            inner.state = self.state
            self._inner.append(inner)

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._bind()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for inner in self._inner:
            inner.step()
        return loss


def deepspeed_muon_optimizer(model, cfg: OptimConfig):
    """DeepSpeed's ``MuonWithAuxAdam`` over ``muon_param_groups`` (each parameter tagged ``use_muon``, which
    DeepSpeed's ZeRO optimizers read to orthogonalise full matrices). DeepSpeed fixes Newton-Schulz at 5
    steps with Nesterov momentum: ``cfg.muon.ns_steps`` / ``nesterov`` do not reach it (as in OpenRLHF)."""
    from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam

    groups = muon_param_groups(model, cfg)
    if not groups:
        raise ValueError("the model has no trainable parameters")
    for g in groups:
        for p in g["params"]:
            p.use_muon = g["use_muon"]
    return MuonWithAuxAdam(groups)


def build_optimizer(model: torch.nn.Module | Iterable[tuple[str, torch.nn.Parameter]],
                    cfg: OptimConfig, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW over ``optimizer_param_groups(model, cfg.adam.weight_decay)``, or with ``cfg.name == "muon"``
    ``MuonWithAdamW`` over ``muon_param_groups``. ``fused``: torch's fused AdamW kernel (one pass per
    tensor instead of a dozen elementwise ops; equal to the plain loop up to float rounding, ~1e-7 a step):
    the plain-torch strategy asks for it on CPU, where the per-op loop took ~15% of a small model's SFT step."""
    if cfg.name == "muon":
        groups = muon_param_groups(model, cfg)
        if not groups:
            raise ValueError("the model has no trainable parameters")
        return MuonWithAdamW(groups, ns_steps=cfg.muon.ns_steps, nesterov=cfg.muon.nesterov)
    groups = optimizer_param_groups(model, cfg.adam.weight_decay)
    if not groups:
        raise ValueError("the model has no trainable parameters")
    return torch.optim.AdamW(groups, lr=cfg.adam.lr, betas=tuple(cfg.adam.betas), eps=cfg.adam.eps,
                             fused=True if fused else None)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    warmup = math.ceil(cfg.lr_warmup_ratio * total_steps)
    fn = lambda step: lr_lambda(  # noqa: E731
        step, total_steps=total_steps, warmup_steps=warmup, schedule=cfg.lr_scheduler, min_lr_ratio=cfg.min_lr_ratio
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
