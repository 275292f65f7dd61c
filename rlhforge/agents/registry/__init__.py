"""Task and environment registry: route each record to a generate function and a reward by its label.

A record names what to do with it (the fork's convention)::

    {"prompt": "What is 17 * 3?", "task": "math",
     "label": "{\\"env_func\\": \\"math_tir\\", \\"answer\\": \\"51\\"}"}

- ``label`` (``--data.label_key``; a dict or a JSON object string) may name an ``env_func``: the
  generate function that runs the episode (multi-turn, tools ...). Without one the sample is a
  single generation.
- the *task* is ``label["task"]`` when present, else the record's datasource field
  (``--data.datasource_key task`` reads the fork's top-level ``task`` field).

Users register in plain Python (a file given as ``--train.agent_func_path my_tasks.py``; the
built-ins ``math`` and ``math_tir`` are always there)::

    from rlhforge.agents import register_task, register_env

    def my_reward(response, label, **kw):               # -> float, (reward, score) or
        return float(label["answer"] in response)       #    {"reward", "score", "extra_logs"}

    register_task("my_task", reward=my_reward,
                  sample_filter=lambda traj, label: True,       # False: not trained on (mask 0)
                  experience_filter=lambda group: True,         # False: drop the prompt group
                  reward_fail=lambda traj, label, err: 0.0)     # reward when my_reward raised
                                                                #   (None: drop the group)

    async def my_env(ep, label, ctx):                   # drives the episode with ep.generate() /
        action = await ep.generate()                    # ep.add_feedback(); returns extra logs
        ...
        return {"extra_logs": {...}}

    register_env("my_env", my_env)

Semantics:

- **reward**: called once per finished sample with the response text (everything after the
  prompt, special tokens removed; environment feedback included) and the label (parsed), plus
  keyword arguments ``prompt``, ``trajectory``; runs in a worker thread under
  ``--train.agent_step_timeout``. A plain number is reward and score.
- **per-sample filter** ``sample_filter(trajectory, label) -> bool``: False keeps the sample in its
  group (its reward still counts in the group baseline) but trains on none of its tokens.
- **per-experience filter** ``experience_filter(group) -> bool``: called with the ``n`` scored
  samples of one prompt; False drops the group from the batch (``rollout/exp_filter_groups``).
- **reward-failure handler** ``reward_fail(trajectory, label, error) -> float | None``: the reward
  to use when ``reward`` raised or timed out; None drops the group (``reward_failed``). Without a
  handler a reward failure is an agent failure (dropped, or fatal with ``--train.agent_fail_fast``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from rlhforge.data.records import json_label as parse_label  # noqa: F401 (re-exported)
from rlhforge.agents.episode import AgentError, Episode, EpisodeContext, EpisodeExecutor
from rlhforge.agents.values import _float_logs, to_float
from rlhforge.agents.types import Trajectory

__all__ = ["Task", "TASKS", "ENVS", "register_task", "register_env", "get_task", "get_env", "parse_label",
           "RegistryExecutor"]


@dataclass
class Task:
    name: str
    reward: Callable
    sample_filter: Callable | None = None
    experience_filter: Callable | None = None
    reward_fail: Callable | None = None


TASKS: dict[str, Task] = {}
ENVS: dict[str, Callable] = {}


def register_task(name: str, reward: Callable, *, sample_filter: Callable | None = None,
                  experience_filter: Callable | None = None, reward_fail: Callable | None = None) -> Task:
    """Register (or replace) task ``name``."""
    if not callable(reward):
        raise TypeError(f"register_task({name!r}): reward must be callable")
    TASKS[name] = Task(name, reward, sample_filter, experience_filter, reward_fail)
    return TASKS[name]


def register_env(name: str, generate: Callable | None = None):
    """Register (or replace) generate function ``name``; usable as ``@register_env("name")``."""
    def add(fn):
        if not callable(fn):
            raise TypeError(f"register_env({name!r}): the generate function must be callable")
        ENVS[name] = fn
        return fn
    return add(generate) if generate is not None else add


_BUILTINS_DONE = False


def _builtins() -> None:
    """Register the built-in tasks and envs (math, math_tir) once; a user's registration of the same
    name made earlier wins."""
    global _BUILTINS_DONE
    if _BUILTINS_DONE:
        return
    from rlhforge.agents.registry.builtin import BUILTIN_ENVS, BUILTIN_TASKS

    _BUILTINS_DONE = True
    for name, kwargs in BUILTIN_TASKS.items():
        if name not in TASKS:
            register_task(name, **kwargs)
    for name, fn in BUILTIN_ENVS.items():
        ENVS.setdefault(name, fn)


def get_task(name: str | None) -> Task:
    _builtins()
    if name is None:
        raise AgentError("the sample names no task (set label['task'] or the record's datasource field, "
                         f"--data.datasource_key); registered: {', '.join(sorted(TASKS))}")
    if name not in TASKS:
        raise AgentError(f"unknown task {name!r}; registered: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def get_env(name: str) -> Callable:
    _builtins()
    if name not in ENVS:
        raise AgentError(f"unknown env_func {name!r}; registered: {', '.join(sorted(ENVS))}")
    return ENVS[name]


def _reward_value(raw) -> tuple[float, float, dict[str, float]]:
    if isinstance(raw, dict):
        key = "reward" if "reward" in raw else "rewards"
        if key not in raw:
            raise AgentError(f"the reward function returned a dict without 'reward' (keys: {sorted(raw)})")
        r = to_float(raw[key], "reward")
        s = to_float(raw["score"] if "score" in raw else raw.get("scores", r), "score")
        return r, s, _float_logs(raw.get("extra_logs"), "extra_logs")
    if isinstance(raw, (tuple, list)) and len(raw) == 2:
        return to_float(raw[0], "reward"), to_float(raw[1], "score"), {}
    r = to_float(raw, "reward")
    return r, r, {}


class RegistryExecutor(EpisodeExecutor):
    """Runs each sample with its label's ``env_func`` (or one generation) and scores it with its task."""

    name = "registry"

    async def run_episode(self, ep: Episode, ctx: EpisodeContext) -> Trajectory:
        req = ep.request
        label = parse_label(req.label)
        task_name = label.get("task") if isinstance(label, dict) and label.get("task") else req.datasource
        task = get_task(task_name)
        env_name = label.get("env_func") if isinstance(label, dict) else None
        logs: dict[str, float] = {}
        if env_name:
            gen = get_env(env_name)
            out = await gen(ep, label, ctx)
            if isinstance(out, dict):
                logs = _float_logs(out.get("extra_logs"), f"{env_name} extra_logs")
            if not ep.cut:
                ep.done = True
        else:
            await ep.generate()
            ep.done = True
        traj = ep.trajectory()
        traj.extra.update(logs)
        response = ctx.decode(traj.response_ids, skip_special_tokens=True)
        prompt = ctx.decode(traj.prompt_ids, skip_special_tokens=True)
        try:
            raw = await ctx.call(task.reward, response, label, prompt=prompt, trajectory=traj,
                                 what=f"task {task.name} reward")
            reward, score, extra = _reward_value(raw)
        except AgentError as err:
            if task.reward_fail is None:
                raise
            fallback = task.reward_fail(traj, label, err)
            traj.extra["reward_failed"] = 1.0
            if fallback is None:
                traj.drop_reason, traj.error = "reward_failed", str(err)
                return traj
            reward = score = to_float(fallback, f"task {task.name} reward_fail")
            extra = {}
        traj.reward, traj.score = reward, score
        traj.extra.update(extra)
        if task.sample_filter is not None and not task.sample_filter(traj, label):
            traj.action_ranges, traj.rollout_logprobs = [], []  # stays in its group, contributes no tokens
            traj.extra["sample_filtered"] = 1.0
        return traj

    async def finish_batch(self, trajs, requests, ctx) -> None:
        start = 0
        while start < len(trajs):
            end = start + 1
            while end < len(trajs) and requests[end].sample_index != 0:
                end += 1
            group = trajs[start:end]
            start = end
            if any(t.drop_reason for t in group):
                continue
            label = parse_label(group[0].label)
            name = label.get("task") if isinstance(label, dict) and label.get("task") else group[0].datasource
            task = TASKS.get(name)
            if task is not None and task.experience_filter is not None and not task.experience_filter(group):
                for t in group:
                    t.drop_reason = "exp_filter"
