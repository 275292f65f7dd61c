"""Mixture-of-experts models: the router's load-balancing loss, the router modules, expert weight names.

- :func:`load_balancing_loss` is the Switch-Transformer auxiliary loss that ``--actor.aux_loss_coef``
  (RL) and ``--model.aux_loss_coef`` (SFT/DPO) add, computed here from the router logits a forward
  with ``output_router_logits=True`` returns, over the tokens of ``token_mask`` only. Why not the
  model's own ``outputs.aux_loss``: transformers counts every position when no 2-D
  ``attention_mask`` is passed, which on packed batches includes the padding of the bounded rows
  (:func:`rlhforge.models.forward.packed_rows`), and with an explicit 4-D block mask it cannot
  flatten the mask at all. On a padded batch both agree (tested against transformers'
  ``load_balancing_loss_func``).
- :func:`router_modules` finds each layer's router, the one place expert choices are made: in
  transformers 5.x the ``gate`` child of every sparse MoE block (``Qwen3MoeTopKRouter``,
  ``MixtralTopKRouter``, ``OlmoeTopKRouter``: ``forward(hidden [N, H]) -> (logits [N, E],
  top-k weights [N, k], top-k indices [N, k])``). A forward hook on these modules sees and may
  replace the choices (what routing replay needs); nothing here installs one.
- :func:`checkpoint_names` turns a live model's parameter names into the checkpoint layout
  (``save_pretrained``'s, which vLLM's ``load_weights`` reads): transformers 5.x keeps each layer's
  experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I])
  while checkpoints and vLLM name them per expert (``mlp.experts.{e}.gate_proj.weight`` ...,
  Mixtral: ``block_sparse_moe.experts.{e}.w1.weight``). Dense families pass through unchanged
  (Phi-3's ``qkv_proj``/``gate_up_proj`` are fused in both).
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Sequence

import torch
from torch import Tensor

__all__ = [
    "is_moe",
    "moe_routing",
    "load_balancing_loss",
    "token_mask_for_router",
    "router_modules",
    "recorded_router_logits",
    "aux_loss_enabled",
    "experts_implementations",
    "checkpoint_names",
    "meta_skeleton",
]


def _config(model_or_config):
    return getattr(model_or_config, "config", model_or_config)


def moe_routing(model_or_config) -> tuple[int, int] | None:
    """``(num_experts, experts_per_token)`` of an MoE config, None for a dense model."""
    cfg = _config(model_or_config)
    num = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    top_k = getattr(cfg, "num_experts_per_tok", None)
    if not num or not top_k:
        return None
    return int(num), int(top_k)


def is_moe(model_or_config) -> bool:
    """A model whose forward returns router logits (``output_router_logits`` in its config, as OpenRLHF
    checks) and that names its expert count and top-k."""
    cfg = _config(model_or_config)
    return "output_router_logits" in cfg.to_dict() and moe_routing(cfg) is not None


def load_balancing_loss(router_logits: Sequence[Tensor], num_experts: int, top_k: int,
                        token_mask: Tensor | None = None) -> Tensor:
    """Switch Transformer load-balancing loss over all layers, counting only the tokens of ``token_mask``.

    ``E * sum_e f_e * P_e`` where, over the counted tokens of every layer together, ``f_e`` is the
    fraction of top-k assignments that went to expert ``e`` (each token makes ``top_k`` of them, so
    ``sum_e f_e = top_k``) and ``P_e`` the mean router probability of ``e``. Balanced routing gives
    ``top_k``; it is differentiable through ``P_e`` (the top-k counts carry no gradient).

    Args:
        router_logits: one ``[N, E]`` tensor per MoE layer (the same N tokens in each).
        num_experts, top_k: ``E`` and ``k``.
        token_mask: ``[N]`` (or any shape with N elements) 1 for tokens to count; None counts all.
    """
    if not router_logits:
        raise ValueError("no router logits: the model has no MoE layer (or output_router_logits was off)")
    n = router_logits[0].shape[0]
    mask = (torch.ones(n, device=router_logits[0].device) if token_mask is None
            else token_mask.reshape(-1).to(router_logits[0].device, torch.float32))
    if mask.numel() != n:
        raise ValueError(f"token_mask has {mask.numel()} entries but the router saw {n} tokens")
    counts = torch.zeros(num_experts, device=mask.device)
    probs = torch.zeros(num_experts, device=mask.device)
    for logits in router_logits:
        p = torch.softmax(logits.float(), dim=-1)  # [N, E]
        chosen = torch.topk(p, top_k, dim=-1).indices  # [N, k]
        onehot = torch.zeros_like(p).scatter_(1, chosen, 1.0)  # [N, E], k ones per row
        counts = counts + (onehot * mask[:, None]).sum(0)
        probs = probs + (p * mask[:, None]).sum(0)
    total = mask.sum() * len(router_logits)
    return num_experts * ((counts / total) * (probs / total)).sum()


def token_mask_for_router(batch_mask: Tensor | None, rows=None) -> Tensor | None:
    """The ``[N]`` mask of real tokens in the layout the model ran on.

    ``batch_mask``: a padded batch's ``attention_mask`` [B, T]. ``rows``: a packed batch computed in
    bounded rows (:class:`rlhforge.models.forward.PackedRows`), whose padding must not count. Both
    None (one packed row): every token is real.
    """
    if rows is not None:
        mask = torch.zeros(rows.input_ids.numel(), device=rows.input_ids.device)
        return mask.index_fill_(0, rows.index, 1.0)
    return None if batch_mask is None else batch_mask.reshape(-1)


def router_modules(model) -> list[tuple[str, torch.nn.Module]]:
    """``(name, router)`` per MoE layer: the ``gate`` child of every module that also has ``experts``."""
    out = []
    for name, module in model.named_modules():
        gate = getattr(module, "gate", None)
        if isinstance(gate, torch.nn.Module) and isinstance(getattr(module, "experts", None), torch.nn.Module):
            out.append((f"{name}.gate" if name else "gate", gate))
    return out


@contextlib.contextmanager
def recorded_router_logits(model):
    """Collect every router's logits ``[N, E]`` of the forwards run inside the block (forward hooks on
    :func:`router_modules`), for models whose outputs do not carry ``router_logits`` (a reward model's
    sequence-classification head drops them)."""
    logits: list[Tensor] = []

    def hook(_module, _inputs, output):
        logits.append(output[0] if isinstance(output, tuple) else output)

    handles = [m.register_forward_hook(hook) for _, m in router_modules(model)]
    try:
        yield logits
    finally:
        for h in handles:
            h.remove()


def aux_loss_enabled(coef: float, model, flag: str) -> bool:
    """Whether ``flag`` (``--actor.aux_loss_coef`` / ``--model.aux_loss_coef``) adds a loss to ``model``.

    A dense model with ``coef > 0`` prints one notice and trains without it (OpenRLHF sets
    ``output_router_logits`` only where the config has it, so the coefficient does nothing there).
    """
    if not coef:
        return False
    if is_moe(model):
        return True
    from rlhforge.config.validation import notice

    notice(f"{flag} {coef} has no effect: {type(_config(model)).__name__} is not a mixture-of-experts model "
           "(no router, no load-balancing loss)")
    return False


def experts_implementations() -> tuple[str, ...]:
    """The names ``from_pretrained(experts_implementation=...)`` accepts in this transformers."""
    names = ["eager"]
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        names += [k for k in ALL_EXPERTS_FUNCTIONS.keys() if k not in names]
    except ImportError:  # pragma: no cover - transformers without the experts interface
        return ()
    return tuple(names)


def meta_skeleton(config):
    """The model class of ``config`` on the meta device (no memory): what :func:`checkpoint_names` needs."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def checkpoint_names(named: Iterable[tuple[str, Tensor]], skeleton) -> Iterator[tuple[str, Tensor]]:
    """Stream ``(name, tensor)`` pairs of a live model in the checkpoint layout (module docstring).

    One tensor at a time through transformers' ``revert_weight_conversion`` (the reverse of what
    ``from_pretrained`` applied; fused experts split into per-expert tensors). ``skeleton``: the model
    (or :func:`meta_skeleton` of its config); None passes everything through.
    """
    if skeleton is None:
        yield from named
        return
    from transformers.core_model_loading import revert_weight_conversion

    for name, tensor in named:
        yield from revert_weight_conversion(skeleton, {name: tensor}).items()
