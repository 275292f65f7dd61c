"""OpenRLHF's executor interface over rlhforge's episodes: a custom ``AgentExecutor`` whose
``async execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine)`` returns
OpenRLHF's dict runs unchanged.

rlhforge calls that ``execute`` once per sample with

- ``prompt``: the prompt text (chat template applied, special tokens kept), ``label`` its label;
- ``sampling_params``: a :class:`VLLMSamplingParams` (vLLM's field names: ``max_tokens``,
  ``temperature``, ``top_p``, ``top_k``, ``stop_token_ids``, ``logprobs=1``, ``seed``); mutable and
  deep-copyable, as the vLLM object is;
- ``max_length``: prompt length + ``--rollout.max_new_tokens`` (at most ``--data.max_len``);
- ``hf_tokenizer``: the policy's HF tokenizer;
- ``llm_engine``: an :class:`OpenRLHFEngine` whose ``await generate(token_ids, sampling_params)``
  returns a vLLM-shaped :class:`RequestOutput` (``.outputs[0].token_ids``, ``.text``,
  ``.logprobs`` as ``[{token_id: Logprob}]``, ``.finish_reason``). Requests of concurrent samples
  are batched into one engine call, and each sample's n-th request gets a seed derived from the
  sample's seed.

The returned dict (OpenRLHF's keys) becomes the :class:`Trajectory`: ``observation_tokens`` (all
token ids), ``action_ranges`` (``[start, end)`` spans the model generated; the prompt is
everything before the first one), ``rollout_log_probs`` (aligned with ``observation_tokens``, or
None: rlhforge takes the engine's own log-prob for every action token it generated anyway),
``reward`` and ``scores`` (numbers or one-element tensors; ``reward=None`` needs a
``--reward.*`` source to score the text), ``extra_logs``, and optionally ``truncated`` (else: the
last generation stopped on the length limit). A sequence longer than ``max_length`` is cut to it
(and truncated). Images (``multi_modal_data``) are not supported.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from typing import Any

from rlhforge.agents.episode import AgentError, Episode, EpisodeContext, turn_seed
from rlhforge.agents.single_turn import PromptRequest
from rlhforge.agents.types import EngineTurn, Trajectory
from rlhforge.rollout.engine import SamplingParams

__all__ = ["VLLMSamplingParams", "Logprob", "CompletionOutput", "RequestOutput", "OpenRLHFEngine",
           "user_execute", "run_openrlhf_execute", "trajectory_from_result", "trajectory_to_result"]


@dataclass
class VLLMSamplingParams:
    """Sampling parameters under vLLM's names (what OpenRLHF's ``execute`` and ``step`` receive)."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = 1
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    """Stop strings are not supported (use ``stop_token_ids``); a non-empty list is refused."""
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @classmethod
    def from_rlhforge(cls, sp: SamplingParams) -> "VLLMSamplingParams":
        return cls(max_tokens=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k,
                   stop_token_ids=list(sp.stop_token_ids), seed=sp.seed)

    def clone(self) -> "VLLMSamplingParams":
        return replace(self, stop_token_ids=list(self.stop_token_ids), stop=list(self.stop))


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str
    stop_reason: Any = None

    def finished(self) -> bool:
        return True


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt_logprobs: Any = None


def to_rlhforge_sampling(params: Any, base: SamplingParams) -> SamplingParams:
    """``params`` (a :class:`VLLMSamplingParams`, a vLLM ``SamplingParams``, a dict or rlhforge's
    :class:`SamplingParams`; None: ``base``) as rlhforge's parameters. ``max_tokens=None`` keeps
    ``base``'s limit; the seed is ``base``'s."""
    from rlhforge.agents.values import merge_sampling

    if params is None:
        return base
    if not isinstance(params, (dict, SamplingParams)):
        if getattr(params, "n", 1) not in (1, None):
            raise AgentError(f"llm_engine.generate: n={params.n} is not supported (one completion per call)")
        if getattr(params, "stop", None):
            raise AgentError(f"llm_engine.generate: stop strings {params.stop!r} are not supported; use stop_token_ids")
    return merge_sampling(base, params)


