"""KTO and APO-zero (unpaired) losses (rlhforge.algorithms.unpaired_losses): hand-worked values, TRL's
``KTOTrainer.kto_loss`` formula written out independently here, and gradients by autograd."""

import math

import pytest
import torch

from rlhforge.algorithms.unpaired_losses import (
    get_kto_loss,
    kto_kl_estimate,
    kto_losses,
    kto_reference_point,
)


def _sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_kto_hand_worked():
    """beta 0.5; h = [1, -2] (one desirable, one undesirable); mismatched log-ratios [0.2, 0.6] -> z = 0.4.
    desirable: 1 - sigmoid(0.5 (1 - 0.4)) = 1 - sigmoid(0.3); undesirable x 2: 2 (1 - sigmoid(0.5 (0.4 + 2)))."""
    policy, ref = torch.tensor([-3.0, -6.0]), torch.tensor([-4.0, -4.0])
    z = kto_reference_point(kto_kl_estimate(torch.tensor([-1.0, -2.0]), torch.tensor([-1.2, -2.6])))
    assert z.item() == pytest.approx(0.4)
    losses, rewards = kto_losses("kto", policy, ref, torch.tensor([True, False]), beta=0.5, reference_point=z,
                                 undesirable_weight=2.0)
    assert losses.tolist() == pytest.approx([1 - _sigmoid(0.3), 2 * (1 - _sigmoid(1.2))], abs=1e-7)
    assert rewards.tolist() == pytest.approx([0.5, -1.0])


def test_the_reference_point_is_a_clamped_detached_kl():
    assert kto_reference_point(torch.tensor(-0.7)).item() == 0.0
    x = torch.tensor([0.5, 1.5], requires_grad=True)
    assert not kto_kl_estimate(x, torch.zeros(2)).requires_grad


def test_apo_zero_unpaired_hand_worked():
    """desirable 1 - sigmoid(beta h), undesirable sigmoid(beta h); no reference point (z is ignored)."""
    losses, _ = kto_losses("apo_zero_unpaired", torch.tensor([-3.0, -6.0]), torch.tensor([-4.0, -4.0]),
                           torch.tensor([True, False]), beta=0.5, reference_point=torch.tensor(9.0))
    assert losses.tolist() == pytest.approx([1 - _sigmoid(0.5), _sigmoid(-1.0)], abs=1e-7)


def _trl_kto(policy_chosen, policy_rejected, policy_kl, ref_chosen, ref_rejected, ref_kl, beta, dw, uw):
    """TRL KTOTrainer.kto_loss, one process, as its source states it: KL = mean(policy_KL - ref_KL) detached,
    clamped at 0; chosen 1 - sigmoid(beta (logratio - KL)); rejected 1 - sigmoid(beta (KL - logratio));
    losses = cat(dw chosen, uw rejected); the batch loss is losses.mean()."""
    kl = (policy_kl - ref_kl).mean().detach().clamp(min=0)
    chosen = 1 - torch.sigmoid(beta * ((policy_chosen - ref_chosen) - kl))
    rejected = 1 - torch.sigmoid(beta * (kl - (policy_rejected - ref_rejected)))
    return torch.cat((dw * chosen, uw * rejected)).mean()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kto_equals_trls_formula_and_its_gradient(seed):
    g = torch.Generator().manual_seed(seed)
    n = 12
    desirable = torch.rand(n, generator=g) < 0.5
    desirable[0], desirable[1] = True, False
    policy = (torch.randn(n, generator=g) * 3 - 20).requires_grad_()
    ref = torch.randn(n, generator=g) * 3 - 20
    policy_kl, ref_kl = torch.randn(n, generator=g) * 2 - 25, torch.randn(n, generator=g) * 2 - 26
    beta, dw, uw = 0.3, 1.0, 1.33

    z = kto_reference_point(kto_kl_estimate(policy_kl, ref_kl))
    losses, _ = kto_losses("kto", policy, ref, desirable, beta=beta, reference_point=z, desirable_weight=dw,
                           undesirable_weight=uw)
    ours = losses.sum() / n
    (grad_ours,) = torch.autograd.grad(ours, policy)

    p2 = policy.detach().clone().requires_grad_()
    trl = _trl_kto(p2[desirable], p2[~desirable], policy_kl, ref[desirable], ref[~desirable], ref_kl, beta, dw, uw)
    (grad_trl,) = torch.autograd.grad(trl, p2)
    assert ours.item() == pytest.approx(trl.item(), abs=1e-6)
    torch.testing.assert_close(grad_ours, grad_trl, atol=1e-7, rtol=1e-6)


def test_unknown_loss_type_names_the_choices():
    with pytest.raises(ValueError, match="apo_zero_unpaired"):
        get_kto_loss("sigmoid")
