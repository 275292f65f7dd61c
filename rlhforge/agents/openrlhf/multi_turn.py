"""Multi-turn environments with OpenRLHF's agent API (``--train.agent_func_path my_env.py``).

A user file defines an environment class; one fresh instance runs each sample::

    from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor   # or rlhforge.agents

    class AgentInstance(AgentInstanceBase):
        async def reset(self, states, **kwargs):
            return {"observation": states["observation"]}      # the prompt text (may be rewritten)

        async def step(self, states, **kwargs):
            # states: observation_text, action_text, label, sampling_params
            return {"rewards": 1.0, "environment_feedback": "...", "done": True,
                    "scores": 1.0, "sampling_params": None, "extra_logs": {"tries": 3.0}}

    class AgentExecutor(MultiTurnAgentExecutor):                # optional: this is what the loader builds
        def __init__(self):
            super().__init__(AgentInstance)

The loop per sample: ``reset`` -> (generate an action -> ``step`` -> append the feedback tokens
with loss mask 0) until ``done`` or the token budget is spent (then the trajectory is
``truncated``). Names, arguments and the dicts passed and returned are OpenRLHF's
(``openrlhf.utils.agent``), so an OpenRLHF agent file runs unchanged (its ``openrlhf`` imports are
aliased while it is loaded: :mod:`rlhforge.openrlhf_alias`). ``states["sampling_params"]`` has
vLLM's field names (:class:`~rlhforge.agents.openrlhf.execute.VLLMSamplingParams`).

``step`` returns (OpenRLHF's keys; ``rewards`` may be a tensor, a number or a one-element list):

=========================  ========================================================================
``rewards``                this step's reward; the episode reward is the sum over steps
``environment_feedback``   text appended after the action (tokenised once, never trained on)
``environment_images``     (optional) images shown with the feedback (a vision-language actor):
                           PIL images, paths, base64 strings; at the text's ``<image>``
                           placeholders, else before it (:mod:`rlhforge.agents.episode_images`)
``done``                   end the episode
``scores`` (optional)      0-1 score for filtering / pass@k (default: the episode reward)
``sampling_params``        (optional) parameters of the next turn: a :class:`SamplingParams`, or a
                           dict of overrides (``max_tokens``/``max_new_tokens``, ``temperature``,
                           ``top_p``, ``top_k``, ``stop_token_ids``)
``extra_logs`` (optional)  name -> number, logged as ``rollout/<name>`` (last step's values kept)
``episode_reward``         (rlhforge) replaces the sum of step rewards as the episode reward
=========================  ========================================================================

``reset`` may also return ``sampling_params`` (rlhforge: parameters of the first turn). ``states`` also carries ``finish_reason`` (of the action) and ``action_token_ids``; methods that
accept ``**kwargs`` get ``tokenizer=`` (e.g. for :func:`chat_feedback`). Feedback returned together
with ``done=True`` is not appended (nothing is generated after it).
``reset``/``step`` (and ``__init__``) may also be plain functions: they run in the executor's own
pool of daemon threads (:class:`~rlhforge.agents.episode.EnvThreadPool`), apart from generation.
Each call is bounded by ``--train.agent_step_timeout`` and ``--train.agent_env_concurrency``; a
plain call that hangs past the timeout fails its sample like an async one and leaves its thread
behind (counted in ``rollout/agent_stuck_threads``; more than ``--train.agent_max_stuck_threads``
stop the run).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import fields, replace
from typing import Any

from rlhforge.data.templates import chat_feedback  # noqa: F401 (documented as rlhforge.agents.chat_feedback)
from rlhforge.agents.episode import AgentError, Episode, EpisodeContext, EpisodeExecutor
from rlhforge.agents.episode_images import image_list
from rlhforge.agents.single_turn import PromptRequest
from rlhforge.agents.types import Trajectory
from rlhforge.agents.values import _float_logs, merge_sampling, to_float  # noqa: F401 - re-exported
from rlhforge.rollout.engine import SamplingParams

__all__ = ["AgentInstanceBase", "AgentExecutorBase", "MultiTurnAgentExecutor", "chat_feedback", "to_float"]


class AgentInstanceBase:
    """One environment episode (OpenRLHF's ``AgentInstanceBase``). Constructed without arguments."""

    def __init__(self, *args, **kwargs):
        pass

    async def reset(self, states: dict, **kwargs) -> dict:
        """``states = {"observation": prompt_text, "label": label}``; return ``{"observation": text}``."""
        return states

    async def step(self, states: dict, **kwargs) -> dict:
        raise NotImplementedError


class AgentExecutorBase(EpisodeExecutor):
    """Base of every agent executor. Implement either

    - ``async run_episode(ep, ctx) -> Trajectory`` (rlhforge's form: ``ep.generate()`` /
      ``ep.add_feedback()``, see :class:`~rlhforge.agents.episode.Episode`), or
    - ``async execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine) -> dict``
      (OpenRLHF's form, with a vLLM-shaped ``llm_engine``; see :mod:`rlhforge.agents.openrlhf.execute`).
    """

    async def run_episode(self, ep: Episode, ctx: EpisodeContext) -> Trajectory:
        from rlhforge.agents.openrlhf.execute import run_openrlhf_execute, user_execute

        if user_execute(self, MultiTurnAgentExecutor):
            return await run_openrlhf_execute(self, ep, ctx)
        raise NotImplementedError(f"{type(self).__name__} implements neither run_episode(ep, ctx) nor OpenRLHF's "
                                  "execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine)")


async def _construct(cls):
    """``cls()`` for an ``async def __init__`` (used by some OpenRLHF agent files)."""
    inst = cls.__new__(cls)
    await inst.__init__()
    return inst


def _new_instance(cls):
    """``cls()`` for a plain ``__init__`` (run in an environment thread: it may block)."""
    return cls()


def _extra_kwargs(method, ctx: EpisodeContext) -> dict:
    """``tokenizer=`` for methods that accept it (OpenRLHF's signatures take ``**kwargs``)."""
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return {}
    if any(p.kind is p.VAR_KEYWORD or p.name == "tokenizer" for p in params):
        return {"tokenizer": ctx.tokenizer}
    return {}


class MultiTurnAgentExecutor(AgentExecutorBase):
    """Runs ``agent_instance_cls`` (an :class:`AgentInstanceBase`) per sample; see the module docstring."""

    name = "multi-turn agent"

    def __init__(self, agent_instance_cls):
        if not (inspect.isclass(agent_instance_cls) and callable(getattr(agent_instance_cls, "step", None))):
            raise TypeError(f"MultiTurnAgentExecutor needs an AgentInstanceBase subclass (got {agent_instance_cls!r})")
        self.agent_instance_cls = agent_instance_cls
        self.name = f"agent {getattr(agent_instance_cls, '__name__', agent_instance_cls)}"

    async def execute(self, *args, **kwargs):
        """rlhforge's ``execute(request, sampling, engine) -> Trajectory``, or OpenRLHF's
        ``execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine) -> dict``
        (for subclasses that override ``execute`` and call ``super().execute(...)``)."""
        first = args[0] if args else kwargs.get("request", kwargs.get("prompt"))
        if isinstance(first, PromptRequest):
            return await super().execute(*args, **kwargs)
        from rlhforge.agents.openrlhf.execute import multi_turn_execute

        return await multi_turn_execute(self, *args, **kwargs)

    async def run_episode(self, ep: Episode, ctx: EpisodeContext) -> Trajectory:
        from rlhforge.agents.openrlhf.execute import run_openrlhf_execute, user_execute

        if user_execute(self, MultiTurnAgentExecutor):  # a subclass with its own OpenRLHF-shaped execute()
            return await run_openrlhf_execute(self, ep, ctx)
        return await self._run_instance_episode(ep, ctx)

    async def _run_instance_episode(self, ep: Episode, ctx: EpisodeContext) -> Trajectory:
        from rlhforge.agents.openrlhf.execute import VLLMSamplingParams

        req = ep.request
        cls = self.agent_instance_cls
        make = _construct if inspect.iscoroutinefunction(getattr(cls, "__init__", None)) else _new_instance
        inst = await ctx.call(make, cls, what="creating the environment")
        prompt_text = ctx.decode(req.prompt_ids)
        states = await ctx.call(inst.reset, {"observation": prompt_text, "label": req.label}, what="reset",
                                **_extra_kwargs(inst.reset, ctx))
        if states is None:
            states = {"observation": prompt_text}
        if not isinstance(states, dict):
            raise AgentError(f"reset returned {type(states).__name__}; expected a dict with 'observation'")
        observation = states.get("observation", prompt_text)
        if not isinstance(observation, str):
            raise AgentError(f"reset returned observation of type {type(observation).__name__}; expected text")
        if observation != prompt_text:
            ep.reset_prompt(ctx.encode(observation))
        sampling = merge_sampling(ep.sampling, states.get("sampling_params"))  # rlhforge: reset may set them
        total, episode_reward, scores, logs = 0.0, None, None, {}
        while True:
            action = await ep.generate(sampling)
            if action is None:
                break
            step_states = {"observation_text": observation, "action_text": action.text, "label": req.label,
                           "sampling_params": VLLMSamplingParams.from_rlhforge(sampling),
                           "finish_reason": action.finish_reason,
                           "action_token_ids": list(action.token_ids)}
            res = await ctx.call(inst.step, step_states, what=f"step {ep.turns}", **_extra_kwargs(inst.step, ctx))
            if not isinstance(res, dict):
                raise AgentError(f"step {ep.turns} returned {type(res).__name__}; expected a dict with "
                                 f"'rewards', 'environment_feedback', 'done'")
            missing = [k for k in ("rewards", "done") if k not in res and not (k == "rewards" and "reward" in res)]
            if missing:
                raise AgentError(f"step {ep.turns} returned a dict without {missing} (keys: {sorted(res)})")
            total += to_float(res.get("rewards", res.get("reward")), f"step {ep.turns} rewards")
            if res.get("episode_reward") is not None:
                episode_reward = to_float(res["episode_reward"], f"step {ep.turns} episode_reward")
            if res.get("scores") is not None:
                scores = to_float(res["scores"], f"step {ep.turns} scores")
            logs = _float_logs(res.get("extra_logs"), f"step {ep.turns} extra_logs") or logs
            sampling = merge_sampling(sampling, res.get("sampling_params"))
            feedback = res.get("environment_feedback") or ""
            if not isinstance(feedback, str):
                raise AgentError(f"step {ep.turns} environment_feedback is {type(feedback).__name__}; expected text")
            observation = observation + action.text + feedback
            if bool(res["done"]):
                ep.done = True
                break
            images = image_list(res.get("environment_images"))
            if feedback or images:
                ep.add_feedback(feedback, images, what=f"step {ep.turns}")
            if ep.remaining <= 0:
                break
        traj = ep.trajectory()
        traj.reward = episode_reward if episode_reward is not None else total
        traj.score = scores if scores is not None else traj.reward
        traj.extra.update(logs)
        return traj
