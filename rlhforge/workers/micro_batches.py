"""How the RL workers cut their shard into micro-batches, and packed micro-batches as rows.

- :func:`micro_batch_groups`: fixed ``micro_batch_size`` chunks (the default), or, with
  ``--train.dynamic_batch_enable``, token-budget micro-batches
  (:func:`rlhforge.data.balancing.micro_batch_groups`) whose number is agreed over the DP ranks with
  one ``all_reduce(max)``: every rank runs the same number of passes, so the collectives inside them
  (DDP / ZeRO gradient reduction, ZeRO-3 parameter gathers) line up.
- :func:`packed_as_rows`: a packed micro-batch's per-token tensors ``[1, N]`` -> ``[S, T]`` rows, one
  per sample, so that sequence-level terms (seq-mean loss aggregation, GSPO's sequence ratio) see
  samples and not the whole packed row.

The budgets come from :meth:`rlhforge.config.rl.RLConfig.token_budgets`.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from rlhforge.data import balancing

__all__ = ["micro_batch_groups", "max_over_ranks", "packed_as_rows"]


def max_over_ranks(all_reduce: Callable[..., torch.Tensor]) -> Callable[[int], int]:
    """``k -> max of k over the ranks`` with a strategy's ``all_reduce(tensor, op)`` (one collective)."""
    return lambda k: int(all_reduce(torch.tensor(float(k)), op="max"))


def micro_batch_groups(lengths: Sequence[int], micro_batch_size: int, max_tokens: int | None,
                       all_reduce: Callable[..., torch.Tensor] | None = None) -> list[list[int]]:
    """Index groups of a rank's samples (:func:`rlhforge.data.balancing.micro_batch_groups`), the
    token-budget count maxed over the ranks with ``all_reduce`` (None: one rank)."""
    agree = max_over_ranks(all_reduce) if all_reduce is not None else None
    return balancing.micro_batch_groups(lengths, micro_batch_size, max_tokens, agree)


def packed_as_rows(batch: dict, *tensors: torch.Tensor) -> tuple:
    """A packed micro-batch (``seq_lens``) and ``[1, N]`` tensors -> the same with every ``[1, N]``
    tensor (batch fields and ``tensors``) as ``[S, T]`` right-padded rows (zeros; ``loss_mask`` 0 on
    padding), differentiable. Other fields are kept as they are."""
    seq_lens = list(batch["seq_lens"])
    n = sum(seq_lens)

    def rows(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.utils.rnn.pad_sequence(list(torch.split(x[0], seq_lens)), batch_first=True)

    out = {k: rows(v) if torch.is_tensor(v) and v.dim() == 2 and v.shape == (1, n) else v for k, v in batch.items()}
    return (out, *(rows(t) for t in tensors))
