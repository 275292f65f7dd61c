"""Fixed and adaptive KL controllers."""

import pytest

from rlhforge.algorithms.kl_controller import AdaptiveKLController, FixedKLController, make_kl_controller


def test_fixed_controller():
    c = FixedKLController(0.05)
    assert c.update(current_kl=100.0, n_steps=1000) == 0.05
    assert c.value == 0.05
    d = FixedKLController(0.0)
    d.load_state_dict(c.state_dict())
    assert d.value == 0.05
    with pytest.raises(ValueError, match=">= 0"):
        FixedKLController(-0.1)


def test_adaptive_controller_by_hand():
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    # error = clip(9/6 - 1 = 0.5, -0.2, 0.2) = 0.2 ; beta = 0.1 * (1 + 0.2 * 1000/10000) = 0.102
    assert c.update(9.0, 1000) == pytest.approx(0.102, abs=1e-12)
    # error = 5.4/6 - 1 = -0.1 ; beta = 0.102 * (1 - 0.1 * 2000/10000) = 0.102 * 0.98 = 0.09996
    assert c.update(5.4, 2000) == pytest.approx(0.09996, abs=1e-12)
    # error = clip(0/6 - 1 = -1, ...) = -0.2 ; beta = 0.09996 * (1 - 0.2 * 0.5) = 0.089964
    assert c.update(0.0, 5000) == pytest.approx(0.089964, abs=1e-12)


def test_adaptive_state_roundtrip_continues_the_same_curve():
    a = AdaptiveKLController(0.1, target=1.0, horizon=100)
    a.update(2.0, 10)
    b = AdaptiveKLController(0.1, target=1.0, horizon=100)
    b.load_state_dict(a.state_dict())
    assert b.value == a.value
    assert a.update(0.5, 10) == b.update(0.5, 10)
    with pytest.raises(ValueError, match="cannot load a 'fixed'"):
        b.load_state_dict(FixedKLController(0.1).state_dict())


def test_adaptive_validation_and_factory():
    with pytest.raises(ValueError, match="init_kl_coef > 0"):
        AdaptiveKLController(0.0, target=1.0)
    with pytest.raises(ValueError, match="target > 0"):
        AdaptiveKLController(0.1, target=0.0)
    with pytest.raises(ValueError, match="horizon > 0"):
        AdaptiveKLController(0.1, target=1.0, horizon=0)
    assert isinstance(make_kl_controller(0.01), FixedKLController)
    c = make_kl_controller(0.01, target=0.1, horizon=500)
    assert isinstance(c, AdaptiveKLController) and c.horizon == 500.0
