"""The HF engine's batched sampler: counter-based uniforms, exact inverse-CDF draws, top-k/top-p per row."""

from __future__ import annotations

import pytest
import torch

from rlhforge.rollout.hf_generate import (CDF_BLOCK, ONE_LEVEL_MAX, counter_uniform, filter_logits_batch,
                                          inverse_cdf, row_uniform, row_uniforms, sample_batch, seed_keys)


def _filter_one(logits, top_p, top_k):
    """The per-row reference (the engine's former filter)."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        remove = probs.cumsum(-1) - probs >= top_p
        remove[0] = False
        logits = logits.clone()
        logits[order[remove]] = float("-inf")
    return logits


def test_noise_is_a_function_of_seed_step_and_token():
    keys = seed_keys([1, 2, 2**63 + 1, 1])
    u = counter_uniform(keys, 0, 500)
    assert torch.equal(u[0], u[3]) and not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert torch.equal(counter_uniform(keys[1:2], 0, 500)[0], u[1])  # not the batch
    assert not torch.equal(counter_uniform(keys, 1, 500)[0], u[0])  # the step
    assert torch.equal(counter_uniform(keys, 0, 600)[:, :500], u)  # a token's noise does not depend on V
    big = counter_uniform(seed_keys(range(400)), 7, 1000)
    assert 0 < float(big.min()) and float(big.max()) < 1
    assert abs(float(big.mean()) - 0.5) < 0.005 and abs(float(big.std()) - 12 ** -0.5) < 0.005
    hist = torch.histc(big, 10, 0, 1) / big.numel()
    assert (hist - 0.1).abs().max() < 0.005


def test_batched_filter_equals_the_per_row_filter():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 2
    top_p = torch.tensor([1.0, 0.5, 0.9, 1.0, 0.3, 0.99])
    top_k = torch.tensor([-1, -1, 10, 3, 5, 0])
    out = filter_logits_batch(logits, top_p, top_k)
    for b in range(6):
        assert torch.equal(out[b], _filter_one(logits[b], float(top_p[b]), int(top_k[b])))


def test_draws_follow_the_filtered_softmax():
    n = 40000
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]]).repeat(n, 1)
    keys = seed_keys(range(n))
    ones = torch.ones(n)
    for temperature, top_p, top_k in ((1.0, 1.0, -1), (0.5, 1.0, -1), (1.0, 0.8, -1), (1.0, 1.0, 2)):
        tok, lp = sample_batch(logits, ones * temperature, ones * top_p, torch.full((n,), top_k), keys, 0)
        want = torch.softmax(_filter_one(logits[0] / temperature, top_p, top_k), -1)
        freq = torch.bincount(tok, minlength=5).float() / n
        assert (freq - want).abs().max() < 0.01, (temperature, top_p, top_k, freq, want)
        assert (want[tok] > 0).all()  # never outside the filtered set
        full = torch.log_softmax(logits[0] / temperature, -1)  # log-probs before filtering
        torch.testing.assert_close(lp, full[tok], atol=1e-6, rtol=0)


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    temperature = torch.tensor([0.0, 1.0, 0.0, 0.7])
    tok, lp = sample_batch(logits, temperature, torch.ones(4), torch.full((4,), -1), seed_keys(range(4)), 3)
    assert tok[0] == logits[0].argmax() and tok[2] == logits[2].argmax()
    torch.testing.assert_close(lp[0], torch.log_softmax(logits[0], -1)[tok[0]])
    torch.testing.assert_close(lp[3], torch.log_softmax(logits[3] / 0.7, -1)[tok[3]])


def test_inverse_cdf_by_hand():
    """The first index whose running sum exceeds u x total (hand-worked), zero entries never drawn, an
    unnormalised row scaled by its total."""
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25]] * 5 + [[0.0, 2.0, 0.0, 0.0, 2.0]])
    u = torch.tensor([1e-12, 0.2499, 0.2501, 0.7501, 1 - 1e-12, 0.6], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [1, 1, 3, 4, 4, 4]


def test_row_uniforms_are_a_function_of_seed_and_step_with_46_bits():
    keys = seed_keys([5, 6, 5, 2**64 - 1])
    u = row_uniform(keys, 3)
    assert u.dtype == torch.float64 and u[0] == u[2] and u[0] != u[1]
    assert torch.equal(row_uniform(keys[1:2], 3), u[1:2])  # not the batch
    assert not torch.equal(row_uniform(keys, 4), u)  # the step
    big = row_uniform(seed_keys(range(20000)), 0)
    assert 0 < big.min() and big.max() < 1 and abs(big.mean() - 0.5) < 0.01
    # the low bits are used: the values are not confined to float32's 23-bit grid of cell centres
    cells = big * 2**23
    assert ((cells - cells.floor() - 0.5).abs() > 1e-3).float().mean() > 0.99


def test_every_steps_uniforms_at_once_are_each_steps_and_sample_the_same():
    """The decode loop makes all steps' uniforms in one pass (row_uniforms): column t is row_uniform(keys, t)
    bit for bit, for 64-bit seeds too, and sample_batch given that column draws what it draws by itself."""
    keys = seed_keys([0, 1, 7, 2**63 + 5, 2**64 - 1, 123456789012345])
    table = row_uniforms(keys, 300)
    assert table.shape == (6, 300) and table.dtype == torch.float64
    for t in range(300):
        assert torch.equal(table[:, t], row_uniform(keys, t)), t
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0)) * 3
    ones, no_k = torch.ones(6), torch.full((6,), -1)
    for t in (0, 17, 299):
        alone = sample_batch(logits, ones, ones, no_k, keys, t)
        given = sample_batch(logits, ones, ones, no_k, keys, t, uniforms=table[:, t])
        assert torch.equal(alone[0], given[0]) and torch.equal(alone[1], given[1])


def test_one_level_up_to_its_bound():
    """Vocabularies up to ONE_LEVEL_MAX draw with the single float64 running sum (the definition), above it with
    the two levels; the bound sits where the two-level sum became the faster one on this machine (~3,000)."""
    assert 1024 <= ONE_LEVEL_MAX <= 3000 and ONE_LEVEL_MAX % CDF_BLOCK == 0
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(500, ONE_LEVEL_MAX, generator=g) * 4, -1)
    u = torch.rand(500, generator=g, dtype=torch.float64)
    assert torch.equal(inverse_cdf(probs, u), _one_level(probs, u))


def test_a_tiny_probability_has_its_own_sliver_of_u():
    """A token of probability 1e-3 / 2**13 (far below 2**-23, the float32 grid) next to a heavy one is drawn
    exactly when u falls in its sliver at the top of the running sum, and not just below it: the float64 sum
    resolves it (the 46-bit uniforms of row_uniform can land there)."""
    eps = 1e-3 / 2**13
    probs = torch.tensor([[1 - eps, eps]], dtype=torch.float32)
    u = torch.tensor([1 - eps / 2], dtype=torch.float64)
    assert inverse_cdf(probs, u).item() == 1 and inverse_cdf(probs, u - eps).item() == 0


def _one_level(probs, u):
    """The inverse CDF as one float64 running sum over the whole row (inverse_cdf's definition)."""
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    return torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True)[:, 0]


