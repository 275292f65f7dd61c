"""CISPO, SAPO, DPPO, DRO, GMPO, Clip-Cov and KL-Cov: hand-worked values, autograd of each formula written
again here (independently of the library) on random inputs, and where the gradient flows."""

import math

import pytest
import torch

from rlhforge.algorithms import POLICY_LOSSES, aggregate_loss, get_policy_loss
from rlhforge.algorithms.policy_losses_2026 import (
    cispo_loss,
    clip_cov_loss,
    clip_cov_selection,
    covariance_scores,
    dppo_loss,
    dro_loss,
    gmpo_loss,
    kl_cov_loss,
    kl_cov_selection,
    sapo_loss,
)

D = torch.float64
LN = math.log
NEW = ("cispo", "sapo", "dppo", "dro", "gmpo", "clip_cov", "kl_cov")


def t(x):
    return torch.tensor(x, dtype=D)


def leaf(x):
    return torch.tensor(x, dtype=D, requires_grad=True)


def sig(x):
    return 1 / (1 + math.exp(-x))


def test_every_new_loss_is_in_the_name_table():
    for name in NEW:
        assert get_policy_loss(name) is POLICY_LOSSES[name]
    with pytest.raises(ValueError, match="cispo"):
        get_policy_loss("cisp0")


# ------------------------------------------------------------------------------------------ by hand


def test_cispo_by_hand():
    old = t([[LN(0.2), LN(0.4), LN(0.1), LN(0.5)]])
    lp = leaf([[LN(0.3), LN(0.2), LN(0.8), LN(0.5)]])  # r = 1.5, 0.5, 8, 1
    adv = t([[1.0, -1.0, 2.0, 0.5]])
    loss, m = cispo_loss(lp, old, adv, torch.ones(1, 4))  # eps_high 5: weight <= 6; no lower clip
    # l = -w A log pi:  -1.5*1*ln .3 = 1.805959 ; -0.5*(-1)*ln .2 = -0.804719 ; -6*2*ln .8 = 2.677723 ; -.5 ln .5
    torch.testing.assert_close(loss.detach(), t([[1.8059592, -0.8047190, 2.6777230, 0.3465736]]), atol=1e-6, rtol=0)
    assert m["clip_frac"].item() == pytest.approx(0.25)
    loss.sum().backward()
    # gradient -w A through log pi only: the ratio-8 token still pushes with weight 6
    torch.testing.assert_close(lp.grad, t([[-1.5, 0.5, -12.0, -0.5]]))
    low, _ = cispo_loss(lp, old, adv, torch.ones(1, 4), eps_low=0.2)  # weight of token 1: 0.5 -> 0.8
    assert low[0, 1].item() == pytest.approx(0.8 * LN(0.2))


def test_sapo_by_hand():
    old = t([[0.0, 0.0, 0.0]])
    lp = leaf([[0.0, LN(2.0), LN(0.5)]])  # r = 1, 2, 0.5
    adv = t([[1.0, -1.0, 1.0]])
    loss, m = sapo_loss(lp, old, adv, torch.ones(1, 3))  # tau_pos 1, tau_neg 1.05
    # t0: 4 sigmoid(0) = 2 -> -2 ; t1: (4/1.05) sigmoid(1.05) = 2.8220 -> +2.8220 ; t2: 4 sigmoid(-.5) = 1.5102
    expected = [-2.0, (4 / 1.05) * sig(1.05), -4 * sig(-0.5)]
    torch.testing.assert_close(loss.detach(), t([expected]))
    assert expected[1] == pytest.approx(2.8219996, abs=1e-6) and expected[2] == pytest.approx(-1.5101628, abs=1e-6)
    loss.sum().backward()
    # d l / d log pi = -A * 4 s (1 - s) * r: 1 on-policy (the plain policy gradient)
    s1, s2 = sig(1.05), sig(-0.5)
    torch.testing.assert_close(lp.grad, t([[-1.0, 4 * s1 * (1 - s1) * 2, -4 * s2 * (1 - s2) * 0.5]]))
    assert m["gate_mean"].item() == pytest.approx((1 + 4 * s1 * (1 - s1) + 4 * s2 * (1 - s2)) / 3)


