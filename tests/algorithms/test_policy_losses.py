"""PPO (clip-higher, dual clip), GSPO, FlashREINFORCE and the entropy bonus."""

import math

import pytest
import torch

from rlhforge.algorithms._utils import masked_mean
from rlhforge.algorithms.aggregation import aggregate_seq_mean_token_mean
from rlhforge.algorithms.corrections import is_correction
from rlhforge.algorithms.kl import binary_kl
from rlhforge.algorithms.policy_losses import (
    POLICY_LOSSES,
    entropy_bonus,
    flash_reinforce_loss,
    get_policy_loss,
    gspo_loss,
    ppo_loss,
)

D = torch.float64
LN = math.log


def t(x):
    return torch.tensor(x, dtype=D)


def leaf(x):
    return torch.tensor(x, dtype=D, requires_grad=True)


def test_ppo_by_hand():
    old = t([[-1.0, -1.0, -1.0, -1.0]])
    lp = leaf([[-1 + LN(1.5), -1 + LN(0.5), -1 + LN(1.1), -1.0]])
    adv = t([[1.0, -1.0, -1.0, 2.0]])
    loss, m = ppo_loss(lp, old, adv, torch.ones(1, 4), eps_low=0.2)
    # t0: rho 1.5, A  1: s1 = 1.5,  s2 = 1.2  -> -1.2 (clipped)
    # t1: rho 0.5, A -1: s1 = -0.5, s2 = -0.8 -> 0.8  (clipped)
    # t2: rho 1.1, A -1: s1 = s2 = -1.1       -> 1.1
    # t3: rho 1,   A  2:                      -> -2
    torch.testing.assert_close(loss.detach(), t([[-1.2, 0.8, 1.1, -2.0]]))
    assert m["clip_frac"].item() == pytest.approx(0.5)
    assert m["dual_clip_frac"].item() == 0.0
    # approx_kl = mean((rho - 1) - ln rho) = (0.094535 + 0.193147 + 0.004690 + 0) / 4 = 0.073093
    assert m["approx_kl"].item() == pytest.approx(0.0730930, abs=1e-6)
    # ppo_kl (OpenRLHF's) = mean(-ln rho) = -(0.405465 - 0.693147 + 0.095310 + 0) / 4 = 0.048093
    assert m["ppo_kl"].item() == pytest.approx(0.0480930, abs=1e-6)
    loss.sum().backward()
    # clipped tokens have zero gradient; otherwise d(-rho A)/dlogp = -rho A
    torch.testing.assert_close(lp.grad, t([[0.0, 0.0, 1.1, -2.0]]))


def test_ppo_clip_higher():
    old = t([[0.0, 0.0]])
    lp = t([[LN(1.3), LN(0.7)]])
    loss, _ = ppo_loss(lp, old, t([[1.0, -1.0]]), torch.ones(1, 2), eps_low=0.2, eps_high=0.28)
    # rho 1.3, A 1 -> clip to 1.28 -> -1.28 ; rho 0.7, A -1: s1 = -0.7, s2 = -0.8 -> 0.8
    torch.testing.assert_close(loss, t([[-1.28, 0.8]]))


def test_ppo_dual_clip():
    old = t([[0.0, 0.0, 0.0]])
    lp = leaf([[LN(5.0), LN(5.0), LN(2.0)]])
    loss, m = ppo_loss(lp, old, t([[-1.0, 1.0, -1.0]]), torch.ones(1, 3), dual_clip=3.0)
    # t0: A -1, rho 5: min(s1, s2) = -5 < cA = -3 -> dual clip: loss 3
    # t1: A  1, rho 5: clipped to 1.2 -> -1.2 (dual clip never applies to A >= 0)
    # t2: A -1, rho 2: min = -2 > -3 -> loss 2
    torch.testing.assert_close(loss.detach(), t([[3.0, -1.2, 2.0]]))
    assert m["dual_clip_frac"].item() == pytest.approx(1 / 3)
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, t([[0.0, 0.0, 2.0]]))
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        ppo_loss(lp, old, t([[-1.0, 1.0, -1.0]]), torch.ones(1, 3), dual_clip=1.0)
    with pytest.raises(ValueError, match="eps_low"):
        ppo_loss(lp, old, t([[-1.0, 1.0, -1.0]]), torch.ones(1, 3), eps_low=1.0)


