"""Reward-model losses, DPO / cDPO / IPO, implicit rewards, accuracy, NLL term."""

import math

import pytest
import torch

from rlhforge.algorithms.preference_losses import (
    DPO_LOSSES,
    PREFERENCE_LOSSES,
    RM_LOSSES,
    cdpo_loss,
    chosen_nll_loss,
    dpo_sigmoid_loss,
    get_dpo_loss,
    get_rm_loss,
    implicit_rewards,
    ipo_loss,
    preference_accuracy,
    rm_logexp_loss,
    rm_sigmoid_loss,
    sequence_logps,
)

D = torch.float64
SP1 = math.log1p(math.exp(-1))  # softplus(-1) = -logsigmoid(1) = 0.313262
LN2 = math.log(2)


def t(x):
    return torch.tensor(x, dtype=D)


def test_rm_sigmoid_and_logexp_by_hand():
    c, r = t([2.0, 0.0]), t([1.0, 0.0])
    # -logsig(1) = 0.313262, -logsig(0) = ln 2 = 0.693147 -> mean 0.503204
    assert rm_sigmoid_loss(c, r).item() == pytest.approx((SP1 + LN2) / 2)
    assert rm_logexp_loss(c, r).item() == pytest.approx((SP1 + LN2) / 2)
    # margin [1, 0]: -logsig(2 - 1 - 1) = ln 2 and -logsig(0) = ln 2
    assert rm_sigmoid_loss(c, r, margin=t([1.0, 0.0])).item() == pytest.approx(LN2)
    # logexp with margin 1: log(1 + e^0) = ln 2 and log(1 + e^1) = 1.313262 -> mean 1.003204
    assert rm_logexp_loss(c, r, margin=1.0).item() == pytest.approx((LN2 + 1 + SP1) / 2)


def test_rm_losses_extreme_and_accuracy():
    assert rm_sigmoid_loss(t([0.0]), t([1000.0])).item() == pytest.approx(1000.0)
    assert rm_logexp_loss(t([1000.0]), t([0.0])).item() == pytest.approx(0.0, abs=1e-300)
    # [2 > 1, 0 = 0 (tie counts as wrong), 1 < 3] -> 1/3
    assert preference_accuracy(t([2.0, 0.0, 1.0]), t([1.0, 0.0, 3.0])).item() == pytest.approx(1 / 3)


def test_dpo_by_hand():
    pc, pr, rc, rr = t([-1.0]).requires_grad_(True), t([-3.0]), t([-2.0]), t([-2.0])
    loss, cr, rj = dpo_sigmoid_loss(pc, pr, rc, rr, beta=0.5)
    # h = (-1 + 3) - (-2 + 2) = 2 ; beta h = 1 -> -logsig(1) = 0.313262
    assert loss.item() == pytest.approx(SP1)
    # implicit rewards: 0.5 * (-1 + 2) = 0.5 ; 0.5 * (-3 + 2) = -0.5
    torch.testing.assert_close(cr, t([0.5]))
    torch.testing.assert_close(rj, t([-0.5]))
    loss.backward()
    # d/dpc = -beta (1 - sigmoid(1)) = -0.5 * 0.268941 = -0.134471
    assert pc.grad.item() == pytest.approx(-0.5 * (1 - 1 / (1 + math.exp(-1))))


def test_cdpo_by_hand():
    args = (t([-1.0]), t([-3.0]), t([-2.0]), t([-2.0]))
    loss, _, _ = cdpo_loss(*args, beta=0.5, label_smoothing=0.1)
    # 0.9 * softplus(-1) + 0.1 * softplus(1) = 0.9 * 0.313262 + 0.1 * 1.313262 = 0.413262
    assert loss.item() == pytest.approx(0.9 * SP1 + 0.1 * (1 + SP1))
    same, _, _ = dpo_sigmoid_loss(*args, beta=0.5, label_smoothing=0.1)
    assert same.item() == loss.item()
    with pytest.raises(ValueError, match="cdpo needs label_smoothing > 0"):
        cdpo_loss(*args, label_smoothing=0.0)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0.5\)"):
        dpo_sigmoid_loss(*args, label_smoothing=0.5)
    with pytest.raises(ValueError, match="beta must be > 0"):
        dpo_sigmoid_loss(*args, beta=0.0)


def test_ipo_by_hand_summed_and_length_averaged():
    args = (t([-1.0]), t([-3.0]), t([-2.0]), t([-2.0]))  # h = 2
    assert ipo_loss(*args, beta=0.5)[0].item() == pytest.approx(1.0)  # (2 - 1)^2
    assert ipo_loss(*args, beta=0.25)[0].item() == pytest.approx(0.0)  # (2 - 2)^2
    sums = (t([-4.0]), t([-6.0]), t([-2.0]), t([-6.0]))
    # summed: h = (-4 + 6) - (-2 + 6) = -2 -> (-2 - 1)^2 = 9
    assert ipo_loss(*sums, beta=0.5)[0].item() == pytest.approx(9.0)
    # averaged (chosen 2 tokens, rejected 3): pc -2, rc -1, pr -2, rr -2 -> h = 0 - 1 = -1 -> (-1 - 1)^2 = 4
    loss, cr, rj = ipo_loss(*sums, beta=0.5, chosen_lengths=t([2.0]), rejected_lengths=t([3.0]))
    assert loss.item() == pytest.approx(4.0)
    torch.testing.assert_close(cr, t([-0.5]))  # 0.5 * (-2 + 1)
    torch.testing.assert_close(rj, t([0.0]))
    with pytest.raises(ValueError, match="both chosen_lengths and rejected_lengths"):
        ipo_loss(*sums, chosen_lengths=t([2.0]))


def test_sequence_logps_implicit_rewards_and_nll():
    logps = t([[-1.0, -3.0, math.nan], [-2.0, math.inf, math.inf], [math.nan, math.nan, math.nan]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(sequence_logps(logps, mask), t([-4.0, -2.0, 0.0]))
    torch.testing.assert_close(sequence_logps(logps, mask, average=True), t([-2.0, -2.0, 0.0]))
    torch.testing.assert_close(implicit_rewards(t([-1.0]), t([-3.0]), 0.1), t([0.2]))
    # per-sequence averages -2 and -2 (empty row excluded) -> nll = 2
    assert chosen_nll_loss(logps, mask).item() == pytest.approx(2.0)
    assert chosen_nll_loss(logps, torch.zeros(3, 3)).item() == 0.0


def test_tables_and_unknown_names():
    assert RM_LOSSES == {"sigmoid": rm_sigmoid_loss, "logexp": rm_logexp_loss}
    assert DPO_LOSSES == {"sigmoid": dpo_sigmoid_loss, "cdpo": cdpo_loss, "ipo": ipo_loss}
    assert PREFERENCE_LOSSES is DPO_LOSSES
    with pytest.raises(ValueError, match="unknown reward-model loss 'hinge'; valid names: logexp, sigmoid"):
        get_rm_loss("hinge")
    with pytest.raises(ValueError, match="unknown DPO loss 'kto'; valid names: cdpo, ipo, sigmoid"):
        get_dpo_loss("kto")
    assert get_dpo_loss("ipo") is ipo_loss
