"""MoE routing record and replay (``--train.routing_replay``).

An MoE layer's router picks the top-k experts of every token. The rollout engine and the trainer
compute the same router logits only up to rounding (another kernel, another batch, bf16), and the
top-k choice is discontinuous: one flipped expert changes the token's whole MLP output. The
trainer's log-probs then come from a different network than the one that sampled, which is what
makes MoE RL unstable. Routing replay records the experts chosen at rollout time and makes the
trainer's forward (old log-probs and the update) use exactly those experts. The gate values stay
the trainer's own softmax probabilities at the replayed experts, so gradients still reach the
router weights.

transformers (>= 5) gives every softmax-top-k MoE family one router shape: a module with ``top_k``
and ``weight`` whose forward returns ``(router_logits, top_k_scores, top_k_indices)`` over the
flattened tokens (``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``, ``OlmoeTopKRouter``,
``Qwen2MoeTopKRouter`` ...). :func:`routers` finds them in layer order; :func:`check_replayable`
proves on a real forward that replaying a router's own choice reproduces its output exactly, so
families that route differently (sigmoid or grouped routers, e.g. DeepSeek-V3) are refused
instead of silently changed.

Layout: a sample's routing is an int tensor ``[T, num_moe_layers, top_k]`` aligned with its
tokens; ``-1`` marks a token without a record (it routes freely: e.g. the last token, which the
engine never fed back through the model).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor

__all__ = ["routers", "record_routing", "replay_routing", "check_replayable", "routing_for_rows",
           "RoutingRecorder"]


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The top-k routers of ``model`` in layer order (empty for a dense model)."""
    found = []
    for _name, module in model.named_modules():
        cls = type(module).__name__.lower()
        if cls.endswith(("topkrouter", "router")) and hasattr(module, "top_k") and hasattr(module, "weight"):
            found.append(module)
    return found


class RoutingRecorder:
    """Collects the expert indices of every router call while active (one list entry per forward)."""

    def __init__(self, model: torch.nn.Module):
        self.routers = routers(model)
        self.calls: list[list[Tensor]] = []  # per forward: per layer [tokens, top_k]
        self._handles: list = []

    def _hook(self, layer: int):
        def hook(_module, _inputs, output):
            if layer == 0:
                self.calls.append([])
            self.calls[-1].append(output[2].detach().to(torch.int16))
        return hook

    def __enter__(self) -> "RoutingRecorder":
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def last(self) -> Tensor:
        """The last forward's routing, ``[tokens, num_layers, top_k]``."""
        return torch.stack(self.calls[-1], dim=1)


def record_routing(model: torch.nn.Module) -> RoutingRecorder:
    return RoutingRecorder(model)


def _replayed(module: torch.nn.Module, output: tuple, chosen: Tensor) -> tuple:
    """``output`` of ``module`` with the experts of rows where ``chosen >= 0`` replaced by ``chosen``."""
    logits, scores, indices = output[0], output[1], output[2]
    chosen = chosen.to(device=indices.device, dtype=indices.dtype)
    keep = (chosen < 0).any(-1, keepdim=True)  # rows without a record route freely
    new_idx = torch.where(keep, indices, chosen)
    probs = torch.softmax(logits.float(), dim=-1)
    own_raw = probs.gather(-1, indices)
    new_raw = probs.gather(-1, new_idx)
    renorm = getattr(module, "_rlhforge_renormalises", None)
    if renorm is None:  # a property of the router: decided once (allclose is a host sync)
        renorm = module._rlhforge_renormalises = _normalises(own_raw, scores)
    if renorm:
        new_raw = new_raw / new_raw.sum(-1, keepdim=True)
    new_scores = torch.where(keep, scores, new_raw.to(scores.dtype))
    return (logits, new_scores, new_idx, *output[3:])


def _normalises(own_raw: Tensor, scores: Tensor) -> bool | None:
    """Whether the router renormalises its top-k probabilities (Mixtral; Qwen3 with norm_topk_prob); None
    when no token shows it."""
    if own_raw.numel() == 0:
        return None
    plain = torch.allclose(own_raw.to(scores.dtype), scores, rtol=1e-3, atol=1e-6)
    return not plain


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, routing: Tensor | None) -> Iterator[None]:
    """Make the next forwards of ``model`` use ``routing`` (``[tokens, num_layers, top_k]``, the
    model's flattened token order) wherever it is >= 0. ``None``: a no-op."""
    if routing is None:
        yield
        return
    found = routers(model)
    if routing.shape[1] != len(found):
        raise ValueError(f"the recorded routing has {routing.shape[1]} MoE layers but the model has {len(found)}")
    handles = []
    for layer, module in enumerate(found):
        chosen = routing[:, layer]

        def hook(mod, _inputs, output, chosen=chosen):
            if output[2].shape != chosen.shape:
                raise ValueError(f"recorded routing covers {tuple(chosen.shape)} tokens x top-k but the router "
                                 f"sees {tuple(output[2].shape)}")
            return _replayed(mod, output, chosen)
        handles.append(module.register_forward_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def routing_for_rows(routing: Tensor, rows=None) -> Tensor:
    """A micro-batch's routing (``[B, T, L, K]`` padded or ``[1, N, L, K]`` packed) in the token order
    the model sees: flattened rows, or the bounded rows of :class:`rlhforge.models.forward.PackedRows`
    (tokens of no sample get -1)."""
    if rows is None:
        return routing.reshape(-1, *routing.shape[2:])
    flat = routing.new_full((rows.input_ids.numel(), *routing.shape[2:]), -1)
    flat[rows.index.to(flat.device)] = routing[0]
    return flat


@torch.no_grad()
def check_replayable(model: torch.nn.Module, input_ids: Tensor) -> None:
    """Raise if replaying the model's own routing does not reproduce its logits exactly (a router this
    module does not know how to replay)."""
    found = routers(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no MoE router: --train.routing_replay needs an MoE model")
    with record_routing(model) as rec:
        ref = model(input_ids=input_ids, use_cache=False).logits
    with replay_routing(model, rec.last()):
        again = model(input_ids=input_ids, use_cache=False).logits
    if not torch.equal(ref, again):
        gap = (ref - again).abs().max().item()
        raise ValueError(f"routing replay does not reproduce {type(found[0]).__name__}'s own routing "
                         f"(max logit gap {gap:.3g}): this router family is not supported")
