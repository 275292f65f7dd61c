"""logprobs_from_logits / entropy_from_logits: hand values, chunked == direct, memory, edge cases."""

import math

import pytest
import torch

from rlhforge.algorithms.logprobs import entropy_from_logits, logprobs_from_logits

LN2, LN3 = math.log(2.0), math.log(3.0)


def test_hand_values_with_temperature():
    # logits / T = [0, ln2, ln3] -> softmax = [1, 2, 3] / 6
    logits = torch.tensor([[[0.0, 2 * LN2, 2 * LN3]]])
    labels = torch.tensor([[2]])
    for chunk in (None, 1):
        lp = logprobs_from_logits(logits, labels, temperature=2.0, chunk_size=chunk)
        # log(3/6) = -ln 2
        torch.testing.assert_close(lp, torch.tensor([[-LN2]]))
        ent = entropy_from_logits(logits, temperature=2.0, chunk_size=chunk)
        # H = 1/6 ln 6 + 1/3 ln 3 + 1/2 ln 2 = 0.298627 + 0.366204 + 0.346574 = 1.011404
        torch.testing.assert_close(ent, torch.tensor([[1.011404]]), atol=1e-6, rtol=0)


def test_uniform_logits():
    logits = torch.zeros(2, 3, 4)
    labels = torch.tensor([[0, 1, 2], [3, 0, 1]])
    # uniform over 4: log p = -ln 4 = -1.386294, H = ln 4
    torch.testing.assert_close(logprobs_from_logits(logits, labels, chunk_size=2), torch.full((2, 3), -math.log(4)))
    torch.testing.assert_close(entropy_from_logits(logits, chunk_size=2), torch.full((2, 3), math.log(4)))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("chunk", [1, 4, 5, 1000])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_chunked_matches_direct_values_and_grads(seed, chunk, temperature):
    g = torch.Generator().manual_seed(seed)
    B, T, V = 3, 7, 11
    base = torch.randn(B, T, V, generator=g, dtype=torch.float64) * 3
    labels = torch.randint(0, V, (B, T), generator=g)
    up_lp = torch.randn(B, T, generator=g, dtype=torch.float64)
    up_h = torch.randn(B, T, generator=g, dtype=torch.float64)

    def run(chunk_size):
        x = base.clone().requires_grad_(True)
        lp = logprobs_from_logits(x, labels, temperature, chunk_size)
        h = entropy_from_logits(x, temperature, chunk_size)
        ((lp * up_lp).sum() + (h * up_h).sum()).backward()
        return lp.detach(), h.detach(), x.grad

    lp_d, h_d, g_d = run(None)
    lp_c, h_c, g_c = run(chunk)
    torch.testing.assert_close(lp_c, lp_d, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(h_c, h_d, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(g_c, g_d, atol=1e-12, rtol=1e-10)


def test_gradcheck_chunked():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 5, (2, 3), generator=g)
    assert torch.autograd.gradcheck(lambda z: logprobs_from_logits(z, labels, 0.6, chunk_size=2), (x,), fast_mode=True)
    assert torch.autograd.gradcheck(lambda z: entropy_from_logits(z, 0.6, chunk_size=2), (x,), fast_mode=True)


def test_bf16_logits_give_fp32_outputs_and_grads_in_bf16():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 9, generator=g).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, 9, (2, 4), generator=g)
    lp = logprobs_from_logits(x, labels, chunk_size=3)
    assert lp.dtype == torch.float32
    ref = torch.log_softmax(x.detach().float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(lp.detach(), ref)
    lp.sum().backward()
    assert x.grad.dtype == torch.bfloat16
    # each row's gradient of log p[label] sums to 0 over the vocabulary (1 - sum softmax)
    assert x.grad.float().sum(-1).abs().max().item() < 2e-2


def test_chunked_saves_only_logits_plus_one_number_per_row():
    """Memory: the chunked path keeps no [N, V] fp32 copy for backward; the direct one does."""
    N, V = 6, 50
    x = torch.randn(1, N, V, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, V, (1, N))

    def saved_bytes(chunk_size, fn):
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(chunk_size)
        return total[0]

    logits_bytes = N * V * 2
    chunked = saved_bytes(2, lambda c: logprobs_from_logits(x, labels, chunk_size=c))
    # logits (600 B bf16) + labels (6 x 8 B) + lse (6 x 4 B) = 672 B
    assert chunked == logits_bytes + N * 8 + N * 4
    direct = saved_bytes(None, lambda c: logprobs_from_logits(x, labels, chunk_size=c))
    assert direct >= logits_bytes + N * V * 4  # at least one full fp32 [N, V] tensor
    ent_chunked = saved_bytes(2, lambda c: entropy_from_logits(x, chunk_size=c))
    assert ent_chunked == logits_bytes + N * 4  # logits + entropy


def test_minus_inf_logits_are_safe():
    # a banned token (-inf): p = [1/2, 1/2, 0] -> H = ln 2, log p[0] = -ln 2, finite grads
    for chunk in (None, 1):
        x = torch.tensor([[[0.0, 0.0, -math.inf]]], requires_grad=True)
        h = entropy_from_logits(x, chunk_size=chunk)
        lp = logprobs_from_logits(x, torch.tensor([[0]]), chunk_size=chunk)
        torch.testing.assert_close(h.detach(), torch.tensor([[LN2]]))
        torch.testing.assert_close(lp.detach(), torch.tensor([[-LN2]]))
        (h.sum() + lp.sum()).backward()
        assert torch.isfinite(x.grad).all()
        # d log p0 / dz = onehot - p = [0.5, -0.5, 0]; dH/dz = -p (log p + H) = 0 for the two equal tokens
        torch.testing.assert_close(x.grad, torch.tensor([[[0.5, -0.5, 0.0]]]))


def test_zero_length_and_validation():
    x = torch.randn(2, 0, 5, requires_grad=True)
    labels = torch.zeros(2, 0, dtype=torch.long)
    for chunk in (None, 4):
        lp = logprobs_from_logits(x, labels, chunk_size=chunk)
        h = entropy_from_logits(x, chunk_size=chunk)
        assert lp.shape == (2, 0) and h.shape == (2, 0)
        (lp.sum() + h.sum()).backward()
    with pytest.raises(ValueError, match="temperature must be > 0"):
        logprobs_from_logits(torch.zeros(1, 1, 3), torch.zeros(1, 1, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="labels"):
        logprobs_from_logits(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(torch.zeros(1, 2, 3), chunk_size=0)
