"""The ``GenerationEngine`` seam: token ids in, token ids + log-probs + finish reason out.

Every engine (HF ``transformers`` in ``hf_engine.py``; vLLM in ``vllm_engine.py``) implements::

    async generate(prompts: list[list[int]], params: list[SamplingParams]) -> list[GenerationOutput]
    update_weights(named_tensors)   # load the trainer's full state dict (weight sync)
    sleep() / wake_up()             # release / regain memory between phases (no-ops where unsupported)

Token ids are never decoded and re-encoded here. Each request carries its own ``seed``: the same
prompt, parameters, seed and weights give the same tokens whatever else is in the batch, which is
what makes an RL run resumable exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol, Sequence

import torch

__all__ = ["SamplingParams", "GenerationOutput", "GenerationEngine"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request."""

    max_new_tokens: int
    """Longest response in tokens (a response that reaches it without a stop token is truncated)."""
    temperature: float = 1.0
    """0 means greedy. Log-probs are those of ``softmax(logits / temperature)`` (1 when greedy)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens with cumulative probability >= top_p."""
    top_k: int = -1
    """Keep the k most likely tokens (-1: all)."""
    stop_token_ids: tuple[int, ...] = ()
    """Stop after generating any of these (kept in the output). The engine adds the eos token."""
    seed: int | None = None
    """Seed of this request's sampler (None: the global torch RNG)."""


@dataclass
class GenerationOutput:
    """One response."""

    token_ids: list[int]
    """Generated ids (the stop token included when one was produced)."""
    logprobs: list[float]
    """Log-prob of each generated token under the sampling distribution (after temperature, before
    top-p/top-k filtering), one per token."""
    finish_reason: str
    """``"stop"`` (a stop token was generated) or ``"length"`` (max_new_tokens reached)."""
    extra: dict = field(default_factory=dict)


def params_per_prompt(prompts: Sequence, params, vision: Sequence | None = None) -> list[SamplingParams]:
    """``generate``'s arguments checked the same way by every engine: one :class:`SamplingParams` for all
    prompts becomes one per prompt; a list of params (or of image entries) must have one per prompt."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
    if vision is not None and len(vision) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(vision)} image entries")
    return list(params)


class GenerationEngine(Protocol):
    async def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]) -> list[GenerationOutput]:
        """One output per prompt, in order."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]) -> None:
        """Load new weights (names as in the trainer's full state dict)."""

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...
