"""On-policy distillation's flags: ``--teacher.*`` (the teacher model group, placed like the reference) and
``--algo.distill.*`` (the mode and its coefficients), with their start-up rules (exit 2 naming the flag).
The maths is :mod:`rlhforge.algorithms.distillation`; docs/algorithms.md, "On-policy distillation"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlhforge.config.parsing import ConfigError

__all__ = ["TeacherConfig", "DistillConfig", "DistillMode", "DISTILL_MODE_ALIASES", "distill_mode",
           "validate_distill", "distill_notices"]

#: ``--algo.distill.mode`` values: ours, then other frameworks' names (veRL's ``distillation_loss.loss_mode``)
DistillMode = Literal["reverse_kl", "forward_kl_topk", "k1"]
DISTILL_MODE_ALIASES = {"k1": "reverse_kl"}


@dataclass(frozen=True)
class TeacherConfig:
    """The frozen teacher of on-policy distillation (``--algo.advantage.estimator on_policy_distill``): its own
    model group, built, placed and colocated like the reference model (``--train.colocate_actor_ref`` puts it
    on the actor's bundles too). It must use the student's tokenizer (the same token-to-id map)."""

    model_name_or_path: str | None = None
    """HF hub id or local folder of the teacher (``from_pretrained``)."""
    num_nodes: int = 1
    """Nodes of the teacher's Ray worker group."""
    num_gpus_per_node: int = 1
    """Teacher workers per node (replicas; each scores its shard)."""
    offload: bool = False
    """Keep the teacher in host memory between uses (ZeRO-3: DeepSpeed's ``offload_param``)."""


@dataclass(frozen=True)
class DistillConfig:
    """How the teacher's scores train the student (``--algo.distill.*``)."""

    mode: DistillMode = "reverse_kl"
    """``reverse_kl`` (alias ``k1``): per-token reward ``-(log pi_student - log pi_teacher)`` of the sampled
    token, fed to the policy loss as an advantage (Tinker cookbook, veRL k1, prime-rl ``opd``);
    ``forward_kl_topk``: a loss term, the forward KL over the teacher's top-k tokens per position (veRL
    ``forward_kl_topk``, TRL GKD with beta 0)."""
    coef: float = 1.0
    """Weight of the distillation term: the reverse-KL reward's coefficient, or the forward-KL loss's (Tinker's
    ``kl_penalty_coef``: 1.0)."""
    env_reward_coef: float = 0.0
    """Weight of the environment's reward (group-centred when ``rollout.n_samples_per_prompt > 1``) added to
    the advantage; 0: pure distillation (the reward is still logged)."""
    discount: float = 0.0
    """``reverse_kl``: each token's advantage sums the rewards of the tokens after it, discounted by this per
    token (0: its own reward only; Tinker's ``kl_discount_factor``)."""
    topk: int = 32
    """``forward_kl_topk``: teacher tokens per position (veRL ``distillation_loss.topk``: 32)."""


def distill_mode(cfg) -> str:
    """``--algo.distill.mode`` with its aliases resolved."""
    mode = cfg.algo.distill.mode
    return DISTILL_MODE_ALIASES.get(mode, mode)


def distill_topk_coef(cfg) -> float:
    """The actor's forward-KL loss weight (:attr:`rlhforge.workers.losses.PolicyLossSpec.distill_topk_coef`)."""
    return float(cfg.algo.distill.coef) if cfg.uses_teacher and distill_mode(cfg) == "forward_kl_topk" else 0.0


def validate_distill(cfg) -> None:
    """The teacher and the estimator come together; coefficients in range; what the top-k mode cannot do."""
    d, teacher, est = cfg.algo.distill, cfg.teacher.model_name_or_path, cfg.algo.advantage.estimator
    opd = cfg.algo.advantage.record.teacher
    if opd and not teacher:
        raise ConfigError(f"--algo.advantage.estimator {est} needs --teacher.model_name_or_path (the teacher that "
                          "scores the student's samples; it must share the student's tokenizer)")
    if teacher and not opd:
        raise ConfigError(f"--teacher.model_name_or_path {teacher} is read by on-policy distillation only: add "
                          f"--algo.advantage.estimator on_policy_distill (got {est})")
    if not opd:
        return
    for name in ("num_nodes", "num_gpus_per_node"):
        if getattr(cfg.teacher, name) < 1:
            raise ConfigError(f"--teacher.{name} must be >= 1 (got {getattr(cfg.teacher, name)})")
    if d.coef < 0 or d.env_reward_coef < 0:
        raise ConfigError(f"--algo.distill.coef and --algo.distill.env_reward_coef must be >= 0 (got {d.coef} and "
                          f"{d.env_reward_coef})")
    if d.coef == 0 and d.env_reward_coef == 0:
        raise ConfigError("--algo.distill.coef 0 and --algo.distill.env_reward_coef 0 leave nothing to learn from; "
                          "set one above 0")
    if not 0.0 <= d.discount <= 1.0:
        raise ConfigError(f"--algo.distill.discount must be in [0, 1] (got {d.discount})")
    if d.topk < 1:
        raise ConfigError(f"--algo.distill.topk must be >= 1 (got {d.topk})")
    if distill_mode(cfg) == "forward_kl_topk" and cfg.ds.ring_attn_size > 1:
        raise ConfigError(f"--algo.distill.mode forward_kl_topk with --ds.ring_attn_size {cfg.ds.ring_attn_size}: "
                          "the top-k term needs the student's logits of whole sequences, which a ring rank does not "
                          "hold; use --algo.distill.mode reverse_kl or no ring attention")


def distill_notices(cfg) -> list[str]:
    """Flags of on-policy distillation that mean nothing in this run (one line each)."""
    d, d0, t, t0 = cfg.algo.distill, DistillConfig(), cfg.teacher, TeacherConfig()
    if not cfg.algo.advantage.record.teacher:
        changed = [(f"--algo.distill.{n}", getattr(d, n)) for n in ("mode", "coef", "env_reward_coef", "discount", "topk")
                   if getattr(d, n) != getattr(d0, n)]
        changed += [(f"--teacher.{n}", getattr(t, n)) for n in ("num_nodes", "num_gpus_per_node", "offload")
                    if getattr(t, n) != getattr(t0, n)]
        return [f"{flag}{'' if isinstance(v, bool) else f' {v}'} has no effect without --algo.advantage.estimator "
                "on_policy_distill" for flag, v in changed]
    out = []
    mode = distill_mode(cfg)
    if mode == "reverse_kl" and d.topk != d0.topk:
        out.append(f"--algo.distill.topk {d.topk} has no effect with --algo.distill.mode {d.mode} (forward_kl_topk "
                   "reads it)")
    if mode == "forward_kl_topk" and d.discount != d0.discount:
        out.append(f"--algo.distill.discount {d.discount} has no effect with --algo.distill.mode forward_kl_topk (a "
                   "loss term per token, not a reward)")
    return out
