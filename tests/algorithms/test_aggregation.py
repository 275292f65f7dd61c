"""Loss aggregation: hand values, and the rank / micro-batch invariance contract."""

import math

import pytest
import torch

from rlhforge.algorithms.aggregation import (
    AGGREGATIONS,
    aggregate_loss,
    count_sequences,
    count_tokens,
    get_aggregation,
)

D = torch.float64


def test_hand_values():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, math.inf, math.nan]], dtype=D)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the last row has no action token
    # token_mean: (1 + 2 + 4) / 3 = 2.333333
    assert aggregate_loss(loss, mask, "token_mean").item() == pytest.approx(7 / 3)
    # seq_mean_token_mean: (1.5 + 4) / 2 sequences = 2.75
    assert aggregate_loss(loss, mask, "seq_mean_token_mean").item() == pytest.approx(2.75)
    # seq_mean_token_sum: (3 + 4) / 2 = 3.5
    assert aggregate_loss(loss, mask, "seq_mean_token_sum").item() == pytest.approx(3.5)
    # seq_mean_token_sum_norm with C = 4: (3/4 + 4/4) / 2 = 0.875
    assert aggregate_loss(loss, mask, "seq_mean_token_sum_norm", norm_constant=4).item() == pytest.approx(0.875)
    # global counts and dp_size: token_mean = 7 * 2 / 6 = 2.333333 ; seq = (1.5 + 4) * 2 / 4 = 2.75
    assert aggregate_loss(loss, mask, "token_mean", global_tokens=6, dp_size=2).item() == pytest.approx(7 / 3)
    assert aggregate_loss(loss, mask, "seq_mean_token_mean", global_seqs=4, dp_size=2).item() == pytest.approx(2.75)
    assert count_tokens(mask) == 3 and count_sequences(mask) == 2


def test_all_masked_gives_zero_with_a_graph():
    x = torch.ones(2, 3, requires_grad=True)
    for mode in AGGREGATIONS:
        out = aggregate_loss(x * 2, torch.zeros(2, 3), mode, norm_constant=3)
        assert out.item() == 0.0
        out.backward()
        assert x.grad.abs().sum().item() == 0.0
        x.grad = None


def _split_sizes(n, parts):
    """Deterministic uneven split of n items into `parts` pieces (some may be empty)."""
    weights = [1 + (3 * i) % 4 for i in range(parts)]
    sizes = [n * w // sum(weights) for w in weights]
    sizes[-1] += n - sum(sizes)
    return sizes


@pytest.mark.parametrize("mode", list(AGGREGATIONS))
def test_invariance_over_ranks_and_micro_batches(mode):
    g = torch.Generator().manual_seed(0)
    B, T, F = 13, 6, 3
    x = torch.randn(B, T, F, generator=g, dtype=D)
    y = torch.randn(B, T, generator=g, dtype=D)
    lengths = torch.tensor([0, 1, 6, 3, 2, 5, 6, 4, 1, 0, 3, 6, 2])  # uneven, two empty rows
    mask = torch.arange(T)[None, :] < lengths[:, None]
    theta = torch.tensor([0.3, -0.7, 1.1], dtype=D, requires_grad=True)
    kw = {"norm_constant": 6.0} if mode == "seq_mean_token_sum_norm" else {}

    def per_token(rows):
        return ((x[rows] @ theta) - y[rows]) ** 2

    whole = aggregate_loss(per_token(slice(None)), mask, mode, **kw)
    (whole_grad,) = torch.autograd.grad(whole, theta)
    n_tok, n_seq = count_tokens(mask), count_sequences(mask)
    assert n_tok == 39 and n_seq == 11

    for ranks in (1, 2, 4):
        rank_values, rank_grads = [], []
        start = 0
        for r_size in _split_sizes(B, ranks):
            rank_rows = list(range(start, start + r_size))
            start += r_size
            total = torch.zeros((), dtype=D)
            mb_start = 0
            for mb_size in _split_sizes(len(rank_rows), 3):  # 3 uneven micro-batches per rank
                rows = rank_rows[mb_start : mb_start + mb_size]
                mb_start += mb_size
                total = total + aggregate_loss(
                    per_token(rows), mask[rows], mode, global_tokens=n_tok, global_seqs=n_seq, dp_size=ranks, **kw
                )
            (grad,) = torch.autograd.grad(total, theta)  # summed over micro-batches
            rank_values.append(total.detach())
            rank_grads.append(grad)
        # all-reduce averages over ranks
        torch.testing.assert_close(torch.stack(rank_values).mean(), whole.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(torch.stack(rank_grads).mean(0), whole_grad, rtol=1e-12, atol=1e-12)


def test_naive_local_mean_is_not_invariant():
    """Guard that the invariance test can fail: per-micro-batch local means differ from the global one."""
    loss = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    whole = aggregate_loss(loss, mask, "token_mean").item()  # (3 + 4) / 4 = 1.75
    naive = (aggregate_loss(loss[:1], mask[:1], "token_mean") + aggregate_loss(loss[1:], mask[1:], "token_mean")).item() / 2
    assert whole == pytest.approx(1.75) and naive == pytest.approx(2.5)  # (1 + 4) / 2


def test_validation_and_names():
    loss, mask = torch.ones(1, 2), torch.ones(1, 2)
    with pytest.raises(ValueError, match="needs norm_constant > 0"):
        aggregate_loss(loss, mask, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="dp_size must be >= 1"):
        aggregate_loss(loss, mask, "token_mean", dp_size=0)
    assert get_aggregation("seq-mean-token-mean") is AGGREGATIONS["seq_mean_token_mean"]
    with pytest.raises(
        ValueError,
        match="unknown loss aggregation mode 'sum'; valid names: seq_mean_token_mean, seq_mean_token_sum, seq_mean_token_sum_norm, token_mean",
    ):
        get_aggregation("sum")
