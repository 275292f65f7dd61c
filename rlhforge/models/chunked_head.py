"""Log-probs and entropy straight from the last hidden states: the lm_head applied chunk by chunk, its
logits never materialised for the whole batch (docs/performance.md, "Logits at real vocabularies").

At a 151,936-token vocabulary a batch of 8 x 1k tokens has 1.2e9 logits: 2.5 GB in bf16, 5 GB in
fp32, more than a 0.6B model's weights, gradients and Adam states together. Here the model runs with
its output embedding replaced by an identity for the duration of the call (:func:`deferred_head`), so
``outputs.logits`` holds the ``[B, T, H]`` hidden states. :func:`head_logprobs` then computes, for
``c`` positions at a time, ``lm_head(h)`` -> fp32 -> ``/ temperature`` -> the label's log-prob (and the
entropy), inside :func:`torch.utils.checkpoint.checkpoint`: only the chunk's hidden states are kept,
and the backward recomputes the chunk's logits. The peak is one chunk's logits and their softmax
(``c x V`` fp32) instead of ``B x T x V``.

The head is called as the module it is, so every strategy sees an ordinary module call: ZeRO-3's
hooks gather its weight (also in the recompute; a frozen one, LoRA's, is multiplied through a view of it:
:func:`_call_head`), FSDP2's root keeps it unsharded for the backward,
LoRA / tied embeddings work unchanged. Results equal the full-logits path (fp32 per chunk, the same
per-row matmul) to float rounding; tests/models/test_chunked_head.py checks it for every family.

Models whose forward does more than ``lm_head(hidden)`` (a final logit soft-cap, a logit scale) keep
the full-logits path (:func:`head_for`).

**The log-prob on a plain head** (and the entropy, where it is not differentiated), an ``nn.Linear`` with
ordinary tensors (no ZeRO-3 or FSDP2 parameters, no hooks on it, no autocast), goes through
:class:`_HeadLogprob`, one autograd function for all the chunks of a call, which writes the backward by hand:
the forward keeps the hidden states, the log-sum-exps and, while the call's probabilities fit in
:data:`SAVED_PROBS_BYTES`, the probabilities (else the backward recomputes the logits); the backward turns
the probabilities into the logits' gradient, ``g * (onehot - softmax)``, before the two matmuls, and
accumulates the weight's gradient over the chunks in its matmul. The autograd graph of the checkpointed chunk
instead builds a zero-filled ``[c, V]`` gradient for the gather, another for the log-sum-exp, adds them and
divides by the temperature: at a 151,936-token vocabulary those passes over the logits cost about as much
as the head's matmuls (docs/performance.md). The log-probs and the hidden states' gradient are those of the
checkpointed chunks bit for bit, the weight's and bias's gradients to the rounding of their sum over chunks
(bit for bit in one chunk), the entropy to float rounding (tests/models/test_chunked_head.py).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import Tensor, nn

from rlhforge.models.cpu_linear import CpuLinear, is_plain_linear, onednn_linear, weight_grad

__all__ = ["head_for", "deferred_head", "head_logprobs", "chunk_rows"]

#: most elements of one chunk's fp32 logits (32 Mi: 128 MiB; ~220 positions at a 151,936 vocabulary). The
#: backward's weight-gradient matmul has the chunk's positions as its inner dimension: on one CPU core it ran at
#: 51 GFLOP/s with 110 positions, 74 with 256 and 88 with 512 (docs/performance.md)
CHUNK_ELEMENTS = 32 << 20

#: a :class:`~rlhforge.models.cpu_linear.CpuLinear` head runs the fused head's matmuls on oneDNN, as its forward
#: does. oneDNN's op has no ``out=``: where the shared buffers or the weight's gradient are larger than this, its
#: products are made this many bytes at a time (blocks of the vocabulary) and copied or added into them, so
#: the peak memory stays that of ``mm``/``addmm_`` (at a 151,936 vocabulary a whole [V, H] product per chunk
#: took peak RSS from 2.3 to 3.0 GB)
ONEDNN_BLOCK_BYTES = 32 << 20
#: the fused chunks (:class:`_HeadLogprob`) of one call keep their fp32 probabilities for the backward, instead
#: of recomputing the logits there, when all of them take at most this many bytes (512 MiB: ~880 positions at
#: a 151,936 vocabulary; the recompute is one of the head's four matmuls)
SAVED_PROBS_BYTES = 512 << 20


class _Passthrough(nn.Module):
    """Stands in for the output embedding while the model runs: returns the hidden states."""

    def forward(self, hidden: Tensor) -> Tensor:
        return hidden


def _config(model):
    for m in (model, getattr(model, "module", None), getattr(model, "base_model", None)):
        cfg = getattr(m, "config", None)
        if cfg is not None:
            return cfg
    return None


def head_for(model) -> tuple[nn.Module, nn.Module, str] | None:
    """``(lm_head, its parent module, attribute name)`` where the chunked path applies, else None: the
    output embedding is a Linear held by one parent, and the config asks for nothing after it."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Linear):
        return None
    cfg = _config(model)
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is None:
            continue
        if getattr(c, "final_logit_softcapping", None) or getattr(c, "logit_scale", None) not in (None, 1, 1.0):
            return None
        if getattr(c, "logits_scaling", 1.0) not in (None, 1, 1.0):
            return None
    owners = [(parent, name) for parent in model.modules() for name, child in parent.named_children() if child is head]
    if len(owners) != 1:
        return None
    return head, owners[0][0], owners[0][1]


