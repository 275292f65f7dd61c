"""The unbiased KL-loss gradient (``--algo.kl.unbiased_gradient``): value of the chosen estimator,
gradient ``w * (log pi - log pi_ref)`` with ``w = min(pi / pi_old, clip)``."""

import math

import pytest
import torch

from rlhforge.algorithms.kl import DEFAULT_KL_IS_WEIGHT_CLIP, kl_loss, kl_loss_unbiased_gradient

LN2 = math.log(2.0)


def _grad(fn, lp, *args, **kw):
    lp = lp.clone().requires_grad_(True)
    fn(lp, *args, **kw).sum().backward()
    return lp.grad


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_value_is_the_estimator_value(est):
    g = torch.Generator().manual_seed(0)
    lp, ref, old = (torch.randn(3, 5, generator=g) for _ in range(3))
    mask = torch.ones(3, 5)
    mask[1, 3:] = 0
    torch.testing.assert_close(kl_loss_unbiased_gradient(lp, ref, mask, est, old), kl_loss(lp, ref, mask, est),
                               rtol=0, atol=1e-6)


def test_gradient_by_hand():
    # x = log pi - log pi_ref; w = exp(log pi - log pi_old), clamped at 10
    lp = torch.tensor([[LN2, -LN2, 0.5, 3.0]])
    ref = torch.zeros(1, 4)
    old = torch.tensor([[0.0, 0.0, 0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    got = _grad(kl_loss_unbiased_gradient, lp, ref, mask, "k3", old)
    # token 0: w = 2, x = ln2 -> 2 ln2; token 1: w = 1/2, x = -ln2 -> -ln2/2; token 2: w = 1, x = .5
    # token 3: w = e^3 = 20.09 clamped to 10, x = 3 -> 30
    want = torch.tensor([[2 * LN2, -LN2 / 2, 0.5, 10.0 * 3.0]])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert DEFAULT_KL_IS_WEIGHT_CLIP == 10.0


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_on_policy_gradient_is_k1_coefficient_for_every_estimator(est):
    g = torch.Generator().manual_seed(1)
    lp, ref = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    got = _grad(kl_loss_unbiased_gradient, lp, ref, mask, est, None)
    torch.testing.assert_close(got, (lp - ref) * mask, rtol=0, atol=1e-6)
    # pi_old == pi_theta (PPO's first step) gives the same as no pi_old
    torch.testing.assert_close(_grad(kl_loss_unbiased_gradient, lp, ref, mask, est, lp.clone()), got)


def test_equals_the_reverse_kl_gradient_of_a_categorical_in_expectation():
    """Exact expectation over a 5-token vocabulary: sum_a pi_old(a) * per-token gradient through the
    logits equals autograd of the true KL(pi || pi_ref); the plain k3 loss's expectation does not."""
    g = torch.Generator().manual_seed(2)
    z = torch.randn(5, generator=g, dtype=torch.float64)
    z_ref = torch.randn(5, generator=g, dtype=torch.float64)
    z_old = z + 0.4 * torch.randn(5, generator=g, dtype=torch.float64)  # pi_old != pi_theta
    ref = z_ref.log_softmax(-1)
    old = z_old.log_softmax(-1)
    p_old = old.exp()

    def expected_grad(loss_fn, **kw):
        zz = z.clone().requires_grad_(True)
        lp = zz.log_softmax(-1)  # all 5 tokens, weighted by the sampling probability pi_old(a)
        per_tok = loss_fn(lp[None], ref[None], torch.ones(1, 5, dtype=torch.float64), **kw)[0]
        (p_old * per_tok).sum().backward()
        return zz.grad

    zz = z.clone().requires_grad_(True)
    lp = zz.log_softmax(-1)
    (lp.exp() * (lp - ref)).sum().backward()  # KL(pi || pi_ref), exact
    true = zz.grad

    unbiased = expected_grad(kl_loss_unbiased_gradient, estimator="k3", old_log_probs=old[None], clamp=None,
                             is_weight_clip=1e9)
    torch.testing.assert_close(unbiased, true, rtol=1e-10, atol=1e-12)
    plain = expected_grad(kl_loss, estimator="k3", clamp=None)
    assert (plain - true).abs().max() > 1e-2  # k3 as loss, sampled off-policy: biased
    on_policy_k2 = expected_grad(kl_loss, estimator="k2", clamp=None)
    assert (on_policy_k2 - true).abs().max() > 1e-3  # k2 is unbiased only when pi_old == pi_theta


def test_masked_positions_have_zero_value_and_gradient_even_with_inf():
    lp = torch.tensor([[0.3, -math.inf]])
    ref = torch.tensor([[0.0, math.nan]])
    old = torch.tensor([[0.0, math.inf]])
    mask = torch.tensor([[1.0, 0.0]])
    lpg = lp.clone().requires_grad_(True)
    out = kl_loss_unbiased_gradient(lpg, ref, mask, "k3", old)
    assert out[0, 1].item() == 0.0
    out.sum().backward()
    assert lpg.grad[0, 1].item() == 0.0 and torch.isfinite(lpg.grad).all()
    torch.testing.assert_close(lpg.grad[0, 0], torch.tensor(min(math.exp(0.3), 10.0) * 0.3))


def test_rl_cli_flag_keeps_the_logged_kl_and_changes_the_update(tiny_model_dir, tmp_path):
    """One GRPO step with the KL as a k3 loss, with and without --algo.kl.unbiased_gradient: the same
    rollout and the same logged actor/kl_loss (the value is the estimator's), different weights."""
    from safetensors.torch import load_file

    from rlhforge.cli.train_ppo_ray import main as rl_main
    from tests.rl.helpers import metrics, rl_args, write_reward

    reward = write_reward(tmp_path / "reward.py")
    runs = {}
    for name, extra in (("plain", []), ("unbiased", ["--algo.kl.unbiased_gradient"])):
        out = tmp_path / name
        # two optimizer steps per rollout, so the second sees pi_theta != pi_old (w != 1)
        assert rl_main(rl_args(tiny_model_dir, out, "--reward.remote_url", reward, "--algo.kl.use_loss",
                               "--algo.kl.estimator", "k3", "--algo.kl.init_coef", "0.5", *extra, steps=1)) == 0
        rec = next(r for r in metrics(out) if "actor/kl_loss" in r)
        runs[name] = rec, load_file(out / "model.safetensors")
    (a, wa), (b, wb) = runs["plain"], runs["unbiased"]
    assert a["rollout/reward_mean"] == b["rollout/reward_mean"]
    # the first update starts at pi = pi_ref (KL 0, both gradients 0), so both runs reach the second with the
    # same weights: its KL value is the same, its KL gradient is not
    assert a["actor/kl_loss"] > 1e-6
    assert a["actor/kl_loss"] == pytest.approx(b["actor/kl_loss"], rel=1e-4, abs=1e-9)
    assert any(not torch.allclose(wa[k], wb[k], atol=1e-7) for k in wa)
