"""Clipped and unclipped value loss."""

import math

import pytest
import torch

from rlhforge.algorithms.value_losses import value_loss

D = torch.float64


def t(x):
    return torch.tensor(x, dtype=D)


def test_unclipped_by_hand():
    v = t([[1.0, 2.0, 0.0]]).requires_grad_(True)
    loss, m = value_loss(v, t([[0.0, 0.0, 0.0]]), t([[2.0, 1.0, 1.0]]), torch.ones(1, 3))
    # 0.5 * (V - R)^2 = 0.5 * [1, 1, 1]
    torch.testing.assert_close(loss.detach(), t([[0.5, 0.5, 0.5]]))
    assert m["clip_frac"].item() == 0.0
    loss.sum().backward()
    torch.testing.assert_close(v.grad, t([[-1.0, 1.0, -1.0]]))  # V - R


def test_clipped_by_hand():
    v = t([[1.0, 2.0, 0.0]]).requires_grad_(True)
    old = t([[0.5, 2.5, 1.0]])
    ret = t([[2.0, 1.0, 2.0]])
    loss, m = value_loss(v, old, ret, torch.ones(1, 3), value_clip=0.2)
    # t0: unclipped (1-2)^2 = 1 ; Vclip = 0.5 + 0.2 = 0.7 -> (0.7-2)^2 = 1.69 -> max 1.69 -> 0.845 (clip used)
    # t1: unclipped (2-1)^2 = 1 ; Vclip = 2.5 - 0.2 = 2.3 -> 1.69 -> 0.845 (clip used)
    # t2: unclipped (0-2)^2 = 4 ; Vclip = 1 - 0.2 = 0.8 -> 1.44 -> max 4 -> 2.0 (unclipped used)
    torch.testing.assert_close(loss.detach(), t([[0.845, 0.845, 2.0]]))
    assert m["clip_frac"].item() == pytest.approx(2 / 3)
    loss.sum().backward()
    # clipped branch is constant in V beyond the clip -> 0 ; t2: V - R = -2
    torch.testing.assert_close(v.grad, t([[0.0, 0.0, -2.0]]))


def test_masked_positions_and_validation():
    v = t([[1.0, math.nan]]).requires_grad_(True)
    loss, m = value_loss(v, t([[1.0, math.inf]]), t([[3.0, math.nan]]), torch.tensor([[1.0, 0.0]]), value_clip=0.5)
    torch.testing.assert_close(loss.detach(), t([[2.0, 0.0]]))  # 0.5 * (1 - 3)^2
    loss.sum().backward()
    assert torch.isfinite(v.grad).all() and v.grad[0, 1].item() == 0.0
    assert m["values_mean"].item() == 1.0
    with pytest.raises(ValueError, match="value_clip must be > 0"):
        value_loss(v, v, v, torch.ones(1, 2), value_clip=0.0)
    with pytest.raises(ValueError, match="shape mismatch"):
        value_loss(v, t([[1.0]]), v, torch.ones(1, 2))
