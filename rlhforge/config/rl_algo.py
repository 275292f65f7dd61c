"""The ``--algo.*`` section of ``rlhforge rl`` (advantage estimation, IS correction, KL to the
reference, dynamic filtering); re-exported by :mod:`rlhforge.config.rl`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rlhforge.config.rl_distill import DistillConfig

__all__ = ["EstimatorRecord", "ESTIMATORS", "estimator_record", "AdvantageConfig", "KLConfig", "AlgoConfig"]


@dataclass(frozen=True)
class EstimatorRecord:
    """What one advantage estimator needs from the rest of the system; consumers read this record (the
    math itself is :data:`rlhforge.algorithms.advantages.ADVANTAGE_ESTIMATORS`, by the same name)."""

    name: str
    critic: bool = False
    """Needs a value model: the critic worker group is built and its values feed GAE."""
    groups: bool = False
    """Compares the ``rollout.n_samples_per_prompt`` samples of one prompt (needs n > 1)."""
    gamma_one: bool = False
    """Its baseline compares whole-sequence rewards: gamma is forced to 1 (with a warning, as OpenRLHF)."""
    old_logprobs: Literal["trainer", "rollout"] = "trainer"
    """pi_old of the policy ratio: the trainer's log-probs of the rollout, or the rollout engine's own."""
    policy_loss: str | None = None
    """A policy loss the estimator comes with (None: ``--actor.policy_loss_type``)."""
    loss_agg_mode: str | None = None
    """A loss aggregation the estimator comes with (None: ``--actor.loss_agg_mode``)."""
    teacher: bool = False
    """Needs a teacher model group (``--teacher.*``) whose log-probs of the samples feed the advantage."""


ESTIMATORS: dict[str, EstimatorRecord] = {r.name: r for r in (
    EstimatorRecord("gae", critic=True),
    EstimatorRecord("reinforce"),
    EstimatorRecord("reinforce_baseline", groups=True, gamma_one=True),
    EstimatorRecord("rloo", groups=True, gamma_one=True),
    EstimatorRecord("group_norm", groups=True, gamma_one=True),
    EstimatorRecord("dr_grpo", groups=True, gamma_one=True),
    EstimatorRecord("flash_reinforce", gamma_one=True, old_logprobs="rollout", policy_loss="flash_reinforce",
                    loss_agg_mode="seq_mean_token_mean"),
    EstimatorRecord("on_policy_distill", gamma_one=True, teacher=True),
)}


def estimator_record(name: str) -> EstimatorRecord:
    """The record of ``--algo.advantage.estimator name``; an unknown name lists the valid ones."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name]


@dataclass(frozen=True)
class AdvantageConfig:
    """Advantage estimation and rollout-vs-trainer importance-sampling correction."""

    estimator: Literal["gae", "reinforce", "rloo", "reinforce_baseline", "group_norm", "dr_grpo", "flash_reinforce",
                       "on_policy_distill"] = "gae"
    """gae (PPO with a critic), reinforce (REINFORCE++), reinforce_baseline, rloo, group_norm (GRPO),
    dr_grpo, flash_reinforce, on_policy_distill (a teacher's log-probs as the reward: ``--teacher.*``,
    ``--algo.distill.*``)."""
    gamma: float = 1.0
    """Discount factor."""
    lambd: float = 1.0
    """GAE lambda."""
    no_std_norm: bool = False
    """Global whitening keeps the centring and drops the division by the std (as OpenRLHF: group_norm
    still divides by the group std; for mean-centred groups use ``dr_grpo``)."""
    is_correction_level: Literal["off", "token", "seq"] = "off"
    """Importance-sampling correction between the rollout engine's and the trainer's log-probs."""
    is_correction_mode: Literal["mask", "clip"] = "mask"
    """Mask tokens/sequences outside the band, or clip their weights."""
    is_correction_gating: Literal["ratio", "binary_kl", "tv"] = "ratio"
    """Statistic compared with the band."""
    is_correction_threshold: tuple[float, ...] = (0.5, 5.0)
    """``low high`` band (one value: high only)."""

    @property
    def record(self) -> EstimatorRecord:
        """What the chosen estimator needs (:data:`ESTIMATORS`)."""
        return estimator_record(self.estimator)


@dataclass(frozen=True)
class KLConfig:
    """KL to the reference policy: as a reward penalty (default) or as a loss term."""

    init_coef: float = 0.01
    """Initial KL coefficient (0: no reference model)."""
    target: float | None = None
    """Adaptive controller target KL (None: fixed coefficient)."""
    horizon: int = 10000
    """Adaptive controller horizon."""
    estimator: Literal["k1", "k2", "k3"] = "k1"
    """KL estimator (k1 for the reward penalty; k2/k3 recommended with ``use_loss``)."""
    use_loss: bool = False
    """Add ``init_coef * KL`` to the policy loss instead of penalising the reward (GRPO style)."""
    unbiased_gradient: bool = False
    """With ``use_loss``: keep the KL term's value but back-propagate the importance-weighted reverse-KL
    gradient ``min(pi/pi_old, 10) * (log pi - log pi_ref)`` per token (OpenRLHF PR 1309; docs/rl.md)."""


@dataclass(frozen=True)
class AlgoConfig:
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    """On-policy distillation (``--algo.advantage.estimator on_policy_distill``; config/rl_distill.py)."""
    dynamic_filtering_enable: bool = False
    """DAPO dynamic sampling: drop prompt groups whose mean score is outside the open range; refill
    from the prompt stream until the rollout batch is full."""
    dynamic_filtering_range: tuple[float, float] = (0.0, 1.0)
    """Keep groups whose mean score lies strictly inside this range."""
    max_filter_refills: int = 8
    """Give up refilling after this many extra generation rounds in one step (the step then trains on
    what passed). rlhforge-specific."""
