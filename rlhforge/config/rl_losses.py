"""``--actor.policy_loss_type`` and its hyper-parameters (``--actor.policy_loss.*``): the names (with the
veRL / TRL / prime-rl aliases), which flags each loss reads, and the start-up rules of the combinations
that mean nothing. The maths is :data:`rlhforge.algorithms.POLICY_LOSSES` (docs/algorithms.md)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, get_args

from rlhforge.config.parsing import ConfigError
from rlhforge.config.aliases import POLICY_LOSS_FLAG_ALIASES  # noqa: F401 (re-exported: the tables live in config/aliases.py)

__all__ = ["PolicyLossParams", "PolicyLossType", "POLICY_LOSS_TYPES", "POLICY_LOSS_ALIASES", "POLICY_LOSS_FLAG_ALIASES", "LOSS_PARAMS",
           "USES_PPO_CLIP", "SEQUENCE_LOSSES", "canonical_loss_type", "policy_loss_setup", "validate_policy_loss",
           "policy_loss_notices"]

#: the values ``--actor.policy_loss_type`` takes: our names, then the aliases
PolicyLossType = Literal["ppo", "gspo", "cispo", "sapo", "dppo", "dro", "gmpo", "clip_cov", "kl_cov",
                         "vanilla", "geo_mean", "dppo_tv"]
#: other frameworks' names of the same losses: veRL's ``loss_mode`` values
POLICY_LOSS_ALIASES = {"vanilla": "ppo", "geo_mean": "gmpo", "dppo_tv": "dppo"}
#: our names (each a key of rlhforge.algorithms.POLICY_LOSSES)
POLICY_LOSS_TYPES = tuple(n for n in get_args(PolicyLossType) if n not in POLICY_LOSS_ALIASES)
@dataclass(frozen=True)
class PolicyLossParams:
    """Hyper-parameters of the policy losses beyond PPO's clip (``--actor.policy_loss.*``); each is read
    only by the loss its name starts with (``ppo_kl_coef``: KL-Cov's). Defaults: the papers' / leaders'."""

    cispo_eps_low: float | None = None
    """CISPO: the IS weight is clamped at ``1 - eps_low`` from below (None: no lower clip, MiniMax-M1)."""
    cispo_eps_high: float = 5.0
    """CISPO: upper clip of the IS weight at ``1 + eps_high`` (5.0: TRL's recommendation, after ScaleRL)."""
    sapo_tau_pos: float = 1.0
    """SAPO: gate temperature where A > 0 (TRL ``sapo_temperature_pos``, veRL ``tau_pos``)."""
    sapo_tau_neg: float = 1.05
    """SAPO: gate temperature where A <= 0 (TRL ``sapo_temperature_neg``, veRL ``tau_neg``)."""
    dppo_delta_low: float = 0.2
    """DPPO: mask tokens with A < 0 whose probability fell by more than this (prime-rl ``dppo_mask_low``)."""
    dppo_delta_high: float = 0.2
    """DPPO: mask tokens with A > 0 whose probability rose by more than this (prime-rl ``dppo_mask_high``)."""
    dppo_ratio_cap: float | None = None
    """DPPO: cap C of the detached IS weight ``min(r, C)`` (None: no cap, as prime-rl)."""
    dro_beta: float = 0.05
    """DRO: weight of ``(beta/2)(log pi - log pi_old)^2`` (Tinker's default; veRL ``policy_loss.dro_beta``)."""
    gmpo_eps_low: float = 0.4
    """GMPO: log-space clip below, ``log r >= -eps_low`` (TRL GMPO: e^-0.4)."""
    gmpo_eps_high: float = 0.4
    """GMPO: log-space clip above, ``log r <= eps_high`` (TRL GMPO: e^0.4)."""
    clip_cov_ratio: float = 2e-4
    """Clip-Cov: fraction of the action tokens whose loss is zeroed (veRL)."""
    clip_cov_lb: float = 1.0
    """Clip-Cov: lower bound of the covariance band of candidate tokens (veRL)."""
    clip_cov_ub: float = 5.0
    """Clip-Cov: upper bound of the covariance band of candidate tokens (veRL)."""
    kl_cov_ratio: float = 2e-4
    """KL-Cov: fraction of the action tokens (the largest covariance) given the |log r| penalty (veRL)."""
    ppo_kl_coef: float = 1.0
    """KL-Cov: coefficient of the |log r| penalty (veRL's name)."""


#: loss -> {PolicyLossParams field: keyword of the loss function}
LOSS_PARAMS: dict[str, dict[str, str]] = {
    "cispo": {"cispo_eps_low": "eps_low", "cispo_eps_high": "eps_high"},
    "sapo": {"sapo_tau_pos": "tau_pos", "sapo_tau_neg": "tau_neg"},
    "dppo": {"dppo_delta_low": "delta_low", "dppo_delta_high": "delta_high", "dppo_ratio_cap": "ratio_cap"},
    "dro": {"dro_beta": "beta"},
    "gmpo": {"gmpo_eps_low": "eps_low", "gmpo_eps_high": "eps_high"},
    "clip_cov": {"clip_cov_ratio": "clip_cov_ratio", "clip_cov_lb": "clip_cov_lb", "clip_cov_ub": "clip_cov_ub"},
    "kl_cov": {"kl_cov_ratio": "kl_cov_ratio", "ppo_kl_coef": "ppo_kl_coef"},
}
#: losses built on PPO's clipped ratio: the only ones that read --actor.eps_clip(_low_high) and --actor.dual_clip
USES_PPO_CLIP = ("ppo", "gspo", "clip_cov")
#: losses with one value per sequence: aggregated seq-mean-token-mean whatever --actor.loss_agg_mode says
SEQUENCE_LOSSES = ("gspo", "gmpo")
_WHY_NO_CLIP = {
    "cispo": "CISPO clips the detached IS weight with --actor.policy_loss.cispo_eps_low/high, not the ratio",
    "sapo": "SAPO replaces the clip with a sigmoid gate (--actor.policy_loss.sapo_tau_pos/neg)",
    "dppo": "DPPO's trust region is on the probability difference (--actor.policy_loss.dppo_delta_low/high)",
    "dro": "DRO has no ratio clip: its quadratic term (--actor.policy_loss.dro_beta) keeps pi near pi_old",
    "gmpo": "GMPO clips the log-ratio itself (--actor.policy_loss.gmpo_eps_low/high)",
    "kl_cov": "KL-Cov replaces the clip with a |log r| penalty on high-covariance tokens",
}


def canonical_loss_type(name: str) -> str:
    """Our name of ``--actor.policy_loss_type name`` (an alias -> its loss)."""
    return POLICY_LOSS_ALIASES.get(name, name)


def policy_loss_setup(actor) -> tuple[str, dict, str | None]:
    """``(loss name, keyword arguments of the loss function, forced aggregation or None)`` of an actor config."""
    name = canonical_loss_type(actor.policy_loss_type)
    kwargs = {kw: getattr(actor.policy_loss, field) for field, kw in LOSS_PARAMS.get(name, {}).items()}
    if name in USES_PPO_CLIP:
        low, high = actor.eps_clip_low_high if actor.eps_clip_low_high is not None else (actor.eps_clip, actor.eps_clip)
        kwargs.update(eps_low=low, eps_high=high, dual_clip=actor.dual_clip)
    return name, kwargs, ("seq_mean_token_mean" if name in SEQUENCE_LOSSES else None)


def _check_ranges(p: PolicyLossParams) -> None:
    flag = "--actor.policy_loss."
    rules = [
        (p.cispo_eps_low is None or 0 <= p.cispo_eps_low <= 1, "cispo_eps_low", "in [0, 1] (or null: no lower clip)"),
        (p.cispo_eps_high >= 0, "cispo_eps_high", ">= 0"),
        (p.sapo_tau_pos > 0, "sapo_tau_pos", "> 0"), (p.sapo_tau_neg > 0, "sapo_tau_neg", "> 0"),
        (p.dppo_delta_low >= 0, "dppo_delta_low", ">= 0"), (p.dppo_delta_high >= 0, "dppo_delta_high", ">= 0"),
        (p.dppo_ratio_cap is None or p.dppo_ratio_cap > 0, "dppo_ratio_cap", "> 0 (or null: no cap)"),
        (p.dro_beta >= 0, "dro_beta", ">= 0"),
        (p.gmpo_eps_low >= 0, "gmpo_eps_low", ">= 0"), (p.gmpo_eps_high >= 0, "gmpo_eps_high", ">= 0"),
        (0 <= p.clip_cov_ratio <= 1, "clip_cov_ratio", "in [0, 1]"),
        (p.clip_cov_lb <= p.clip_cov_ub, "clip_cov_lb", f"<= --actor.policy_loss.clip_cov_ub {p.clip_cov_ub}"),
        (0 <= p.kl_cov_ratio <= 1, "kl_cov_ratio", "in [0, 1]"), (p.ppo_kl_coef >= 0, "ppo_kl_coef", ">= 0"),
    ]
    for ok, name, rule in rules:
        if not ok:
            raise ConfigError(f"{flag}{name} must be {rule} (got {getattr(p, name)})")


def validate_policy_loss(cfg) -> None:
    """Start-up refusals (exit 2) of the policy-loss combinations that mean nothing, naming the flag and why."""
    a = cfg.actor
    name = canonical_loss_type(a.policy_loss_type)
    flag = f"--actor.policy_loss_type {a.policy_loss_type}"
    _check_ranges(a.policy_loss)
    est = cfg.algo.advantage.record
    if est.policy_loss is not None and name != "ppo":
        raise ConfigError(f"{flag} cannot be combined with --algo.advantage.estimator {est.name}: that estimator "
                          f"comes with its own loss ({est.policy_loss}); leave --actor.policy_loss_type at ppo")
    if name not in USES_PPO_CLIP:
        defaults = type(a)()
        for field in ("eps_clip", "eps_clip_low_high", "dual_clip"):
            if getattr(a, field) != getattr(defaults, field):
                raise ConfigError(f"--actor.{field} has no meaning with {flag}: {_WHY_NO_CLIP[name]}; "
                                  f"remove --actor.{field}")
    if name in SEQUENCE_LOSSES and a.loss_agg_mode.replace("-", "_") not in ("token_mean", "seq_mean_token_mean"):
        raise ConfigError(f"--actor.loss_agg_mode {a.loss_agg_mode} cannot be used with {flag}: its loss is one value "
                          "per sequence, averaged over sequences (seq-mean-token-mean, which it uses by itself)")
    if name == "gmpo" and est.critic:
        raise ConfigError(f"{flag} cannot be combined with --algo.advantage.estimator {est.name}: GMPO weighs one "
                          "sequence ratio by one sequence advantage, and GAE's advantages differ per token")


def policy_loss_notices(cfg) -> list[str]:
    """One ``has no effect`` line per ``--actor.policy_loss.*`` flag set away from its default that the chosen
    loss does not read."""
    name = canonical_loss_type(cfg.actor.policy_loss_type)
    used = LOSS_PARAMS.get(name, {})
    p, p0 = cfg.actor.policy_loss, PolicyLossParams()
    out = []
    for f in fields(p):
        value = getattr(p, f.name)
        if f.name not in used and value != getattr(p0, f.name):
            owner = next(loss for loss, params in LOSS_PARAMS.items() if f.name in params)
            out.append(f"--actor.policy_loss.{f.name} {value} has no effect with --actor.policy_loss_type "
                       f"{cfg.actor.policy_loss_type} (it is read by --actor.policy_loss_type {owner} only)")
    return out
