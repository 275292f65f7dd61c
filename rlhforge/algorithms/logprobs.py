"""Per-token log-probabilities and entropy from logits, chunked so memory stays bounded.

Both functions divide the logits by the sampling ``temperature`` first, so training-time
log-probs describe the same distribution the rollout engine sampled from.

Memory. A 150k vocabulary x 8k tokens batch is 1.2e9 logits; a full fp32 softmax of it is
4.8 GB on top of the logits. With ``chunk_size=c`` the flattened rows (B*T of them) are processed
``c`` at a time: each chunk is upcast to fp32, reduced with ``logsumexp`` and gathered, so the
largest temporary is ``c x V`` fp32. Autograd goes through a custom ``torch.autograd.Function``
that saves only the logits (which exist anyway) and one fp32 number per row, and recomputes each
chunk's softmax in the backward pass, so the backward is chunked too. Its gradient (one tensor
the size of the logits, in their dtype) is the only full-size allocation. Double backward is
not supported on the chunked path; pass ``chunk_size=None`` for the plain (direct) computation.

Outputs are fp32 (fp64 for fp64 logits).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

__all__ = ["logprobs_from_logits", "entropy_from_logits", "DEFAULT_CHUNK_SIZE"]

#: Rows (flattened positions) per chunk: 512 x 150k vocab x 4 bytes = 300 MB of fp32 temporaries.
DEFAULT_CHUNK_SIZE = 512


def _check(logits: Tensor, temperature: float, chunk_size: int | None) -> None:
    if logits.dim() < 1:
        raise ValueError("logits need a trailing vocabulary dimension")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (got {temperature})")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int or None (got {chunk_size})")


def _compute_dtype(x: Tensor) -> torch.dtype:
    """fp32 for half/bf16/fp32 logits; fp64 stays fp64."""
    return torch.promote_types(x.dtype, torch.float32)


def _chunks(n: int, size: int):
    for start in range(0, n, size):
        yield start, min(start + size, n)


class _ChunkedLogProbs(torch.autograd.Function):
    """log softmax(z / temperature)[label] row by row in chunks; logits [N, V], labels [N]."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, temperature: float, chunk_size: int) -> Tensor:
        n = logits.shape[0]
        dt = _compute_dtype(logits)
        out = torch.empty(n, dtype=dt, device=logits.device)
        lse = torch.empty(n, dtype=dt, device=logits.device)
        for s, e in _chunks(n, chunk_size):
            z = logits[s:e].to(dt) / temperature
            lse[s:e] = torch.logsumexp(z, dim=-1)
            out[s:e] = z.gather(-1, labels[s:e, None]).squeeze(-1) - lse[s:e]
        ctx.save_for_backward(logits, labels, lse)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, labels, lse = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        grad = torch.empty_like(logits)
        dt = lse.dtype
        grad_out = grad_out.to(dt)
        for s, e in _chunks(logits.shape[0], chunk_size):
            go = grad_out[s:e, None]
            # d logp[label] / d z_k = 1[k = label] - softmax_k ; then d z / d logits = 1 / T
            g = (logits[s:e].to(dt) / temperature).sub_(lse[s:e, None]).exp_().mul_(-go)
            g.scatter_add_(-1, labels[s:e, None], go)
            grad[s:e] = g.div_(temperature).to(grad.dtype)
        return grad, None, None, None


def _entropy_terms(z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """For fp32 scaled logits z [n, V]: softmax p, log-softmax, entropy [n] (safe for -inf logits)."""
    logp = torch.log_softmax(z, dim=-1)
    p = logp.exp()
    # 0 * log 0 = 0; select before multiplying so -inf never meets 0 (also in the backward)
    safe_logp = torch.where(p > 0, logp, torch.zeros((), dtype=z.dtype, device=z.device))
    return p, logp, -(p * safe_logp).sum(-1)


class _ChunkedEntropy(torch.autograd.Function):
    """Entropy of softmax(z / temperature) row by row in chunks; logits [N, V]."""

    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float, chunk_size: int) -> Tensor:
        n = logits.shape[0]
        dt = _compute_dtype(logits)
        out = torch.empty(n, dtype=dt, device=logits.device)
        for s, e in _chunks(n, chunk_size):
            out[s:e] = _entropy_terms(logits[s:e].to(dt) / temperature)[2]
        ctx.save_for_backward(logits, out)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, entropy = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        grad = torch.empty_like(logits)
        grad_out = grad_out.to(entropy.dtype)
        for s, e in _chunks(logits.shape[0], chunk_size):
            p, logp, _ = _entropy_terms(logits[s:e].to(entropy.dtype) / temperature)
            # dH/dz_k = -p_k (log p_k + H); zero where p_k = 0 (including -inf logits)
            d = torch.where(p > 0, -p * (logp + entropy[s:e, None]), torch.zeros_like(p))
            grad[s:e] = (d * grad_out[s:e, None] / temperature).to(grad.dtype)
        return grad, None, None


def logprobs_from_logits(
    logits: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Log-probability of each label token under ``softmax(logits / temperature)``.

    Args:
        logits: [B, T, V] (any leading shape ``[*, V]``), any float dtype; upcast to fp32 per chunk.
        labels: [B, T] (same leading shape) int64 token ids in ``[0, V)``. Positions the caller
            will mask out still need a valid id (use 0 for padding).
        temperature: > 0, the sampling temperature.
        chunk_size: rows per chunk (see the module docstring); ``None`` computes directly with
            one full ``log_softmax`` (reference path, supports double backward).

    Returns:
        [B, T] fp32 (fp64 for fp64 logits) log-probs, differentiable w.r.t. ``logits``.
    """
    _check(logits, temperature, chunk_size)
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels {tuple(labels.shape)} must match logits without the vocab dim {tuple(logits.shape[:-1])}"
        )
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    flat, flat_labels = logits.reshape(-1, vocab), labels.reshape(-1).long()
    if chunk_size is None:
        logp = torch.log_softmax(flat.to(_compute_dtype(flat)) / temperature, dim=-1)
        out = logp.gather(-1, flat_labels[:, None]).squeeze(-1)
    elif flat.shape[0] == 0:
        out = flat.to(_compute_dtype(flat)).sum(-1)  # empty, keeps autograd connectivity
    else:
        out = _ChunkedLogProbs.apply(flat, flat_labels, float(temperature), int(chunk_size))
    return out.reshape(lead)


def entropy_from_logits(
    logits: Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Entropy ``H = -sum_v p_v log p_v`` of ``p = softmax(logits / temperature)`` per position.

    Args:
        logits: [B, T, V] (any leading shape ``[*, V]``); ``-inf`` logits (banned tokens) are fine.
        temperature: > 0.
        chunk_size: rows per chunk; ``None`` for the direct computation.

    Returns:
        [B, T] fp32 (fp64 for fp64 logits) entropies in nats, differentiable w.r.t. ``logits``.
    """
    _check(logits, temperature, chunk_size)
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    if chunk_size is None:
        out = _entropy_terms(flat.to(_compute_dtype(flat)) / temperature)[2]
    elif flat.shape[0] == 0:
        out = flat.to(_compute_dtype(flat)).sum(-1)
    else:
        out = _ChunkedEntropy.apply(flat, float(temperature), int(chunk_size))
    return out.reshape(lead)
