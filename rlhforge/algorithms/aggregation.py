"""Loss aggregation: per-token loss [B, T] -> the scalar to call ``backward()`` on.

The contract
------------
One optimizer step consumes a *step batch* that is split over ``dp_size`` data-parallel ranks
and, on each rank, over any number of micro-batches (sizes may differ). For a mode below, let

    L_step = the mode's value on the whole step batch (as if it were one micro-batch on one rank)
    N_tok  = action tokens in the whole step batch (``count_tokens`` summed over all
             micro-batches of all ranks)
    N_seq  = sequences with >= 1 action token in the whole step batch (``count_sequences``, summed)

Each function returns, for one micro-batch, the value ``l_mb`` such that

    mean over ranks ( sum over that rank's micro-batches ( l_mb ) ) == L_step

exactly, and therefore the gradients too, when gradients are *summed* over micro-batches and
*averaged* over ranks (what DDP / DeepSpeed / FSDP all-reduce does). Per micro-batch:

- ``token_mean``:              ``sum_it(l m) * dp_size / N_tok``
- ``seq_mean_token_mean``:     ``sum_i [sum_t(l m) / n_i] * dp_size / N_seq``      (n_i = tokens of row i)
- ``seq_mean_token_sum``:      ``sum_i [sum_t(l m)] * dp_size / N_seq``
- ``seq_mean_token_sum_norm``: ``sum_i [sum_t(l m) / C] * dp_size / N_seq``        (Dr. GRPO, C a
  constant such as the maximum response length: ``norm_constant``)

so ``L_step`` is respectively the global token mean, the mean over sequences of the per-sequence
token mean (GRPO / GSPO / FlashREINFORCE), of the per-sequence token sum, and of the token sum
divided by C. Rows with no action token add 0 (they are not sequences for ``N_seq``; to keep
trust-region-dropped sequences in the count, count with the original mask).

If your engine divides the loss by the number of gradient-accumulation steps (DeepSpeed does
when it manages accumulation) multiply the result back, or let the engine step every
micro-batch with gradient accumulation handled here. When ``global_tokens`` / ``global_seqs``
is None the local count of this micro-batch is used (with ``dp_size=1`` that is the plain local
mean, for single-process evaluation).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ._utils import as_bool, check_same_shape, lookup

__all__ = [
    "aggregate_token_mean",
    "aggregate_seq_mean_token_mean",
    "aggregate_seq_mean_token_sum",
    "aggregate_seq_mean_token_sum_norm",
    "AGGREGATIONS",
    "get_aggregation",
    "aggregate_loss",
    "count_tokens",
    "count_sequences",
]


def count_tokens(mask: Tensor) -> int:
    """Action tokens in ``mask`` [B, T]."""
    return int(as_bool(mask).sum().item())


def count_sequences(mask: Tensor) -> int:
    """Rows of ``mask`` [B, T] with at least one action token."""
    return int(as_bool(mask).any(dim=-1).sum().item())


def _masked(loss: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    check_same_shape(loss=loss, mask=mask)
    m = as_bool(mask)
    return torch.where(m, loss, torch.zeros((), dtype=loss.dtype, device=loss.device)), m


def _scale(total: Tensor, count: float, dp_size: int) -> Tensor:
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1 (got {dp_size})")
    if count < 0:
        raise ValueError(f"global count must be >= 0 (got {count})")
    return total * (dp_size / max(float(count), 1.0))


def aggregate_token_mean(
    loss: Tensor, mask: Tensor, *, global_tokens: float | None = None, global_seqs: float | None = None,
    dp_size: int = 1, norm_constant: float | None = None,
) -> Tensor:
    """``sum(loss * mask) * dp_size / global_tokens``. [B, T], [B, T] -> 0-dim. ``global_seqs``
    and ``norm_constant`` are ignored (common signature)."""
    z, m = _masked(loss, mask)
    count = m.sum().item() if global_tokens is None else global_tokens
    return _scale(z.sum(), count, dp_size)


def _per_seq(z: Tensor, m: Tensor, global_seqs, dp_size, seq_values: Tensor) -> Tensor:
    count = m.any(-1).sum().item() if global_seqs is None else global_seqs
    return _scale(seq_values.sum(), count, dp_size)


def aggregate_seq_mean_token_mean(
    loss: Tensor, mask: Tensor, *, global_tokens: float | None = None, global_seqs: float | None = None,
    dp_size: int = 1, norm_constant: float | None = None,
) -> Tensor:
    """``sum_i [sum_t loss*mask / n_i] * dp_size / global_seqs``. [B, T] -> 0-dim."""
    z, m = _masked(loss, mask)
    n = m.sum(-1).clamp_min(1).to(z.dtype)
    return _per_seq(z, m, global_seqs, dp_size, z.sum(-1) / n)


def aggregate_seq_mean_token_sum(
    loss: Tensor, mask: Tensor, *, global_tokens: float | None = None, global_seqs: float | None = None,
    dp_size: int = 1, norm_constant: float | None = None,
) -> Tensor:
    """``sum_i [sum_t loss*mask] * dp_size / global_seqs``. [B, T] -> 0-dim."""
    z, m = _masked(loss, mask)
    return _per_seq(z, m, global_seqs, dp_size, z.sum(-1))


def aggregate_seq_mean_token_sum_norm(
    loss: Tensor, mask: Tensor, *, global_tokens: float | None = None, global_seqs: float | None = None,
    dp_size: int = 1, norm_constant: float | None = None,
) -> Tensor:
    """Dr. GRPO: ``sum_i [sum_t loss*mask / norm_constant] * dp_size / global_seqs``. [B, T] -> 0-dim.

    ``norm_constant`` (required, > 0) is a constant such as the maximum response length.
    """
    if norm_constant is None or not norm_constant > 0:
        raise ValueError(
            f"seq_mean_token_sum_norm needs norm_constant > 0, e.g. the max response length (got {norm_constant})"
        )
    z, m = _masked(loss, mask)
    return _per_seq(z, m, global_seqs, dp_size, z.sum(-1) / float(norm_constant))


AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "token_mean": aggregate_token_mean,
    "seq_mean_token_mean": aggregate_seq_mean_token_mean,
    "seq_mean_token_sum": aggregate_seq_mean_token_sum,
    "seq_mean_token_sum_norm": aggregate_seq_mean_token_sum_norm,
}


def get_aggregation(name: str) -> Callable[..., Tensor]:
    """Aggregation called ``name`` (``token-mean`` spelling accepted); ValueError lists them."""
    return lookup(AGGREGATIONS, name, "loss aggregation mode")


def aggregate_loss(
    loss: Tensor,
    mask: Tensor,
    mode: str = "token_mean",
    *,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    dp_size: int = 1,
    norm_constant: float | None = None,
) -> Tensor:
    """Dispatch to the mode's function (see the module docstring for the contract)."""
    return get_aggregation(mode)(
        loss, mask, global_tokens=global_tokens, global_seqs=global_seqs, dp_size=dp_size, norm_constant=norm_constant
    )