def test_dppo_by_hand():
    old = t([[LN(0.2), LN(0.5), LN(0.2), LN(0.5)]])
    lp = leaf([[LN(0.5), LN(0.2), LN(0.5), LN(0.6)]])
    adv = t([[1.0, -1.0, -1.0, 1.0]])
    loss, m = dppo_loss(lp, old, adv, torch.ones(1, 4))  # delta 0.2 / 0.2
    # t0: +0.3 with A>0 -> masked ; t1: -0.3 with A<0 -> masked ; t2: +0.3 but A<0 -> kept: -(-1)(2.5) ln .5
    # t3: +0.1 kept: -1 * 1.2 * ln .6
    torch.testing.assert_close(loss.detach(), t([[0.0, 0.0, 2.5 * LN(0.5), -1.2 * LN(0.6)]]))
    assert (m["masked_frac"].item(), m["masked_high_frac"].item(), m["masked_low_frac"].item()) == (0.5, 0.25, 0.25)
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, t([[0.0, 0.0, 2.5, -1.2]]))  # -A sg(r) on kept tokens only
    capped, _ = dppo_loss(lp, old, adv, torch.ones(1, 4), ratio_cap=2.0)
    assert capped[0, 2].item() == pytest.approx(2.0 * LN(0.5))


def test_dro_by_hand():
    lp = leaf([[LN(0.25), LN(0.5)]])
    old = t([[LN(0.5), LN(0.5)]])
    adv = t([[1.0, -2.0]])
    loss, m = dro_loss(lp, old, adv, torch.ones(1, 2), beta=0.05)
    # t0: -(ln .25 - 0.025 ln(2)^2) = 1.386294 + 0.012011 = 1.398306 ; t1: -(-2 ln .5) = -1.386294
    torch.testing.assert_close(loss.detach(), t([[1.3983057, -1.3862944]]), atol=1e-6, rtol=0)
    loss.sum().backward()
    # d/dlog pi = -(A - beta (log pi - log pi_old)): t0 -(1 + 0.05 ln 2) ; t1: 2
    torch.testing.assert_close(lp.grad, t([[-(1 + 0.05 * LN(2)), 2.0]]))
    assert m["sq_log_ratio"].item() == pytest.approx(LN(2) ** 2 / 2)


def test_gmpo_by_hand():
    old = torch.zeros(2, 2, dtype=D)
    lp = leaf([[0.6, -0.2], [0.6, -0.6]])  # log r
    adv = t([[1.0, 1.0], [-1.0, -1.0]])
    loss, m = gmpo_loss(lp, old, adv, torch.ones(2, 2))  # log-space clip [-0.4, 0.4]
    # seq 0 (A>0): min(log r, clip) = [0.4, -0.2], mean 0.1 -> L = -e^0.1
    # seq 1 (A<0): max(log r, clip) = [0.6, -0.4], mean 0.1 -> L = +e^0.1
    e = math.exp(0.1)
    torch.testing.assert_close(loss.detach(), t([[-e, -e], [e, e]]))
    assert m["clip_frac"].item() == pytest.approx(0.5)
    agg = aggregate_loss(loss, torch.ones(2, 2), "seq_mean_token_mean")
    assert agg.item() == pytest.approx(0.0)
    agg.backward()
    # mean over sequences of L_i: dL_0/dlog r = -e/2 on the unclipped token, 0 on the clipped one; seq 1 likewise
    torch.testing.assert_close(lp.grad, t([[0.0, -e / 4], [e / 4, 0.0]]))


def _cov_batch():
    # mean A = 0, mean log pi = -2: cov = [2*2, -3*-2, 1*0, 0*0] = [4, 6, 0, 0]
    lp = leaf([[0.0, -4.0, -2.0, -2.0]])
    adv = t([[2.0, -3.0, 1.0, 0.0]])
    return lp, adv