@pytest.mark.parametrize("vocab", [ONE_LEVEL_MAX + 1, 3001, 4096, 151936])
def test_the_two_level_running_sum_draws_what_one_running_sum_draws(vocab):
    """Above ONE_LEVEL_MAX entries the draw goes through float64 block sums and then one block: on thousands of
    rows (peaked and flat softmaxes, zeros, a vocabulary that is not a multiple of the block) it picks the token the
    one-level float64 running sum picks, never a zero-probability one."""
    g = torch.Generator().manual_seed(vocab)
    rows = 4000 if vocab < 10000 else 64
    logits = torch.randn(rows, vocab, generator=g) * torch.rand(rows, 1, generator=g) * 12
    probs = torch.softmax(logits, -1)
    probs[torch.rand(rows, vocab, generator=g) < 0.3] = 0.0  # filtered-out / banned entries
    u = torch.rand(rows, generator=g, dtype=torch.float64)
    got = inverse_cdf(probs, u)
    assert torch.equal(got, _one_level(probs, u))
    assert (probs.gather(-1, got[:, None]) > 0).all()


def test_two_level_tiny_sliver_and_top_edge():
    """In a large vocabulary a token of probability far below 2**-23 is drawn exactly in its sliver of u, and a u
    at the very top of the row never lands on the zero-probability entries after the last nonzero one."""
    vocab, eps = 151936, 1e-3 / 2**13
    probs = torch.zeros(2, vocab)
    probs[:, 70000], probs[:, 70001] = 1 - eps, eps
    u = torch.tensor([1 - eps / 2, 1 - 1.5 * eps], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [70001, 70000]
    top = torch.tensor([1 - 2**-46] * 2, dtype=torch.float64)
    assert inverse_cdf(probs, top).tolist() == [70001, 70001]


def test_banned_tokens_are_never_drawn_and_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 40, generator=g)
    logits[:, 7] = 10.0  # the most likely token, banned
    keys = seed_keys(range(64))
    ones = torch.ones(64)
    tok, lp = sample_batch(logits, ones, ones, torch.full((64,), -1), keys, 2, banned=torch.tensor([7]))
    assert (tok != 7).all()
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(-1, tok[:, None])[:, 0])
    one, _ = sample_batch(logits[10:11], ones[:1], ones[:1], torch.full((1,), -1), keys[10:11], 2,
                          banned=torch.tensor([7]))
    assert one.item() == tok[10].item()