class OpenRLHFEngine:
    """The ``llm_engine`` an OpenRLHF ``execute`` gets: vLLM's ``generate`` over rlhforge's
    batching engine, recording every call (prompt ids, token ids, log-probs, finish reason)."""

    def __init__(self, ctx: EpisodeContext, request: PromptRequest, sampling: SamplingParams, max_length: int):
        self.ctx, self.request, self.sampling, self.max_length = ctx, request, sampling, max_length
        self.calls: list[tuple[list[int], list[int], list[float], str]] = []

    async def generate(self, prompt, sampling_params=None, multi_modal_data=None, **kwargs) -> RequestOutput:
        if multi_modal_data:
            raise AgentError("llm_engine.generate: multi_modal_data (images) is not supported")
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise AgentError(f"llm_engine.generate: a dict prompt needs 'prompt_token_ids' (got {sorted(prompt)})")
            prompt = prompt["prompt_token_ids"]
        if isinstance(prompt, str) or not hasattr(prompt, "__iter__"):
            raise AgentError("llm_engine.generate takes token ids (token-in-token-out), not "
                             f"{type(prompt).__name__}; tokenise with hf_tokenizer(text, add_special_tokens=False)")
        ids = [int(i) for i in (prompt.tolist() if hasattr(prompt, "tolist") else prompt)]
        sp = to_rlhforge_sampling(sampling_params, self.sampling)
        room = self.max_length - len(ids)
        n = len(self.calls)
        if room <= 0:
            tokens, logprobs, finish = [], [], "length"
        else:
            sp = replace(sp, max_new_tokens=max(1, min(sp.max_new_tokens, room)), seed=turn_seed(self.sampling.seed, n))
            out = await self.ctx.engine.generate_one(ids, sp)
            tokens, logprobs, finish = list(out.token_ids), [float(x) for x in out.logprobs], out.finish_reason
            if len(tokens) != len(logprobs):
                raise AgentError(f"engine returned {len(tokens)} tokens but {len(logprobs)} log-probs")
        self.calls.append((ids, tokens, logprobs, finish))
        text = self.ctx.decode(tokens, skip_special_tokens=getattr(sampling_params, "skip_special_tokens", True))
        return RequestOutput(
            request_id=f"{self.request.prompt_index}-{self.request.sample_index}-{n}", prompt=None,
            prompt_token_ids=ids,
            outputs=[CompletionOutput(index=0, text=text, token_ids=tokens, cumulative_logprob=sum(logprobs),
                                      logprobs=[{t: Logprob(lp, 1)} for t, lp in zip(tokens, logprobs)],
                                      finish_reason=finish)])


def user_execute(executor, *own: type) -> bool:
    """Whether ``executor``'s class defines its own (OpenRLHF-shaped) ``execute``, i.e. one that is
    not rlhforge's (:class:`EpisodeExecutor`'s or one of the ``own`` base classes')."""
    from rlhforge.agents.episode import EpisodeExecutor

    for klass in type(executor).__mro__:
        if "execute" in vars(klass):
            return klass not in (EpisodeExecutor, *own)
    return False


def _max_length(ep: Episode, ctx: EpisodeContext) -> int:
    n = len(ep.request.prompt_ids) + ep.sampling.max_new_tokens
    return n if ctx.settings.max_len is None else min(n, ctx.settings.max_len)


async def run_openrlhf_execute(executor, ep: Episode, ctx: EpisodeContext) -> Trajectory:
    """One sample through the user's OpenRLHF-shaped ``execute``."""
    req = ep.request
    max_length = _max_length(ep, ctx)
    engine = OpenRLHFEngine(ctx, req, ep.sampling, max_length)
    prompt_text = ctx.decode(req.prompt_ids)
    result = executor.execute(prompt_text, req.label, VLLMSamplingParams.from_rlhforge(ep.sampling), max_length,
                              ctx.tokenizer, engine)
    if not inspect.isawaitable(result):
        raise AgentError("AgentExecutor.execute must be an async def (OpenRLHF's signature)")
    res = await result
    traj = trajectory_from_result(res, req, engine, max_length, needs_reward=executor.reward_source is None)
    if ctx.settings.check_tokens:  # what the engine really saw and produced, for agents.token_check
        traj.engine_turns = [EngineTurn(tuple(ids), tuple(out), tuple(lps)) for ids, out, lps, _ in engine.calls]
    return traj