def test_ppo_masked_inf_nan_and_extreme_ratios():
    lp = leaf([[1000.0, -1000.0, -math.inf, 0.0]])
    old = t([[0.0, 0.0, math.nan, 0.0]])
    adv = t([[-1.0, 1.0, math.nan, 1.0]])
    mask = torch.tensor([[1, 1, 0, 0]])
    loss, m = ppo_loss(lp, old, adv, mask)
    # t0: log-ratio clamped to 20: A = -1 -> s1 = -e^20, s2 = -1.2 -> loss e^20 (finite)
    # t1: log-ratio -20: A = 1 -> s1 = e^-20, s2 = 0.8 -> loss -e^-20
    torch.testing.assert_close(loss.detach(), t([[math.exp(20), -math.exp(-20), 0.0, 0.0]]))
    loss.sum().backward()
    assert torch.isfinite(lp.grad).all() and lp.grad[0, 2:].abs().sum().item() == 0.0
    assert all(torch.isfinite(v) for v in m.values())


def test_ppo_all_masked_broadcast_advantages_and_is_weights():
    loss, m = ppo_loss(t([[0.3, 0.1]]), t([[0.0, 0.0]]), t([[1.0, 1.0]]), torch.zeros(1, 2))
    torch.testing.assert_close(loss, t([[0.0, 0.0]]))
    assert m["clip_frac"].item() == 0.0 and m["approx_kl"].item() == 0.0
    # advantages [B] broadcast over tokens, IS weights multiply the per-token loss
    loss, _ = ppo_loss(t([[0.0, 0.0]]), t([[0.0, 0.0]]), t([2.0]), torch.ones(1, 2), is_weights=t([[0.5, 3.0]]))
    torch.testing.assert_close(loss, t([[-1.0, -6.0]]))  # -rho A w = -1*2*0.5, -1*2*3