def test_covariance_scores_by_hand():
    lp, adv = _cov_batch()
    torch.testing.assert_close(covariance_scores(lp, adv, torch.ones(1, 4)), t([[4.0, 6.0, 0.0, 0.0]]))
    masked = covariance_scores(lp, adv, t([[1.0, 1.0, 1.0, 0.0]]))
    assert masked[0, 3].item() == -math.inf  # over 3 tokens: mean A = 0, mean log pi = -2
    torch.testing.assert_close(masked[0, :3], t([4.0, 6.0, 0.0]))


def test_clip_cov_by_hand_zeroes_exactly_the_selected_tokens():
    lp, adv = _cov_batch()
    mask = torch.ones(1, 4)
    # ratio 1: the budget covers every candidate; candidates in [1, 5]: token 0 only (6 is above ub)
    loss, m = clip_cov_loss(lp, lp.detach(), adv, mask, clip_cov_ratio=1.0)
    torch.testing.assert_close(loss.detach(), t([[0.0, 3.0, -1.0, 0.0]]))  # PPO at r=1: -A, token 0 zeroed
    assert m["cov_selected_frac"].item() == pytest.approx(0.25)
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, t([[0.0, 3.0, -1.0, 0.0]]))
    # a band holding tokens 0 and 1 with a budget of 1 token: one of them, drawn by the generator
    for seed in range(6):
        lp.grad = None
        loss, _ = clip_cov_loss(lp, lp.detach(), adv, mask, clip_cov_ratio=0.25, clip_cov_ub=6.0,
                                generator=torch.Generator().manual_seed(seed))
        picked = clip_cov_selection(covariance_scores(lp, adv, mask), mask.bool(), 1, 1.0, 6.0,
                                    torch.Generator().manual_seed(seed))
        assert picked.sum() == 1 and not picked[0, 2:].any()
        loss.sum().backward()
        assert torch.equal(lp.grad == 0, picked | (adv == 0))  # zero gradient exactly where selected (or A = 0)


def test_kl_cov_by_hand():
    lp, adv = _cov_batch()
    old = lp.detach() - t([[0.1, -0.1, 0.0, 0.2]])  # log r = [0.1, -0.1, 0, 0.2]
    loss, m = kl_cov_loss(lp, old, adv, torch.ones(1, 4), kl_cov_ratio=0.25, ppo_kl_coef=1.0)
    # top-1 covariance: token 1 (cov 6) gets +|log r|: -(-3) e^-0.1 + 0.1
    expected = [-2 * math.exp(0.1), 3 * math.exp(-0.1) + 0.1, -1.0, 0.0]
    torch.testing.assert_close(loss.detach(), t([expected]))
    assert m["cov_selected_frac"].item() == pytest.approx(0.25)
    loss.sum().backward()
    # d/dlog pi: -A r (+ coef sign(log r) on token 1)
    torch.testing.assert_close(lp.grad, t([[-2 * math.exp(0.1), 3 * math.exp(-0.1) - 1.0, -1.0, 0.0]]))


# --------------------------------------------------------------- autograd of the formula, random inputs


def _random(seed, b=4, tt=7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, tt, generator=g, dtype=D) * 3 - 0.05
    lp = (old + torch.randn(b, tt, generator=g, dtype=D) * 0.4).clamp(max=-1e-3)
    adv = torch.randn(b, tt, generator=g, dtype=D)
    mask = (torch.rand(b, tt, generator=g) > 0.25).to(D)
    mask[:, 0] = 1
    isw = torch.rand(b, tt, generator=g, dtype=D) + 0.5
    return lp, old, adv, mask, isw


def _ref_cispo(lp, old, adv, hp):
    w = torch.exp(lp - old).detach().clamp(1 - hp.get("eps_low", 1.0), 1 + hp.get("eps_high", 5.0))
    return -w * adv * lp


