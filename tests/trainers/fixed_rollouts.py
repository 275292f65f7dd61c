"""Fixed RL rollouts for trainer tests: trajectories built from token ids chosen here (no generation),
so a test knows every token and reward a step trained on."""

from __future__ import annotations

import torch

from rlhforge.agents.types import Trajectory
from rlhforge.trainers.rl.rollouts import RolloutBatch

N = 4
"""Samples per prompt: 2 prompts x 4 = 8 trajectories (``--rollout.batch_size 2 --rollout.n_samples_per_prompt 4``)."""
REWARDS = [1.0, 0.0, 0.5, 0.25, 0.0, 0.75, 1.0, 0.1]
LENGTHS = [3, 6, 4, 5, 2, 6, 5, 3]
"""Response lengths (all <= ``--rollout.max_new_tokens 6``): uneven, so micro-batches and ranks hold
different token counts."""


def fixed_trajectories(trainer, seed: int) -> list[Trajectory]:
    """8 trajectories: prompts 0 and 1 of the trainer's prompt set, N responses each of random
    (seeded) non-special token ids; two of three end with EOS ("stop"), the others are "length"."""
    g = torch.Generator().manual_seed(seed)
    eos, vocab = trainer.tokenizer.eos_token_id, len(trainer.tokenizer)
    out = []
    for i, (length, reward) in enumerate(zip(LENGTHS, REWARDS)):
        prompt = trainer.prompts[i // N]
        resp = torch.randint(4, vocab, (length,), generator=g).tolist()  # ids 0-3 are the special tokens
        stop = i % 3 != 0
        if stop:
            resp[-1] = eos
        ids = list(prompt.ids) + resp
        out.append(Trajectory(token_ids=ids, prompt_len=len(prompt.ids), action_ranges=[(len(prompt.ids), len(ids))],
                              rollout_logprobs=[-1.0] * length,  # only read by IS corrections (off here)
                              finish_reason="stop" if stop else "length", label=prompt.label, prompt_index=prompt.index,
                              sample_index=i % N, reward=reward, score=reward))
    return out


def rollout_batch(trajs, step: int) -> RolloutBatch:
    """What the rollout source hands ``RLTrainer.step`` for RL step ``step`` (0-based)."""
    return RolloutBatch(index=step, trajs=trajs, metrics={}, stream_position=0, version_start=step, version_end=step,
                        generation_s=0.0)