def test_gspo_by_hand_and_gradient_equals_sequence_objective():
    old = t([[0.0, 0.0], [0.0, 0.0]])
    lp = leaf([[LN(2.0), 0.0], [LN(0.5), 7.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = t([1.0, -1.0])
    loss, m = gspo_loss(lp, old, adv, mask, eps_low=0.2, eps_high=0.2)
    # row 0: s = exp((ln 2 + 0)/2) = sqrt 2 = 1.414214, A 1 -> clipped to 1.2 per token
    # row 1: s = exp(ln 0.5) = 0.5, A -1 -> s1 = -0.5, s2 = -0.8 -> 0.8
    torch.testing.assert_close(loss.detach(), t([[-1.2, -1.2], [0.8, 0.0]]))
    assert m["clip_frac"].item() == pytest.approx(1.0)
    assert m["seq_ratio_mean"].item() == pytest.approx((math.sqrt(2) + 0.5) / 2)

    # wide clip: gradient of seq_mean_token_mean(GSPO-token loss) == gradient of -mean_i A_i s_i
    loss, _ = gspo_loss(lp, old, adv, mask, eps_low=0.9, eps_high=10.0)
    (g_tok,) = torch.autograd.grad(aggregate_seq_mean_token_mean(loss, mask), lp)
    lp2 = lp.detach().clone().requires_grad_(True)
    s0 = torch.exp((lp2[0, 0] + lp2[0, 1]) / 2)
    s1 = torch.exp(lp2[1, 0])
    (g_seq,) = torch.autograd.grad(-(1.0 * s0 + (-1.0) * s1) / 2, lp2)
    # d/dlp_0t = -A s / (2 tokens * 2 seqs) = -sqrt2/4 = -0.353553 ; row 1: 0.5 / 2 = 0.25 ; masked 0
    torch.testing.assert_close(g_tok, g_seq)
    torch.testing.assert_close(g_tok, t([[-math.sqrt(2) / 4, -math.sqrt(2) / 4], [0.25, 0.0]]))


def test_flash_reinforce_by_hand():
    lp = leaf([[LN(0.5), LN(0.5)], [LN(0.2), LN(0.9)]])
    mu = t([[LN(0.5), LN(0.25)], [LN(0.2), LN(0.9)]])
    adv = t([1.0, -0.5])
    mask = torch.ones(2, 2)
    # gate on KL_bin(p || q) with p = mu (rollout), q = pi_theta, as OpenRLHF's binary_kl gating:
    # row 0, token 1: 0.25 ln(0.25/0.5) + 0.75 ln(0.75/0.5) = -0.173287 + 0.304099 = 0.130812
    # -> row mean 0.065406 ; row 1: p == q -> 0. (The other direction, KL_bin(0.5 || 0.25) = 0.143841,
    # has row mean 0.071921.)
    loss, m = flash_reinforce_loss(lp, mu, adv, mask, delta=0.07)  # 0.065406 <= 0.07 < 0.071921: kept
    # kept: l = -A w with w = [1, 2] and [1, 1]
    torch.testing.assert_close(loss.detach(), t([[-1.0, -2.0], [0.5, 0.5]]))
    assert m["trust_region_drop_frac"].item() == 0.0
    assert m["seq_binary_kl_mean"].item() == pytest.approx(0.130812 / 4, abs=1e-6)
    loss.sum().backward()
    # gradient = -sg(w) A grad logp
    torch.testing.assert_close(lp.grad, t([[-1.0, -2.0], [0.5, 0.5]]))

    lp.grad = None
    loss, m = flash_reinforce_loss(lp, mu, adv, mask, delta=0.065)  # 0.065 < 0.065406: row 0 dropped
    torch.testing.assert_close(loss.detach(), t([[0.0, 0.0], [0.5, 0.5]]))
    assert m["trust_region_drop_frac"].item() == pytest.approx(0.5)
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, t([[0.0, 0.0], [0.5, 0.5]]))
    loss, m = flash_reinforce_loss(lp, mu, adv, mask)  # default delta 3e-3: dropped too
    assert m["trust_region_drop_frac"].item() == pytest.approx(0.5)


def test_flash_reinforce_gate_matches_the_binary_kl_is_correction():
    g = torch.Generator().manual_seed(0)
    lp = torch.log(torch.rand(3, 5, generator=g, dtype=D) * 0.9 + 0.05)
    mu = torch.log(torch.rand(3, 5, generator=g, dtype=D) * 0.9 + 0.05)
    mask = torch.ones(3, 5)
    mask[2, 3:] = 0
    _, m = flash_reinforce_loss(lp, mu, t([1.0, 1.0, 1.0]), mask, delta=float("inf"))
    # the loss's gate statistic is KL_bin(mu || pi_theta) per sequence, the one is_correction's seq-level
    # binary_kl gating computes (p = pi_roll); with a band [0, delta] both drop the same sequences
    seq = masked_mean(binary_kl(mu, lp), mask.bool(), dim=1)
    assert m["seq_binary_kl_mean"].item() == pytest.approx(seq.mean().item(), rel=1e-9)
    delta = float(seq.sort().values[1])  # keeps the two smallest
    _, loss_m = flash_reinforce_loss(lp, mu, t([1.0, 1.0, 1.0]), mask, delta=delta)
    _, _, is_m = is_correction(lp, mu, mask, level="seq", mode="mask", gating="binary_kl", low=0.0, high=delta)
    assert loss_m["trust_region_drop_frac"].item() == pytest.approx(1 / 3)
    assert is_m["filtered_frac"].item() == pytest.approx(loss_m["trust_region_drop_frac"].item())


def test_flash_reinforce_masked_and_empty_rows_are_safe():
    lp = leaf([[-math.inf, LN(0.5)], [math.nan, math.nan]])
    mu = t([[math.nan, LN(0.5)], [0.0, 0.0]])
    loss, m = flash_reinforce_loss(lp, mu, t([1.0, 1.0]), torch.tensor([[0, 1], [0, 0]]))
    torch.testing.assert_close(loss.detach(), t([[0.0, -1.0], [0.0, 0.0]]))
    loss.sum().backward()
    assert torch.isfinite(lp.grad).all()
    assert m["trust_region_drop_frac"].item() == 0.0  # the empty row is not a sequence


def test_entropy_bonus():
    torch.testing.assert_close(
        entropy_bonus(t([[1.0, 2.0, math.inf]]), torch.tensor([[1, 1, 0]]), coef=0.01), t([[-0.01, -0.02, 0.0]])
    )


def test_table_and_unknown_name():
    assert {k: POLICY_LOSSES[k] for k in ("ppo", "gspo", "flash_reinforce")} == {
        "ppo": ppo_loss, "gspo": gspo_loss, "flash_reinforce": flash_reinforce_loss}
    assert sorted(POLICY_LOSSES) == ["cispo", "clip_cov", "dppo", "dro", "flash_reinforce", "gmpo", "gspo", "kl_cov",
                                     "ppo", "sapo"]  # the 2026 pack: tests/algorithms/test_policy_losses_2026.py
    assert get_policy_loss("flash-reinforce") is flash_reinforce_loss
    with pytest.raises(ValueError, match="unknown policy loss 'grpo'; valid names: cispo, clip_cov, dppo, dro, "
                                         "flash_reinforce, gmpo, gspo, kl_cov, ppo, sapo"):
        get_policy_loss("grpo")
