"""Multi-turn token checker: what is trained on is exactly what the engine saw and produced.

Every generation call of an episode is recorded as an :class:`EngineTurn` when
``--train.check_tokens`` is on (every executor; tests that check turns turn it on): the token ids
the engine was given, the ids it produced (what the episode kept) and their log-probs.
:func:`check_trajectory` then proves, turn by turn, for any chat template and environment:

- the engine's input for turn *k* is exactly the trajectory's tokens before action span *k*
  (no re-tokenisation drift: feedback is appended as tokens, never by decoding the conversation
  and encoding it again, which merges or splits tokens at turn boundaries);
- action span *k* is exactly the engine's output for turn *k* (the last one may be cut where the
  sequence ends at the length budget), and its rollout log-probs are the engine's, one per token;
- every other token (the prompt, environment feedback, chat-template glue) is outside the action
  spans, so its action mask is 0: feedback is never trained on.

:func:`check_training_rows` closes the loop on the trainer's side: the rows handed to the
workers (token ids, action mask, rollout log-probs per position) equal the trajectories.

A failure is a :class:`TokenDriftError` naming the sample, the turn, the first differing position
and the ids on both sides; ``rlhforge rl`` stops with exit code 3.
"""

from __future__ import annotations

import struct
from typing import Sequence

from rlhforge.agents.types import AgentError, EngineTurn, Trajectory

__all__ = ["EngineTurn", "TokenDriftError", "check_trajectory", "check_training_rows", "first_difference"]


class TokenDriftError(AgentError):
    """The tokens trained on differ from the tokens the engine saw or produced."""


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where ``a`` and ``b`` differ (the shorter length when one is a prefix of the
    other), or None when they are equal."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return None if len(a) == len(b) else n


def _at(ids: Sequence[int], i: int) -> str:
    return str(ids[i]) if i < len(ids) else "<end>"


def _f32(x) -> float:
    return struct.unpack("f", struct.pack("f", float(x)))[0]


def _name(traj: Trajectory) -> str:
    return f"prompt {traj.prompt_index} sample {traj.sample_index}"


def check_trajectory(traj: Trajectory, turns: Sequence[EngineTurn]) -> int:
    """Raise :class:`TokenDriftError` unless ``traj`` is exactly what ``turns`` generated (module
    docstring). Turns that produced nothing have no span. Returns the number of turns checked."""
    who = _name(traj)
    ids = traj.token_ids
    made = [t for t in turns if t.produced]
    spans = list(traj.action_ranges)
    if len(made) != len(spans):
        raise TokenDriftError(f"{who}: {len(spans)} action spans are trained on but the engine produced "
                              f"{len(made)} non-empty turns")
    prev_end = traj.prompt_len
    offset = 0
    for k, ((s, e), turn) in enumerate(zip(spans, made)):
        if not prev_end <= s < e <= len(ids):
            raise TokenDriftError(f"{who} turn {k}: action span {(s, e)} is out of order or outside the sequence "
                                  f"(previous end {prev_end}, prompt {traj.prompt_len}, length {len(ids)})")
        d = first_difference(turn.seen, ids[:s])
        if d is not None:
            raise TokenDriftError(
                f"{who} turn {k}: the engine saw {len(turn.seen)} tokens but {s} precede this action in the trained "
                f"sequence; first difference at position {d}: engine saw {_at(turn.seen, d)}, trained on "
                f"{_at(ids, d)} (re-tokenised conversation or edited history?)")
        produced = turn.produced
        if k == len(spans) - 1 and e == len(ids) and len(produced) > e - s:
            produced = produced[: e - s]  # the sequence was cut to the length budget after the last turn
        d = first_difference(produced, ids[s:e])
        if d is not None:
            raise TokenDriftError(
                f"{who} turn {k}: the action span {(s, e)} is not the engine's output ({len(turn.produced)} tokens); "
                f"first difference at action token {d}: engine produced {_at(turn.produced, d)}, trained on "
                f"{_at(ids[s:e], d)}")
        lps = [float(x) for x in traj.rollout_logprobs[offset : offset + e - s]]
        want = [float(x) for x in turn.logprobs[: e - s]]
        if lps != want:
            d = next((i for i, (a, b) in enumerate(zip(lps, want)) if a != b), min(len(lps), len(want)))
            raise TokenDriftError(f"{who} turn {k}: rollout log-prob {d} of the span is "
                                  f"{lps[d] if d < len(lps) else '<missing>'}, the engine's "
                                  f"{want[d] if d < len(want) else '<missing>'}")
        offset += e - s
        prev_end = e
    if offset != len(traj.rollout_logprobs):
        raise TokenDriftError(f"{who}: {len(traj.rollout_logprobs)} rollout log-probs for {offset} action tokens")
    return len(made)


def check_training_rows(trajs: Sequence[Trajectory], rows: Sequence[tuple]) -> None:
    """``rows[i] = (input_ids, action_mask, rollout_logprobs)`` as the trainer hands them to the
    workers (lists or 1-D tensors): equal to ``trajs[i]``'s tokens, action mask and log-probs at
    the action positions."""
    if len(rows) != len(trajs):
        raise TokenDriftError(f"{len(rows)} training rows for {len(trajs)} trajectories")
    for traj, (input_ids, mask, rollout) in zip(trajs, rows):
        who = _name(traj)
        input_ids = [int(x) for x in input_ids]
        d = first_difference(input_ids, traj.token_ids)
        if d is not None:
            raise TokenDriftError(f"{who}: training row differs from the trajectory at position {d} "
                                  f"({_at(input_ids, d)} vs {_at(traj.token_ids, d)})")
        want = traj.action_mask()
        mask = [int(x) for x in mask]
        d = first_difference(mask, want)
        if d is not None:
            raise TokenDriftError(f"{who}: training action mask is {_at(mask, d)} at position {d}, the trajectory's "
                                  f"{_at(want, d)} (feedback trained on, or an action dropped)")
        got = [_f32(rollout[i]) for i, m in enumerate(want) if m]  # the rows hold float32
        exp = [_f32(x) for x in traj.rollout_logprobs]
        if got != exp:
            i = next(i for i, (a, b) in enumerate(zip(got, exp)) if a != b) if len(got) == len(exp) else len(got)
            raise TokenDriftError(f"{who}: rollout log-prob of action token {i} moved between the trajectory and "
                                  f"the training row")
