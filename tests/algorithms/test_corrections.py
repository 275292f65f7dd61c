"""Rollout-vs-trainer IS corrections: presets, general gate, validation."""

import math

import pytest
import torch

from rlhforge.algorithms.corrections import (
    IS_CORRECTIONS,
    flash_reinforce_trust_region,
    get_is_correction,
    icepop,
    is_correction,
    seq_mask_tis,
    tis,
)

LN = math.log


def _inputs():
    # row 0: log w = [ln 2, ln 0.25, ln 10] on action tokens, last position masked (garbage there)
    # row 1: log w = [ln 8, ln 8]
    roll = torch.tensor([[-3.0, -1.0, -4.0, math.nan], [-5.0, -5.0, 0.0, 0.0]])
    train = roll.nan_to_num(0.0) + torch.tensor([[LN(2), LN(0.25), LN(10), -math.inf], [LN(8), LN(8), 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    return train, roll, mask


def test_tis_clamps_weights_and_drops_nothing():
    train, roll, mask = _inputs()
    w, new_mask, m = tis(train, roll, mask)
    # clamp to [0.5, 5]: [2, 0.25 -> 0.5, 10 -> 5] and [8 -> 5, 8 -> 5]
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 5.0, 0.0], [5.0, 5.0, 0.0, 0.0]]))
    assert torch.equal(new_mask, mask)
    assert m["clipped_frac"].item() == pytest.approx(4 / 5)
    # rollout_kl = mean(log roll - log train) = -(ln2 + ln0.25 + ln10 + 2 ln8) / 5 = -1.153664
    assert m["rollout_kl"].item() == pytest.approx(-(LN(2) + LN(0.25) + LN(10) + 2 * LN(8)) / 5, abs=1e-6)


def test_icepop_drops_tokens_outside_the_band():
    train, roll, mask = _inputs()
    w, new_mask, m = icepop(train, roll, mask)
    # only w = 2 is inside [0.5, 5]; survivors keep the unclamped weight
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    assert new_mask.tolist() == [[1, 0, 0, 0], [0, 0, 0, 0]]
    assert m["filtered_frac"].item() == pytest.approx(4 / 5)


def test_seq_mask_tis_uses_the_geometric_mean():
    train, roll, mask = _inputs()
    w, new_mask, m = seq_mask_tis(train, roll, mask)
    # row 0: exp((ln2 + ln0.25 + ln10)/3) = 5^(1/3) = 1.70998 in band -> kept with unclamped w
    # row 1: geometric mean 8 > 5 -> dropped
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.25, 10.0, 0.0], [0.0, 0.0, 0.0, 0.0]]), rtol=1e-5, atol=1e-6)
    assert new_mask.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]]
    assert m["filtered_frac"].item() == pytest.approx(0.5)
    # a float mask comes back as a float mask
    assert seq_mask_tis(train, roll, mask.float())[1].dtype == torch.float32


def test_binary_kl_and_tv_gates():
    roll = torch.log(torch.tensor([[0.5, 0.3], [0.5, 0.5]]))
    train = torch.log(torch.tensor([[0.25, 0.3], [0.5, 0.5]]))
    mask = torch.ones(2, 2)
    # row 0 token KL_bin(0.5 || 0.25) = 0.143841 and 0 -> seq mean 0.071921 ; row 1: 0
    _, keep, m = flash_reinforce_trust_region(train, roll, mask, high=0.1)
    assert keep.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    w, keep, m = flash_reinforce_trust_region(train, roll, mask, high=0.05)
    assert keep.tolist() == [[0.0, 0.0], [1.0, 1.0]]
    assert m["filtered_frac"].item() == pytest.approx(0.5)
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    # token-level TV |0.5 - 0.25| = 0.25 > 0.2 -> only that token is dropped
    w, keep, _ = is_correction(train, roll, mask, level="token", mode="mask", gating="tv", low=None, high=0.2)
    assert keep.tolist() == [[0.0, 1.0], [1.0, 1.0]]
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0], [1.0, 1.0]]))


def test_extreme_ratios_stay_finite_and_weights_are_detached():
    train = torch.tensor([[1000.0, 0.0]], requires_grad=True)
    roll = torch.tensor([[0.0, -1000.0]])
    for fn in (tis, icepop, seq_mask_tis):
        w, _, m = fn(train, roll, torch.ones(1, 2))
        assert torch.isfinite(w).all() and not w.requires_grad
        assert all(torch.isfinite(v) for v in m.values())
    w, keep, _ = icepop(train, roll, torch.ones(1, 2))
    assert keep.tolist() == [[0.0, 0.0]]  # e^20 is far outside [0.5, 5]


def test_invalid_combinations_explain_themselves():
    train, roll, mask = _inputs()
    with pytest.raises(ValueError, match="'clip' works per token only"):
        is_correction(train, roll, mask, level="seq", mode="clip")
    with pytest.raises(ValueError, match="needs gating='ratio'"):
        is_correction(train, roll, mask, mode="clip", gating="binary_kl", low=0.0, high=0.1)
    with pytest.raises(ValueError, match="upper bound only"):
        is_correction(train, roll, mask, mode="mask", gating="tv", low=0.5, high=5.0)
    with pytest.raises(ValueError, match="unknown IS-correction level 'sequence'; valid: token, seq"):
        is_correction(train, roll, mask, level="sequence")
    with pytest.raises(ValueError, match="valid: clip, mask"):
        is_correction(train, roll, mask, mode="drop")
    with pytest.raises(ValueError, match="valid: ratio, binary_kl, tv"):
        is_correction(train, roll, mask, mode="mask", gating="kl")
    with pytest.raises(ValueError, match="low <= high"):
        is_correction(train, roll, mask, low=5.0, high=0.5)


def test_table_and_unknown_name():
    assert IS_CORRECTIONS == {"tis": tis, "icepop": icepop, "seq_mask_tis": seq_mask_tis, "flash_reinforce": flash_reinforce_trust_region}
    assert get_is_correction("seq-mask-tis") is seq_mask_tis
    with pytest.raises(ValueError, match="unknown IS correction 'mis'; valid names: flash_reinforce, icepop, seq_mask_tis, tis"):
        get_is_correction("mis")
