"""RL metrics computed from trajectories: held-out evaluation, policy-version lag (async) and the
token check of what was trained against what the engine generated."""

from __future__ import annotations

__all__ = ["eval_metrics", "version_lag", "check_tokens"]


def eval_metrics(trajs, n: int) -> dict[str, float]:
    """``eval/pass1`` (mean score), ``eval/pass{n}`` (best of each prompt's n samples), reward, length and
    truncation, over all prompts and (when records name datasources) per datasource."""
    def mean(xs) -> float:
        xs = list(xs)
        return float(sum(xs) / len(xs)) if xs else 0.0

    by_source: dict[str, list[list]] = {}
    for g in range(len(trajs) // n):
        group = trajs[g * n : (g + 1) * n]
        by_source.setdefault(group[0].datasource or "all", []).append(group)
    out: dict[str, float] = {}

    def summarise(prefix: str, groups) -> None:
        flat = [t for grp in groups for t in grp]
        out[f"{prefix}pass1"] = mean(t.score for t in flat)
        out[f"{prefix}pass{n}"] = mean(max(t.score for t in grp) for grp in groups)
        out[f"{prefix}reward_mean"] = mean(t.reward for t in flat)
        out[f"{prefix}response_length"] = mean(t.response_length for t in flat)
        out[f"{prefix}truncated_frac"] = mean(float(t.truncated) for t in flat)

    summarise("eval/", [grp for groups in by_source.values() for grp in groups])
    if len(by_source) > 1 or "all" not in by_source:
        for source, groups in sorted(by_source.items()):
            summarise(f"eval/{source}/", groups)
    return out


def version_lag(trajs, version: int) -> dict[str, float]:
    """How many weight versions behind the trainer's ``version`` the batch's samples were generated
    (each trajectory's ``policy_version``; buffered oversampled groups and async batches lag); samples
    with no recorded version (-1) are left out."""
    lags = [version - t.policy_version for t in trajs if t.policy_version >= 0]
    if not lags:
        return {}
    ends = [version - t.policy_version_end for t in trajs if t.policy_version_end >= 0]
    return {"rollout/version_lag_mean": sum(lags) / len(lags), "rollout/version_lag_max": float(max(lags)),
            "rollout/version_lag_end_min": float(min(ends)) if ends else float(min(lags)),
            "rollout/policy_version_min": float(version - max(lags))}


def check_tokens(trajs, samples) -> dict[str, float]:
    """``--train.check_tokens``: every trajectory equals what the engine saw and produced, turn by turn,
    and the training rows equal the trajectories (:mod:`rlhforge.agents.token_check`); raises
    ``TokenDriftError`` (exit 3) at the first difference."""
    from rlhforge.agents.token_check import TokenDriftError, check_trajectory, check_training_rows

    turns = 0
    for t in trajs:
        if t.engine_turns is None:
            raise TokenDriftError(f"prompt {t.prompt_index} sample {t.sample_index}: its executor kept no record of "
                                  "the engine's turns, so --train.check_tokens cannot check it")
        turns += check_trajectory(t, t.engine_turns)
    check_training_rows(trajs, [(s.input_ids, s.loss_mask, s.tensors["rollout_logprobs"]) for s in samples])
    return {"rollout/tokens_checked_samples": float(len(trajs)), "rollout/tokens_checked_turns": float(turns)}