def _ref_sapo(lp, old, adv, hp):
    tau = torch.where(adv > 0, torch.tensor(hp.get("tau_pos", 1.0), dtype=D), torch.tensor(hp.get("tau_neg", 1.05), dtype=D))
    return -(4 / tau) * torch.sigmoid(tau * (torch.exp(lp - old) - 1)) * adv


def _ref_dppo(lp, old, adv, hp):
    d = lp.exp().detach() - old.exp()
    bad = ((adv > 0) & (d > hp.get("delta_high", 0.2))) | ((adv < 0) & (d < -hp.get("delta_low", 0.2)))
    w = torch.exp(lp - old).detach()
    if hp.get("ratio_cap") is not None:
        w = torch.minimum(w, torch.tensor(hp["ratio_cap"], dtype=D))
    return torch.where(bad, torch.zeros_like(lp), -adv * w * lp)


def _ref_dro(lp, old, adv, hp):
    return -(lp * adv - hp.get("beta", 0.05) / 2 * (lp - old) ** 2)


def _ref_gmpo(lp, old, adv, hp, mask):
    rows = []
    for i in range(lp.shape[0]):
        keep = mask[i].bool()
        a = adv[i][keep].mean()
        lr = (lp[i] - old[i])[keep]
        lo, hi = -hp.get("eps_low", 0.4), hp.get("eps_high", 0.4)
        # pessimistic side: for A > 0 the smaller of log r and its clip, for A < 0 the larger
        u = torch.minimum(lr, lr.clamp(lo, hi)) if a > 0 else torch.maximum(lr, lr.clamp(lo, hi))
        rows.append((-a * torch.exp(u.mean())).expand(lp.shape[1]))
    return torch.stack(rows)


REFS = {"cispo": _ref_cispo, "sapo": _ref_sapo, "dppo": _ref_dppo, "dro": _ref_dro}
HYPERS = {"cispo": [{}, {"eps_low": 0.2, "eps_high": 0.28}], "sapo": [{}, {"tau_pos": 0.5, "tau_neg": 3.0}],
          "dppo": [{}, {"delta_low": 0.05, "delta_high": 0.02, "ratio_cap": 1.1}], "dro": [{}, {"beta": 1.3}],
          "gmpo": [{}, {"eps_low": 0.05, "eps_high": 0.1}]}


