"""Pure tensor maths for RL and preference optimisation (no I/O, no config, no distributed state).

Modules, one family each (formulas and defaults: ``docs/algorithms.md``):

- ``logprobs``: per-token log-probs and entropy from logits (chunked, memory-aware);
- ``kl``: k1/k2/k3 KL estimators, KL loss term, binary KL / TV on the sampled token;
- ``kl_controller``: fixed and adaptive KL coefficient;
- ``advantages``: GAE, returns, group baselines (RLOO, GRPO, Dr. GRPO, ...), whitening;
- ``policy_losses``: PPO (clip-higher, dual clip), GSPO, FlashREINFORCE, entropy bonus;
- ``policy_losses_2026``: CISPO, SAPO, DPPO, DRO, GMPO, Clip-Cov, KL-Cov;
- ``distillation``: on-policy distillation (reverse-KL rewards, forward KL over the teacher's top-k);
- ``value_losses``: clipped / unclipped critic loss;
- ``preference_losses``: reward-model and DPO/cDPO/IPO losses;
- ``unpaired_losses``: KTO and APO-zero on unpaired (desirable/undesirable) examples;
- ``corrections``: rollout-vs-trainer importance-sampling corrections (TIS, IcePop, ...);
- ``shaping``: overlong and stop-properly penalties, running reward normalisation;
- ``filtering``: DAPO dynamic filtering of prompt groups;
- ``aggregation``: loss aggregation with an exact global-normalisation contract.

Variants are chosen by name from flat tables (``ADVANTAGE_ESTIMATORS``, ``KL_ESTIMATORS``,
``POLICY_LOSSES``, ``RM_LOSSES``, ``DPO_LOSSES``, ``IS_CORRECTIONS``, ``AGGREGATIONS``); each
``get_*`` lookup raises ValueError listing the valid names.
"""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    WHITEN_BY_DEFAULT,
    assemble_token_rewards,
    batch_mean_baseline,
    compute_advantages,
    discounted_returns,
    dr_grpo,
    gae,
    get_advantage_estimator,
    group_norm,
    last_action_index,
    reinforce_baseline,
    rloo,
    whiten,
)
from .aggregation import (
    AGGREGATIONS,
    aggregate_loss,
    aggregate_seq_mean_token_mean,
    aggregate_seq_mean_token_sum,
    aggregate_seq_mean_token_sum_norm,
    aggregate_token_mean,
    count_sequences,
    count_tokens,
    get_aggregation,
)
from .corrections import (
    IS_CORRECTIONS,
    flash_reinforce_trust_region,
    get_is_correction,
    icepop,
    is_correction,
    seq_mask_tis,
    tis,
)
from .distillation import (
    DISTILL_MODES,
    distill_metrics,
    forward_kl_topk,
    on_policy_distill_advantages,
    reverse_kl_rewards,
    shifted_gather_logprobs,
    shifted_topk_logprobs,
)
from .filtering import dynamic_filter, expand_group_mask
from .kl import (
    KL_ESTIMATORS,
    binary_kl,
    compute_kl,
    get_kl_estimator,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_loss,
    total_variation,
)
from .kl_controller import AdaptiveKLController, FixedKLController, make_kl_controller
from .logprobs import entropy_from_logits, logprobs_from_logits
from .policy_losses import (
    POLICY_LOSSES,
    entropy_bonus,
    flash_reinforce_loss,
    get_policy_loss,
    gspo_loss,
    ppo_loss,
)
from .policy_losses_2026 import (
    cispo_loss,
    clip_cov_loss,
    clip_cov_selection,
    covariance_scores,
    dppo_loss,
    dro_loss,
    gmpo_loss,
    kl_cov_loss,
    kl_cov_selection,
    sapo_loss,
)
from .preference_losses import (
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
from .unpaired_losses import KTO_LOSS_TYPES, get_kto_loss, kto_kl_estimate, kto_losses, kto_reference_point
from .shaping import RunningMeanStd, overlong_penalty, stop_properly_penalty
from .value_losses import value_loss

__all__ = [
    # advantages
    "ADVANTAGE_ESTIMATORS", "WHITEN_BY_DEFAULT", "assemble_token_rewards",
    "batch_mean_baseline",
    "compute_advantages", "discounted_returns", "dr_grpo", "gae", "get_advantage_estimator",
    "group_norm", "last_action_index", "reinforce_baseline", "rloo", "whiten",
    # aggregation
    "AGGREGATIONS", "aggregate_loss", "aggregate_seq_mean_token_mean", "aggregate_seq_mean_token_sum",
    "aggregate_seq_mean_token_sum_norm", "aggregate_token_mean", "count_sequences", "count_tokens",
    "get_aggregation",
    # corrections
    "IS_CORRECTIONS", "flash_reinforce_trust_region", "get_is_correction", "icepop", "is_correction",
    "seq_mask_tis", "tis",
    # distillation
    "DISTILL_MODES", "distill_metrics", "forward_kl_topk", "on_policy_distill_advantages", "reverse_kl_rewards",
    "shifted_gather_logprobs", "shifted_topk_logprobs",
    # filtering
    "dynamic_filter", "expand_group_mask",
    # kl
    "KL_ESTIMATORS", "binary_kl", "compute_kl", "get_kl_estimator", "kl_k1", "kl_k2", "kl_k3",
    "kl_loss", "total_variation",
    # kl_controller
    "AdaptiveKLController", "FixedKLController", "make_kl_controller",
    # logprobs
    "entropy_from_logits", "logprobs_from_logits",
    # policy_losses
    "POLICY_LOSSES", "entropy_bonus", "flash_reinforce_loss", "get_policy_loss", "gspo_loss", "ppo_loss",
    # policy_losses_2026
    "cispo_loss", "clip_cov_loss", "clip_cov_selection", "covariance_scores", "dppo_loss", "dro_loss", "gmpo_loss",
    "kl_cov_loss", "kl_cov_selection", "sapo_loss",
    # preference_losses
    "DPO_LOSSES", "PREFERENCE_LOSSES", "RM_LOSSES", "cdpo_loss", "chosen_nll_loss", "dpo_sigmoid_loss",
    "get_dpo_loss", "get_rm_loss", "implicit_rewards", "ipo_loss", "preference_accuracy",
    "rm_logexp_loss", "rm_sigmoid_loss", "sequence_logps",
    # unpaired_losses
    "KTO_LOSS_TYPES", "get_kto_loss", "kto_kl_estimate", "kto_losses", "kto_reference_point",
    # shaping
    "RunningMeanStd", "overlong_penalty", "stop_properly_penalty",
    # value_losses
    "value_loss",
]
