"""KL coefficient (beta) controllers: fixed, and adaptive (Ziegler et al., 2019).

Adaptive rule ("Fine-Tuning Language Models from Human Preferences", arXiv:1909.08593, sec 2.2):

    error = clip(current_kl / target - 1, -0.2, 0.2)
    beta <- beta * (1 + error * n_steps / horizon)

``n_steps`` is the number of samples the KL was measured on (OpenRLHF passes rollout prompts x
samples per prompt). Both controllers have ``value``, ``update(current_kl, n_steps)`` and
``state_dict()`` / ``load_state_dict()`` so a resumed run continues with the same beta.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FixedKLController", "AdaptiveKLController", "make_kl_controller"]


class FixedKLController:
    """beta stays at its initial value; ``update`` does nothing."""

    kind = "fixed"

    def __init__(self, init_kl_coef: float):
        if init_kl_coef < 0:
            raise ValueError(f"init_kl_coef must be >= 0 (got {init_kl_coef})")
        self.value = float(init_kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        """No-op; returns the (unchanged) value."""
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_kind(self.kind, state)
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller that steers the measured KL towards ``target``.

    Args:
        init_kl_coef: starting beta (> 0; a zero beta could never move).
        target: desired KL per sample (> 0).
        horizon: how many samples it takes to correct a 20% error by ~20% (> 0); OpenRLHF's
            default is 10000.
    """

    kind = "adaptive"

    def __init__(self, init_kl_coef: float, target: float, horizon: float = 10000):
        if init_kl_coef <= 0:
            raise ValueError(f"adaptive KL needs init_kl_coef > 0 (got {init_kl_coef})")
        if target <= 0:
            raise ValueError(f"adaptive KL needs target > 0 (got {target})")
        if horizon <= 0:
            raise ValueError(f"adaptive KL needs horizon > 0 (got {horizon})")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Apply one update with the KL measured over ``n_steps`` samples; returns the new beta."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore beta (target and horizon come from the constructor, i.e. the run's config)."""
        _check_kind(self.kind, state)
        self.value = float(state["value"])


def _check_kind(kind: str, state: dict[str, Any]) -> None:
    saved = state.get("kind", kind)
    if saved != kind:
        raise ValueError(f"cannot load a {saved!r} KL controller state into a {kind!r} controller")


def make_kl_controller(
    init_kl_coef: float, target: float | None = None, horizon: float = 10000
) -> FixedKLController | AdaptiveKLController:
    """Adaptive controller when ``target`` is given, fixed otherwise (OpenRLHF's ``kl.target``)."""
    if target is None:
        return FixedKLController(init_kl_coef)
    return AdaptiveKLController(init_kl_coef, target, horizon)