@contextlib.contextmanager
def deferred_head(model, enabled: bool = True) -> Iterator[nn.Module | None]:
    """Run ``model`` with its output embedding deferred: yields the head (``outputs.logits`` are then
    hidden states), or None where :func:`head_for` does not apply (``outputs.logits`` are logits)."""
    found = head_for(model) if enabled else None
    if found is None:
        yield None
        return
    head, parent, name = found
    setattr(parent, name, _Passthrough())
    try:
        yield head
    finally:
        setattr(parent, name, head)


def chunk_rows(vocab: int, chunk_elements: int | None = None, positions: int | None = None) -> int:
    """Positions per chunk: at most ``CHUNK_ELEMENTS`` fp32 logits (at least 16 positions); with ``positions``
    (the call's count) the fewest chunks of that bound, made even (two chunks of 171 rather than 220 + 122: a
    short last chunk runs its matmuls at a lower rate)."""
    most = max(16, (chunk_elements or CHUNK_ELEMENTS) // max(vocab, 1))
    if not positions or positions <= most:
        return most
    chunks = -(-positions // most)
    return -(-positions // chunks)


def _zero3_frozen(head: nn.Module) -> bool:
    """The head holds a frozen ZeRO-3 parameter (LoRA: the base model's lm_head / tied embedding)."""
    return any(hasattr(p, "ds_id") and not p.requires_grad for p in head.parameters(recurse=False))


def _linear_on_aliases(head: nn.Linear):
    """``head.forward`` computing on views of the weight and bias, made while ZeRO-3's hooks hold them gathered."""

    def forward(hidden: Tensor) -> Tensor:
        bias = head.bias.view_as(head.bias) if head.bias is not None else None
        return nn.functional.linear(hidden, head.weight.view_as(head.weight), bias)

    return forward


def _call_head(head: nn.Module, hidden: Tensor) -> Tensor:
    """``head(hidden)``, as a module call (ZeRO-3's hooks gather the weight before and free it after).

    A frozen ZeRO-3 weight is multiplied through a view of it. In the backward's recompute of a chunk
    (:func:`torch.utils.checkpoint.checkpoint`, non-reentrant) torch keeps the tensors the matmul saves
    as they are when they do not require grad (a trainable weight is kept as a detached alias), so it
    would keep the frozen parameter itself; ZeRO-3 frees it at the end of the recomputed head call,
    ``param.data = torch.empty(0)`` (DeepSpeed attributes a recompute's frozen parameters to the module
    whose backward is running, partitioned_param_coordinator.py ``_fetch_sub_module_impl``, and none is:
    the head runs outside the model's forward), and the checkpoint then finds shape ``[0]`` where the
    forward saved ``[V, H]`` (``CheckpointError``). A view keeps the gathered values alive until the
    chunk's backward has used them, as the detached alias of a trainable weight does."""
    if not (is_plain_linear(head) and _zero3_frozen(head)):
        return head(hidden)
    own = head.__dict__.get("forward")
    head.forward = _linear_on_aliases(head)
    try:
        return head(hidden)
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


def _chunk(head: nn.Module, hidden: Tensor, labels: Tensor, temperature: float, entropy: bool, entropy_grad: bool):
    z = _call_head(head, hidden).float() / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, labels[:, None]).squeeze(-1) - lse
    if not entropy:
        return logp, None
    with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
        return logp, lse - (torch.softmax(z, dim=-1) * z).sum(-1)


class _HeadLogprob(torch.autograd.Function):
    """``log softmax(hidden @ weight.T + bias) / temperature)[labels]`` for a whole call, ``rows`` positions at a
    time (module docstring), and with ``entropy`` the distribution's entropy, not differentiated (an empty tensor
    otherwise). With ``keep_probs`` the forward keeps every chunk's probabilities for the backward, else the
    backward recomputes the logits. Inputs: hidden ``[N, H]``, labels ``[N]``, weight ``[V, H]``, bias.

    One function for all the chunks, so that the chunks share their ``[rows, V]`` buffers (the logits where they
    are not kept, the logits' gradient) and the weight's gradient is accumulated in the matmul that makes it
    (``addmm_``) instead of a ``[V, H]`` gradient per chunk that autograd then adds: at a 151,936-token
    vocabulary each of those is a 311 MB block the allocator maps afresh and the kernel zeroes, and a pass
    over it."""

    @staticmethod
    def forward(ctx, hidden: Tensor, labels: Tensor, temperature: float, entropy: bool, keep_probs: bool, rows: int,
                weight: Tensor, bias: Tensor | None, onednn: bool = False):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if entropy else logp.new_empty(0)
        kept, buffers, vocab = [], {}, weight.shape[0]
        for s in range(0, n, rows):
            hid, lab = hidden[s : s + rows], labels[s : s + rows]
            # kept logits need their own storage; oneDNN makes a new tensor where it fits in one product
            shared = None if keep_probs or not _shares(onednn, hid, vocab) else _buffer(buffers, "z", hid, vocab)
            z = _scaled_logits(hid, weight, bias, temperature, out=shared, onednn=onednn)
            # torch.logsumexp's own steps (so the same bits), its exp(z - max) in a shared buffer instead of a
            # new [c, V] tensor, which the entropy reuses
            top = z.amax(-1, keepdim=True)
            top.masked_fill_(top.abs() == float("inf"), 0.0)
            unnorm = torch.sub(z, top, out=_buffer(buffers, "e", hid, vocab)).exp_()
            total = unnorm.sum(-1)
            chunk_lse = total.log().add_(top[:, 0])
            lse[s : s + rows] = chunk_lse
            logp[s : s + rows] = z.gather(-1, lab[:, None]).squeeze(-1) - chunk_lse
            if entropy:  # sum(p * z) as one matvec per row
                ent[s : s + rows] = chunk_lse - torch.bmm(unnorm[:, None, :], z[:, :, None])[:, 0, 0] / total
            if keep_probs:
                kept.append(z.sub_(chunk_lse[:, None]).exp_())  # the logits' own storage: no second [c, V] buffer
            del z, unnorm
        ctx.mark_non_differentiable(ent)
        ctx.save_for_backward(hidden, labels, weight, bias, lse, *kept)
        ctx.temperature, ctx.rows, ctx.onednn = temperature, rows, onednn
        return logp, ent

    @staticmethod
    def backward(ctx, grad: Tensor, _grad_entropy: Tensor):
        hidden, labels, weight, bias, lse, *kept = ctx.saved_tensors
        temperature, rows, onednn = ctx.temperature, ctx.rows, ctx.onednn
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[6]
        want_bias = bias is not None and ctx.needs_input_grad[7]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = grad_bias = None
        buffers, vocab = {}, weight.shape[0]
        with torch.no_grad():
            for i, s in enumerate(range(0, hidden.shape[0], rows)):
                hid, lab, gr = hidden[s : s + rows], labels[s : s + rows], grad[s : s + rows]
                # d logp / d z = onehot(label) - softmax(z); recomputed in a shared buffer where not kept
                if kept:
                    g = _buffer(buffers, "g", hid, vocab)
                    torch.mul(kept[i], -gr[:, None], out=g)  # the saved tensor stays as it was (retain_graph)
                else:
                    shared = _buffer(buffers, "g", hid, vocab) if _shares(onednn, hid, vocab) else None
                    g = _scaled_logits(hid, weight, bias, temperature, out=shared, onednn=onednn)
                    g.sub_(lse[s : s + rows, None]).exp_().mul_(-gr[:, None])
                g.scatter_add_(-1, lab[:, None], gr[:, None].to(g.dtype))
                if temperature != 1.0:
                    g.div_(temperature)
                g = g.to(weight.dtype)
                if want_hidden and onednn:
                    grad_hidden[s : s + rows] = onednn_linear(g, weight.t(), None)
                elif want_hidden:
                    torch.mm(g, weight, out=grad_hidden[s : s + rows])
                if want_weight and onednn:
                    grad_weight = _onednn_grad_weight(grad_weight, g, hid)
                elif want_weight:
                    # contiguous like the weight: accumulating a transposed [V, H] gradient is a strided pass
                    if grad_weight is None:
                        grad_weight = g.t().mm(hid)
                    else:
                        grad_weight.addmm_(g.t(), hid)
                if want_bias:
                    grad_bias = g.sum(0) if grad_bias is None else grad_bias.add_(g.sum(0))
        return grad_hidden, None, None, None, None, None, grad_weight, grad_bias, None


def _shares(onednn: bool, hidden: Tensor, vocab: int) -> bool:
    """Whether a chunk's logits go into a shared buffer: always with ``mm``; with oneDNN only where they are
    made in blocks (larger than :data:`ONEDNN_BLOCK_BYTES`), else its one product is the chunk's own tensor."""
    return not onednn or hidden.shape[0] * vocab * 4 > ONEDNN_BLOCK_BYTES


def _block(budget_bytes: int, row_elements: int) -> int:
    """Rows of a ``[rows, row_elements]`` fp32 block that fit in ``budget_bytes`` (at least one)."""
    return max(1, budget_bytes // (4 * max(1, row_elements)))


def _onednn_grad_weight(grad_weight: Tensor | None, g: Tensor, hid: Tensor) -> Tensor:
    """``grad_weight + g.T @ hid`` (``g.T @ hid`` when None) by oneDNN, ``[V, H]``, at most
    :data:`ONEDNN_BLOCK_BYTES` of product at a time."""
    vocab, block = g.shape[1], _block(ONEDNN_BLOCK_BYTES, hid.shape[1])
    if grad_weight is None and vocab <= block:
        return weight_grad(g, hid)  # the smaller transposition (cpu_linear.weight_grad)
    first = grad_weight is None
    if first:
        grad_weight = torch.empty(vocab, hid.shape[1], dtype=hid.dtype, device=hid.device)
    for v in range(0, vocab, block):
        part = onednn_linear(g[:, v : v + block].t(), hid.t(), None)
        if first:
            grad_weight[v : v + block] = part
        else:
            grad_weight[v : v + block].add_(part)
    return grad_weight


def _buffer(buffers: dict, name: str, hidden: Tensor, vocab: int) -> Tensor:
    """A ``[rows, vocab]`` fp32 buffer shared by the chunks of one call (the first chunk is the largest), sliced
    to this chunk's rows."""
    if name not in buffers:
        buffers[name] = torch.empty(hidden.shape[0], vocab, dtype=torch.float32, device=hidden.device)
    return buffers[name][: hidden.shape[0]]


def _scaled_logits(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float,
                   out: Tensor | None = None, onednn: bool = False) -> Tensor:
    """``linear(hidden, weight, bias)`` in fp32, divided by the temperature (as :func:`_chunk`); into ``out``
    (fp32, ``[rows, V]``) where given, with the kernel ``linear`` runs (``mm`` / ``addmm``); with ``onednn``
    (a :class:`~rlhforge.models.cpu_linear.CpuLinear` head) by oneDNN, as that layer's forward, into a new
    tensor (``out`` unused)."""
    if onednn:
        if out is None or out.numel() * 4 <= ONEDNN_BLOCK_BYTES:
            z = onednn_linear(hidden, weight, bias)
        else:  # into the shared buffer, a block of the vocabulary at a time
            z, block = out, _block(ONEDNN_BLOCK_BYTES, hidden.shape[0])
            for v in range(0, weight.shape[0], block):
                z[:, v : v + block] = onednn_linear(hidden, weight[v : v + block],
                                                    None if bias is None else bias[v : v + block])
        return z.div_(temperature) if temperature != 1.0 else z
    if out is None:
        z = nn.functional.linear(hidden, weight, bias).float()
        return z / temperature if temperature != 1.0 else z
    if weight.dtype != torch.float32:
        out.copy_(nn.functional.linear(hidden, weight, bias))
    elif bias is None:
        torch.mm(hidden, weight.t(), out=out)
    else:
        torch.addmm(bias, hidden, weight.t(), out=out)
    return out.div_(temperature) if temperature != 1.0 else out


def _plain_head(head: nn.Module, hidden: Tensor) -> bool:
    """Whether the chunk's head can go through :class:`_HeadLogprob`: an ``nn.Linear`` whose parameters are
    ordinary tensors (not ZeRO-3's or FSDP2's), without module hooks (anything may hang on a call), outside
    autocast (the recompute would need its dtypes) and in the hidden states' dtype."""
    if not is_plain_linear(head) or head._forward_hooks or head._forward_pre_hooks:
        return False
    if torch.is_autocast_enabled(hidden.device.type):
        return False
    params = [head.weight] + ([head.bias] if head.bias is not None else [])
    if any(hasattr(p, "ds_id") or type(p) not in (nn.Parameter, Tensor) or p.dtype != hidden.dtype for p in params):
        return False
    return not (nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)


def head_logprobs(head: nn.Module, hidden: Tensor, labels: Tensor, temperature: float = 1.0, *,
                  entropy: bool = False, entropy_grad: bool = True, chunk: int | None = None
                  ) -> tuple[Tensor, Tensor | None]:
    """``log softmax(head(hidden) / temperature)[labels]`` (and the entropy of that distribution) for
    ``hidden`` ``[*, H]`` and ``labels`` ``[*]``, ``chunk`` positions at a time with recomputation in the
    backward. Returns fp32 ``(logprobs [*], entropy [*] or None)``, differentiable w.r.t. ``hidden`` and
    the head's parameters (the entropy only with ``entropy_grad``)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (got {temperature})")
    lead = hidden.shape[:-1]
    flat, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1).long()
    rows = chunk or chunk_rows(head.out_features, positions=flat.shape[0])
    grad = torch.is_grad_enabled() and (flat.requires_grad or any(p.requires_grad for p in head.parameters()))
    # the fused head: the log-prob's gradient by hand, the entropy (if asked) without one, all the chunks in one
    # function; the probabilities kept from the forward to the backward when all of this call's fit in
    # SAVED_PROBS_BYTES
    if flat.shape[0] and grad and not (entropy and entropy_grad) and _plain_head(head, flat):
        keep = flat.shape[0] * head.out_features * 4 <= SAVED_PROBS_BYTES
        onednn = type(head) is CpuLinear and head.weight.dtype == torch.float32
        lp, ent = _HeadLogprob.apply(flat, flat_labels, float(temperature), entropy, keep, rows, head.weight,
                                     head.bias, onednn)
        return lp.reshape(lead), (ent.reshape(lead) if entropy else None)
    lps, ents = [], []
    for s in range(0, flat.shape[0], rows):
        hid, lab = flat[s : s + rows], flat_labels[s : s + rows]
        args = (head, hid, lab, float(temperature), entropy, entropy_grad)
        if grad:
            from torch.utils.checkpoint import checkpoint

            lp, ent = checkpoint(_chunk, *args, use_reentrant=False)
        else:
            lp, ent = _chunk(*args)
        lps.append(lp)
        ents.append(ent)
    if not lps:  # no position: keep the graph connected
        empty = flat.sum(-1).float()
        return empty.reshape(lead), (empty.reshape(lead) if entropy else None)
    logp = torch.cat(lps).reshape(lead)
    return logp, (torch.cat(ents).reshape(lead) if entropy else None)