def trajectory_from_result(res: Any, req: PromptRequest, engine: OpenRLHFEngine, max_length: int, *,
                           needs_reward: bool = True) -> Trajectory:
    """The :class:`Trajectory` of OpenRLHF's executor result dict (see the module docstring)."""
    from rlhforge.agents.values import _float_logs, to_float

    if not isinstance(res, dict):
        raise AgentError(f"execute returned {type(res).__name__}; expected OpenRLHF's dict with "
                         "'observation_tokens', 'action_ranges', 'reward', ...")
    missing = [k for k in ("observation_tokens", "action_ranges") if k not in res]
    if missing:
        raise AgentError(f"execute returned a dict without {missing} (keys: {sorted(res)})")
    obs = res["observation_tokens"]
    tokens = [int(t) for t in (obs.tolist() if hasattr(obs, "tolist") else obs)]
    ranges: list[tuple[int, int]] = []
    for r in res["action_ranges"] or []:
        try:
            s, e = (int(x) for x in r)
        except (TypeError, ValueError):
            raise AgentError(f"execute returned action range {r!r}; expected (start, end)") from None
        if not (0 <= s <= e <= len(tokens)) or (ranges and s < ranges[-1][1]):
            raise AgentError(f"execute returned action range {(s, e)} outside observation_tokens "
                             f"(length {len(tokens)}) or overlapping/out of order (ranges {res['action_ranges']})")
        if e > s:
            ranges.append((s, e))
    cut = len(tokens) > max_length
    if cut:  # OpenRLHF cuts to max_len afterwards
        tokens = tokens[:max_length]
        ranges = [(s, min(e, max_length)) for s, e in ranges if s < max_length]
    # log-prob of every action token: the engine's (recorded by position), else the returned ones
    by_pos: dict[int, float] = {}
    for ids, out, lps, _ in engine.calls:
        if tokens[: len(ids)] != ids:
            continue
        for j, (t, lp) in enumerate(zip(out, lps)):
            p = len(ids) + j
            if p >= len(tokens) or tokens[p] != t:
                break
            by_pos[p] = lp
    given = res.get("rollout_log_probs")
    if given is not None and hasattr(given, "tolist"):
        given = given.tolist()
    logprobs: list[float] = []
    for s, e in ranges:
        for p in range(s, e):
            if p in by_pos:
                logprobs.append(by_pos[p])
            elif given is not None and p < len(given) and given[p] is not None:
                logprobs.append(float(given[p]))
            else:
                raise AgentError(f"action token {p} (range {(s, e)}) was not generated by llm_engine and execute "
                                 "returned no rollout_log_probs for it")
    prompt_len = ranges[0][0] if ranges else len(tokens)
    last_finish = engine.calls[-1][3] if engine.calls else "stop"
    truncated = bool(res["truncated"]) if res.get("truncated") is not None else last_finish == "length"
    reward = res.get("reward", res.get("rewards"))
    if reward is None and needs_reward:
        raise AgentError("execute returned reward None and no --reward.remote_url / --reward.model_name_or_path "
                         "is set to score it; return a reward")
    reward = None if reward is None else to_float(reward, "execute reward")
    scores = res.get("scores")
    score = to_float(scores, "execute scores") if scores is not None else reward
    action_tokens = sum(e - s for s, e in ranges)
    return Trajectory(
        token_ids=tokens, prompt_len=prompt_len, action_ranges=ranges, rollout_logprobs=logprobs,
        finish_reason="length" if truncated or cut else "stop", label=req.label, datasource=req.datasource,
        prompt_index=req.prompt_index, sample_index=req.sample_index, reward=reward, score=score,
        extra={"agent_turns": float(len(ranges)), "agent_env_tokens": float(len(tokens) - prompt_len - action_tokens),
               **_float_logs(res.get("extra_logs"), "execute extra_logs")})


def trajectory_to_result(traj: Trajectory, prompt: str, label: Any) -> dict:
    """OpenRLHF's executor result dict of ``traj`` (what ``MultiTurnAgentExecutor.execute`` returns)."""
    logprobs = [0.0] * len(traj.token_ids)
    it = iter(traj.rollout_logprobs)
    for s, e in traj.action_ranges:
        for p in range(s, e):
            logprobs[p] = next(it)
    return {"prompt": prompt, "label": label, "observation_tokens": list(traj.token_ids),
            "action_ranges": [list(r) for r in traj.action_ranges], "rollout_log_probs": logprobs,
            "reward": traj.reward, "scores": traj.score, "truncated": traj.truncated, "extra_logs": dict(traj.extra)}


async def multi_turn_execute(executor, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine,
                             images=None) -> dict:
    """``MultiTurnAgentExecutor.execute`` in OpenRLHF's signature (for subclasses that override
    ``execute`` and call ``super().execute(...)``): rlhforge's multi-turn loop, OpenRLHF's dict."""
    if images:
        raise AgentError("images are not supported")
    if not isinstance(llm_engine, OpenRLHFEngine):
        raise AgentError("MultiTurnAgentExecutor.execute(prompt, ...) needs the llm_engine rlhforge passed to execute")
    ctx, outer = llm_engine.ctx, llm_engine.request
    if prompt == ctx.decode(outer.prompt_ids):
        prompt_ids = list(outer.prompt_ids)
    else:
        prompt_ids = ctx.encode(prompt)
    sampling = to_rlhforge_sampling(sampling_params, llm_engine.sampling)
    sampling = replace(sampling, max_new_tokens=max(0, int(max_length) - len(prompt_ids)))
    req = replace(outer, prompt_ids=prompt_ids, label=label)
    ep = Episode(ctx, req, sampling)
    traj = await executor._run_instance_episode(ep, ctx)
    return trajectory_to_result(traj, prompt, label)
