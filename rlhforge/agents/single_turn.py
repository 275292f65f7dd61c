"""Single-turn agent executor: prompt ids in, scored :class:`Trajectory` out (token-in-token-out).

``execute`` generates one response with the engine; ``execute_batch`` generates a whole batch in
one engine call and scores it with one reward call (reward functions and servers are batched).
Texts are decoded only to show them to the reward source; training uses the engine's token ids
and log-probs unchanged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

from rlhforge.agents.types import EngineTurn, Trajectory
from rlhforge.rewards.base import RewardBatch, call_source
from rlhforge.rollout.engine import SamplingParams

__all__ = ["PromptRequest", "SingleTurnExecutor"]


@dataclass
class PromptRequest:
    prompt_ids: list[int]
    label: Any = None
    datasource: str | None = None
    prompt_index: int = -1
    sample_index: int = 0
    raw_prompt: Any = None
    """The record's prompt field as given (text or chat messages), for agents that build their own
    conversation (OpenAI-client agents)."""
    vision: Any = None
    """The prompt's images (``data.images.VisionInput``) for a vision-language actor; None: text only."""


class SingleTurnExecutor:
    def __init__(self, tokenizer, reward_source, *, check_tokens: bool = False):
        self.tokenizer, self.reward_source = tokenizer, reward_source
        # --train.check_tokens: record each generation call (Trajectory.engine_turns) for the token
        # checker (agents.token_check); off, engine_turns stays None, as with the other executors
        self.check_tokens = check_tokens
        self.reward_seconds = 0.0  # time in score(), summed over calls (the RL step's timing/reward)

    async def execute(self, request: PromptRequest, sampling: SamplingParams, engine) -> Trajectory:
        return (await self.execute_batch([request], [sampling], engine))[0]

    async def generate(self, requests: Sequence[PromptRequest], sampling: Sequence[SamplingParams], engine
                       ) -> list[Trajectory]:
        visions = [r.vision for r in requests]
        if any(v is not None for v in visions):  # images: the engine gets each prompt's pixels
            outs = await engine.generate([r.prompt_ids for r in requests], list(sampling), vision=visions)
        else:
            outs = await engine.generate([r.prompt_ids for r in requests], list(sampling))
        trajs = []
        for req, out in zip(requests, outs):
            n_prompt = len(req.prompt_ids)
            trajs.append(Trajectory(
                token_ids=list(req.prompt_ids) + list(out.token_ids), prompt_len=n_prompt,
                action_ranges=[(n_prompt, n_prompt + len(out.token_ids))] if out.token_ids else [],
                rollout_logprobs=list(out.logprobs), finish_reason=out.finish_reason, label=req.label,
                datasource=req.datasource, prompt_index=req.prompt_index, sample_index=req.sample_index,
                routed_experts=out.extra.get("routed_experts"), vision=req.vision,
                engine_turns=[EngineTurn(tuple(req.prompt_ids), tuple(out.token_ids), tuple(out.logprobs))]
                if self.check_tokens else None,
            ))
        return trajs

    async def score(self, trajs: list[Trajectory]) -> None:
        """Fill ``reward``, ``score`` and ``extra`` of ``trajs`` with one call of the reward source."""
        tok = self.tokenizer
        prompts = tok.batch_decode([t.prompt_ids for t in trajs], skip_special_tokens=False)
        responses = tok.batch_decode([t.response_ids for t in trajs], skip_special_tokens=True)
        full = tok.batch_decode([t.response_ids for t in trajs], skip_special_tokens=False)
        batch = RewardBatch(
            queries=[p + r for p, r in zip(prompts, full)], prompts=prompts, responses=responses,
            labels=[t.label for t in trajs], datasources=[t.datasource for t in trajs],
            prompt_ids=[t.prompt_ids for t in trajs], response_ids=[t.response_ids for t in trajs],
            finish_reasons=[t.finish_reason for t in trajs],
        )
        out = await call_source(self.reward_source, batch)
        for i, t in enumerate(trajs):
            t.reward, t.score = out.rewards[i], out.scores[i]
            t.extra = {k: v[i] for k, v in out.extra_logs.items()}

    async def execute_batch(self, requests: Sequence[PromptRequest], sampling: Sequence[SamplingParams], engine
                            ) -> list[Trajectory]:
        trajs = await self.generate(requests, sampling, engine)
        if trajs:
            t = time.perf_counter()
            await self.score(trajs)
            self.reward_seconds += time.perf_counter() - t
        return trajs
