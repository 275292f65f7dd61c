"""KL estimators, KL loss, binary KL and TV on the sampled token."""

import math

import pytest
import torch

from rlhforge.algorithms.kl import (
    KL_ESTIMATORS,
    binary_kl,
    compute_kl,
    get_kl_estimator,
    kl_loss,
    total_variation,
)

LN2 = math.log(2.0)


def test_estimators_by_hand():
    ref = torch.zeros(1, 3)
    lp = torch.tensor([[0.0, LN2, -LN2]])  # x = log pi - log pi_ref
    torch.testing.assert_close(compute_kl(lp, ref, estimator="k1"), torch.tensor([[0.0, LN2, -LN2]]))
    # k2 = x^2 / 2 = 0.5 * 0.480453 = 0.240227
    torch.testing.assert_close(compute_kl(lp, ref, estimator="k2"), torch.tensor([[0.0, 0.240227, 0.240227]]), atol=1e-6, rtol=0)
    # k3 = e^-x - 1 + x: x = ln2 -> 0.5 - 1 + 0.693147 = 0.193147; x = -ln2 -> 2 - 1 - 0.693147 = 0.306853
    torch.testing.assert_close(compute_kl(lp, ref, estimator="k3"), torch.tensor([[0.0, 0.193147, 0.306853]]), atol=1e-6, rtol=0)


def test_mask_hides_inf_and_nan_and_grads_stay_finite():
    lp = torch.tensor([[LN2, -math.inf, 0.3]], requires_grad=True)
    ref = torch.tensor([[0.0, math.nan, 0.3]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    for est in ("k1", "k2", "k3"):
        kl = compute_kl(lp, ref, mask, estimator=est)
        assert kl[0, 1].item() == 0.0 and kl[0, 2].item() == 0.0
        kl.sum().backward()
        assert torch.isfinite(lp.grad).all()
        assert lp.grad[0, 1].item() == 0.0
        lp.grad = None


def test_estimates_are_clamped_at_10_like_openrlhf():
    # x = log pi - log pi_ref; OpenRLHF's compute_approx_kl clamps the *estimate* to [-10, 10]
    x = torch.tensor([[-100.0, -3.0, -2.0, 4.0, 5.0, 11.0, 100.0]])
    ref = torch.zeros_like(x)
    # k1 = x -> clamped
    torch.testing.assert_close(compute_kl(x, ref, estimator="k1"), torch.tensor([[-10.0, -3.0, -2.0, 4.0, 5.0, 10.0, 10.0]]))
    # k2 = x^2 / 2: 5000, 4.5, 2, 8, 12.5, 60.5, 5000 -> 10, 4.5, 2, 8, 10, 10, 10
    torch.testing.assert_close(compute_kl(x, ref, estimator="k2"), torch.tensor([[10.0, 4.5, 2.0, 8.0, 10.0, 10.0, 10.0]]))
    # k3 = e^-x - 1 + x: x=-3: e^3 - 4 = 16.085537 -> 10 (a log-ratio clamp at 20 would keep 16.09);
    # x=-2: e^2 - 3 = 4.389056 ; x=4: e^-4 + 3 = 3.018316 ; x=5: e^-5 + 4 = 4.006738 ; x=11: 10.0000167 -> 10
    torch.testing.assert_close(
        compute_kl(x, ref, estimator="k3"),
        torch.tensor([[10.0, 10.0, 4.389056, 3.018316, 4.006738, 10.0, 10.0]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(compute_kl(x, ref, estimator="k1", clamp=5.0),
                               torch.tensor([[-5.0, -3.0, -2.0, 4.0, 5.0, 5.0, 5.0]]))
    # without a clamp, k3 overflows fp32 (e^100 > 3.4e38)
    assert torch.isinf(compute_kl(x, ref, estimator="k3", clamp=None)[0, 0])


def test_clamped_estimates_have_zero_finite_gradients():
    lp = torch.tensor([[-100.0, -2.0, 100.0]], requires_grad=True)
    for est in ("k1", "k2", "k3"):
        kl_loss(lp, torch.zeros(1, 3), torch.ones(1, 3), estimator=est).sum().backward()
        assert torch.isfinite(lp.grad).all(), est
        assert lp.grad[0, 0].item() == 0.0 and lp.grad[0, 2].item() == 0.0, est
        lp.grad = None
    # inside the clamp: d k3 / d x = 1 - e^-x = 1 - e^2 = -6.389056 at x = -2
    kl_loss(lp, torch.zeros(1, 3), torch.ones(1, 3), estimator="k3").sum().backward()
    assert lp.grad[0, 1].item() == pytest.approx(1 - math.exp(2.0), rel=1e-6)


def test_half_precision_inputs_give_fp32_estimates():
    kl = compute_kl(torch.tensor([[LN2]], dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.bfloat16), estimator="k1")
    assert kl.dtype == torch.float32


def test_kl_loss_gradient_and_reference_detached():
    lp = torch.tensor([[LN2, 0.0]], requires_grad=True)
    ref = torch.zeros(1, 2, requires_grad=True)
    loss = kl_loss(lp, ref, torch.tensor([[1, 0]]), estimator="k3")
    torch.testing.assert_close(loss.detach(), torch.tensor([[0.193147, 0.0]]), atol=1e-6, rtol=0)
    loss.sum().backward()
    # d k3 / d x = 1 - e^-x = 1 - 0.5 = 0.5 at x = ln 2; masked token gets 0
    torch.testing.assert_close(lp.grad, torch.tensor([[0.5, 0.0]]))
    assert ref.grad is None


def test_binary_kl_and_tv_by_hand():
    log_p = torch.log(torch.tensor([[0.5, 0.3]]))
    log_q = torch.log(torch.tensor([[0.25, 0.3]]))
    # 0.5 ln(0.5/0.25) + 0.5 ln(0.5/0.75) = 0.346574 - 0.202733 = 0.143841 ; p == q -> 0
    torch.testing.assert_close(binary_kl(log_p, log_q), torch.tensor([[0.143841, 0.0]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(total_variation(log_p, log_q), torch.tensor([[0.25, 0.0]]))


def test_binary_kl_extremes_are_finite():
    # p = 1 and q ~ 0: both clamped to [1e-6, 1 - 1e-6]
    kl = binary_kl(torch.tensor([[0.0, -1000.0]]), torch.tensor([[-1000.0, 0.0]]))
    e = 1e-6
    expected = (1 - e) * math.log((1 - e) / e) + e * math.log(e / (1 - e))  # 13.815483
    torch.testing.assert_close(kl, torch.tensor([[expected, expected]]), rtol=1e-5, atol=0)


def test_table_and_unknown_name():
    assert sorted(KL_ESTIMATORS) == ["k1", "k2", "k3"]
    assert get_kl_estimator("k2") is KL_ESTIMATORS["k2"]
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'; valid names: k1, k2, k3"):
        get_kl_estimator("k4")
    with pytest.raises(ValueError, match="valid names: k1, k2, k3"):
        compute_kl(torch.zeros(1, 1), torch.zeros(1, 1), estimator="kl")