@pytest.mark.parametrize("name", list(HYPERS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_autograd_of_the_formula(name, seed):
    lp, old, adv, mask, isw = _random(seed)
    if name == "gmpo":
        adv = adv[:, :1].expand_as(adv).clone()  # one advantage per sequence, as GRPO gives
    for hp in HYPERS[name]:
        for weights in (None, isw):
            x = lp.clone().requires_grad_(True)
            y = lp.clone().requires_grad_(True)
            loss, _ = POLICY_LOSSES[name](x, old, adv, mask, is_weights=weights, **hp)
            ref = _ref_gmpo(y, old, adv, hp, mask) if name == "gmpo" else REFS[name](y, old, adv, hp)
            ref = ref * (1 if weights is None else weights) * mask
            torch.testing.assert_close(loss, ref)
            mode = "seq_mean_token_mean" if name == "gmpo" else "token_mean"
            aggregate_loss(loss, mask, mode).backward()
            ((ref.sum(-1) / mask.sum(-1)).mean() if name == "gmpo" else ref.sum() / mask.sum()).backward()
            torch.testing.assert_close(x.grad, y.grad)
            assert torch.all(x.grad[mask == 0] == 0)


@pytest.mark.parametrize("seed", [0, 1])
def test_cov_losses_match_autograd_of_the_formula(seed):
    lp, old, adv, mask, isw = _random(seed)
    m = mask.bool()
    cov = (adv - adv[m].mean()) * (lp - lp[m].mean())
    # KL-Cov: top-k by covariance (k = floor(0.1 * N)) get |log r| added
    x, y = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    loss, _ = kl_cov_loss(x, old, adv, mask, kl_cov_ratio=0.1, ppo_kl_coef=0.7, is_weights=isw)
    k = int(0.1 * m.sum())
    top = torch.zeros_like(m)
    top.view(-1)[torch.where(m, cov, torch.tensor(-math.inf, dtype=D)).view(-1).topk(k).indices] = True
    assert torch.equal(kl_cov_selection(covariance_scores(lp, adv, mask), m, 0.1), top)
    r = torch.exp(y - old)
    ref = (-adv * r + torch.where(top, 0.7 * (y - old).abs(), torch.zeros_like(r))) * isw * mask
    torch.testing.assert_close(loss, ref)
    loss.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(x.grad, y.grad)
    # Clip-Cov: PPO everywhere except the drawn tokens, which are exactly 0 (value and gradient)
    x = lp.clone().requires_grad_(True)
    loss, met = clip_cov_loss(x, old, adv, mask, clip_cov_ratio=0.2, clip_cov_lb=-1.0, clip_cov_ub=1.0,
                              generator=torch.Generator().manual_seed(seed))
    z = lp.clone().requires_grad_(True)
    ppo = POLICY_LOSSES["ppo"](z, old, adv, mask)[0]
    ppo.sum().backward()
    ppo = ppo.detach()
    zeroed = (loss == 0) & (ppo != 0)
    assert zeroed.sum() == max(1, int(0.2 * m.sum())) == round(met["cov_selected_frac"].item() * m.sum().item())
    assert torch.all((cov[zeroed] >= -1) & (cov[zeroed] <= 1))
    torch.testing.assert_close(loss[~zeroed], ppo[~zeroed])
    loss.sum().backward()
    assert torch.all(x.grad[zeroed] == 0) and torch.all(z.grad[zeroed] != 0)  # PPO alone would have moved them
    torch.testing.assert_close(x.grad[~zeroed], z.grad[~zeroed])


def test_cispo_gradient_flows_through_log_pi_only():
    """Were the clipped weight not detached, the gradient would pick up d(w)/dlog pi = r on unclipped tokens."""
    lp, old, adv, mask, _ = _random(5)
    x = lp.clone().requires_grad_(True)
    cispo_loss(x, old, adv, mask, eps_low=0.2, eps_high=0.28)[0].sum().backward()
    w = torch.exp(lp - old).clamp(0.8, 1.28)
    torch.testing.assert_close(x.grad, -w * adv * mask)
    z = lp.clone().requires_grad_(True)
    (-(torch.exp(z - old).clamp(0.8, 1.28)) * adv * z * mask).sum().backward()  # the weight not detached
    assert not torch.allclose(x.grad, z.grad)


@pytest.mark.parametrize("name", NEW)
def test_masked_positions_never_leak(name):
    lp, old, adv, mask, _ = _random(3)
    lp = torch.where(mask.bool(), lp, torch.tensor(-math.inf, dtype=D)).requires_grad_(True)
    loss, metrics = POLICY_LOSSES[name](lp, old, adv, mask)
    assert torch.isfinite(loss).all() and torch.all(loss[mask == 0] == 0)
    assert all(torch.isfinite(v) for v in metrics.values())
    loss.sum().backward()
    assert torch.isfinite(lp.grad).all()


@pytest.mark.parametrize("name, bad", [("cispo", {"eps_high": -1.0}), ("sapo", {"tau_pos": 0.0}),
                                       ("dppo", {"delta_low": -0.1}), ("dro", {"beta": -1.0}),
                                       ("gmpo", {"eps_low": -0.1}), ("clip_cov", {"clip_cov_lb": 6.0}),
                                       ("kl_cov", {"kl_cov_ratio": 2.0})])
def test_bad_hyper_parameters_are_refused(name, bad):
    lp, old, adv, mask, _ = _random(0)
    with pytest.raises(ValueError, match=next(iter(bad)).split("_")[-1]):
        POLICY_LOSSES[name](lp, old, adv, mask, **bad)
