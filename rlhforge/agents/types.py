"""The records of an episode: the ``Trajectory`` an agent executor hands the experience maker (token ids,
never text) and the ``EngineTurn``s it was generated in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Trajectory", "AgentError", "EngineTurn"]


@dataclass(frozen=True)
class EngineTurn:
    """One generation call of an episode: the engine's input, its kept output and log-probs (checked
    against the trained tokens by :mod:`rlhforge.agents.token_check`)."""

    seen: tuple[int, ...]
    produced: tuple[int, ...]
    logprobs: tuple[float, ...]


@dataclass
class Trajectory:
    """One sampled episode.

    ``token_ids`` is the whole sequence (prompt, then every generated or environment token, in
    order). ``action_ranges`` are half-open ``(start, end)`` spans of ``token_ids`` the model
    generated (trained on); environment feedback between them is not. ``rollout_logprobs`` holds
    the engine's log-prob of every action token, in order (``sum(end - start)`` values).
    """

    token_ids: list[int]
    prompt_len: int
    action_ranges: list[tuple[int, int]]
    rollout_logprobs: list[float]
    finish_reason: str
    """``stop`` or ``length`` (of the last generation)."""
    label: Any = None
    datasource: str | None = None
    prompt_index: int = -1
    """Index of the prompt record in its dataset."""
    sample_index: int = 0
    """Which of the prompt's ``n_samples_per_prompt`` samples this is."""
    reward: float | None = None
    """Scalar reward (set by the reward source, before shaping)."""
    score: float | None = None
    """0-1 score for filtering and pass@k (kept apart from the reward)."""
    extra: dict[str, float] = field(default_factory=dict)
    """Extra per-sample metrics (reward ``extra_logs``, environment info)."""
    drop_reason: str | None = None
    """Set when the sample must not be trained on: ``env_error`` (its environment failed),
    ``exp_filter`` (a registry per-experience filter rejected its group), ``reward_failed``; the
    trainer drops the whole prompt group (:func:`rlhforge.agents.episode.drop_failed_groups`)."""
    error: str | None = None
    """What went wrong (with ``drop_reason="env_error"``)."""
    routed_experts: Any = None
    """MoE routing replay: the experts the engine chose for each token, an int tensor ``[len(token_ids),
    MoE layers, top_k]`` (-1: no record), or None (:mod:`rlhforge.models.routing`)."""
    vision: Any = None
    """A vision-language actor: every image of ``token_ids`` in the order of its image tokens (the prompt's,
    then environment feedback's), as a ``data.images.VisionInput``; None: text only."""
    policy_version: int = -1
    """The weights version (RL steps synced into the engines) that generated it; -1: unknown. With
    ``--train.partial_rollout_enable`` a response may end under a later one: ``policy_version_end``."""
    policy_version_end: int = -1
    engine_turns: list | None = None
    """``--train.check_tokens``: every generation call of the episode (:class:`EngineTurn`:
    the ids the engine saw, the ids it produced, their log-probs), for :func:`check_trajectory`."""

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def response_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[: self.prompt_len]

    @property
    def response_length(self) -> int:
        return sum(e - s for s, e in self.action_ranges)

    def action_mask(self) -> list[int]:
        """1 at every action token of ``token_ids``."""
        mask = [0] * len(self.token_ids)
        for s, e in self.action_ranges:
            mask[s:e] = [1] * (e - s)
        return mask


class AgentError(RuntimeError):
    """An environment or agent failed (raised, hung, returned something unusable); names the sample."""
