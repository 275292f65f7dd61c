"""verifiers 0.4 environments (``verifiers.v1``) as rlhforge agent executors (``--env.kind verifiers``).

A taskset (an installed module, or a ``.py`` file defining one) is loaded with verifiers' own loader
(``load_environment``: the taskset's ``Env`` when it ships one, else ``SingleAgentEnv``). Each
rlhforge sample runs one verifiers episode (``Env.run_episode``): verifiers renders the task's
messages with the trained model's tokenizer and chat template (its ``TrainClient`` + ``renderers``,
loaded from ``--actor.model_name_or_path``) and calls the policy through vLLM's token route,
``POST /inference/v1/generate``, which :class:`~rlhforge.agents.serving.tokens.TokenServer` serves
over rlhforge's engine (HF or vLLM) - token ids in, token ids and per-token log-probs out. Each
episode has its own session URL, so the server records the episode's exact tokens: the first call's
ids are the prompt, the ids each later call adds are environment tokens (mask 0), every generated
id is an action token with the engine's sampling log-prob. The task's rubric (``@vf.reward``
methods, plugged reward functions, judges) scores the trace; the trace's reward (the weighted sum)
is the sample's reward and score; its metrics and each reward term are logged as
``rollout/<name>``.

Checked on every episode: the verifiers trace's own token record (its branch's ``token_ids`` and
``sampled_mask``) equals what rlhforge recorded, so what is trained on is exactly what the
environment saw (:class:`VerifiersEnvError` otherwise).

**Which task.** The record's label picks it: an int (or digit string) is the task's position in
the taskset, a dict may name ``idx``, ``id`` (``TaskData.id``) or ``name``; no label: the record's
index modulo the taskset size. :func:`taskset_records` writes a prompt file with one record per task
(``python -m rlhforge.agents.envs.verifiers TASKSET out.jsonl``).

**Harness.** verifiers' built-in harnesses launch a program with ``uv`` (which downloads its
dependencies); ``--env.harness rlhforge_chat`` (the default, :mod:`rlhforge.agents.envs.verifiers_harness`)
plays the task in-process instead. One trace per episode (single-agent envs): a multi-agent env's
agents would share one token record, so it is refused by name.

**Failures.** An episode verifiers marks failed (a task/harness/rubric exception, its own
timeouts), a non-finite reward or a token record that disagrees fails the sample with
:class:`VerifiersEnvError` (its group dropped and counted, or the run stopped with
``--train.agent_fail_fast``); an episode that hangs past ``--train.agent_episode_timeout`` is a
counted timeout like any agent's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from rlhforge.agents.episode import AgentError, Episode, EpisodeContext, EpisodeExecutor
from rlhforge.agents.types import Trajectory

__all__ = ["VerifiersEnvExecutor", "VerifiersEnvError", "load_verifiers_env", "taskset_records"]


class VerifiersEnvError(AgentError):
    """A verifiers episode failed or returned something unusable (names the sample via the executor)."""


def _register_harness() -> None:
    """Make ``rlhforge_chat`` importable under the bare id verifiers' plugin loader imports."""
    from rlhforge.agents.envs import verifiers_harness as vf_harness

    sys.modules.setdefault(vf_harness.HARNESS_ID, vf_harness)


def _taskset_id(ident: str) -> str:
    """A module name as it is, or a ``.py`` file imported and registered under its stem."""
    path = Path(ident)
    if ident.endswith(".py") or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"{ident}: file not found")
        name = path.stem.replace("-", "_").lower()
        module = sys.modules.get(name)
        if module is None or getattr(module, "__file__", None) != str(path.resolve()):
            spec = importlib.util.spec_from_file_location(name, path.resolve())
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(name, None)
                raise
        return name
    return ident


def load_verifiers_env(ident: str, args: dict | None = None, harness: str = "rlhforge_chat",
                       runtime: str = "subprocess"):
    """verifiers' ``Env`` for taskset ``ident`` (module or ``.py`` file) with the taskset config fields
    ``args``, ``harness`` playing its ``agent`` seat in a ``runtime`` runtime."""
    _register_harness()
    from verifiers.v1.utils.loaders import load_environment, resolve_env_config

    taskset = {"id": _taskset_id(ident), **(args or {})}
    agent = {"harness": {"id": harness}, "runtime": {"type": runtime}}
    cfg = resolve_env_config({"taskset": taskset, "agent": agent})
    return load_environment(cfg)


def taskset_records(ident: str, args: dict | None = None, limit: int | None = None) -> list[dict]:
    """One prompt record per task: ``{"prompt": the task's prompt text, "label": {"idx": i}}``."""
    env = load_verifiers_env(ident, args)
    out = []
    for i, task in enumerate(env.taskset):
        if limit is not None and i >= limit:
            break
        out.append({"prompt": task.data.prompt_text, "label": {"idx": i}})
    return out


class VerifiersEnvExecutor(EpisodeExecutor):
    """Runs each sample as one episode of a verifiers 0.4 environment (module docstring)."""

    name = "verifiers env"

    def __init__(self, taskset: str, *, args: dict | None = None, harness: str = "rlhforge_chat",
                 runtime: str = "subprocess", model_path: str, model_name: str = "policy"):
        self.taskset_id, self.args, self.harness, self.runtime = taskset, dict(args or {}), harness, runtime
        self.model_path, self.model_name = str(model_path), model_name
        self.env = load_verifiers_env(taskset, self.args, harness, runtime)
        self.tasks = list(self.env.taskset)
        if not self.tasks:
            raise ValueError(f"taskset {taskset!r} yields no tasks")
        self.name = f"verifiers env {self.env.config.env_id}"
        self.server = None
        self._serving: contextlib.AsyncExitStack | None = None

    @property
    def env_name(self) -> str:
        return f"verifiers environment {self.taskset_id}"

    # -- which task -------------------------------------------------------------------------------
    def task_for(self, label: Any, prompt_index: int):
        from rlhforge.data.records import json_label as parse_label

        label = parse_label(label)
        if isinstance(label, str) and label.strip().isdigit():
            label = int(label)
        if isinstance(label, bool) or label is None or (isinstance(label, dict) and not
                                                         ({"idx", "id", "name"} & set(label))):
            return self.tasks[max(prompt_index, 0) % len(self.tasks)]
        if isinstance(label, int) or (isinstance(label, dict) and "idx" in label):
            i = label if isinstance(label, int) else int(label["idx"])
            if not 0 <= i < len(self.tasks):
                raise VerifiersEnvError(f"label names task {i}; the taskset has {len(self.tasks)} (0..{len(self.tasks) - 1})")
            return self.tasks[i]
        if isinstance(label, dict):
            key = "id" if "id" in label else "name"
            hits = [t for t in self.tasks if getattr(t.data, key) == label[key]]
            if not hits:
                raise VerifiersEnvError(f"no task of taskset {self.taskset_id!r} has {key} {label[key]!r}")
            return hits[0]
        raise VerifiersEnvError(f"label {label!r} names no task (an index, or a dict with idx, id or name)")

    # -- serving ------------------------------------------------------------------------------------
    async def before_batch(self, ctx: EpisodeContext) -> None:
        import asyncio

        from rlhforge.agents.serving.routes import AgentServerLimits
        from rlhforge.agents.serving.tokens import TokenServer

        if self.server is None:
            limits = AgentServerLimits.from_settings(self.settings)
            if limits.api_key:  # verifiers' train client reads its key from this variable (_model_context)
                os.environ["RLHFORGE_VERIFIERS_API_KEY"] = limits.api_key
            self.server = TokenServer(self.tokenizer, self.model_name, ctx.lock, max_model_len=self.settings.max_len,
                                      limits=limits)
            await asyncio.to_thread(self.server.start)
        self.server.bind(asyncio.get_running_loop(), ctx.engine.generate_one)
        self._serving = contextlib.AsyncExitStack()
        await self._serving.enter_async_context(self.env.serving())

    async def after_batch(self, ctx: EpisodeContext) -> None:
        if self._serving is not None:
            stack, self._serving = self._serving, None
            await stack.aclose()
        if self.server is not None:
            self.server.bind(None, None)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
        super().close()

    # -- one episode --------------------------------------------------------------------------------
    def _model_context(self, session_url: str, ep: Episode):
        import verifiers.v1 as vf

        sp = ep.sampling
        client = vf.TrainClientConfig(base_url=session_url, api_key_var="RLHFORGE_VERIFIERS_API_KEY",
                                      renderer_model_name=self.model_path)
        sampling = vf.SamplingConfig(temperature=sp.temperature, top_p=sp.top_p, max_tokens=sp.max_new_tokens)
        return vf.ModelContext(model=self.model_name, client=client, sampling=sampling)

    async def run_episode(self, ep: Episode, ctx: EpisodeContext) -> Trajectory:
        req = ep.request
        task = self.task_for(req.label, req.prompt_index)
        s = self.settings
        sess = self.server.open_session(ep.sampling, ep.budget, s.max_len, s.prefix_mismatch)
        url = self.server.session_url(sess.sid)
        keys = _known_context_length(url, self.model_name, s.max_len)
        try:
            async with ctx.semaphore:
                episode = await self.env.run_episode(task, self._model_context(url, ep))
        finally:
            self.server.close_session(sess.sid)
            _forget_context_length(keys)
        if sess.error:
            raise VerifiersEnvError(sess.error)
        if not episode.ok:
            errs = list(episode.errors) + [e for t in episode.traces for e in t.errors]
            what = "; ".join(f"{e.type}: {e.message}" for e in errs) or "no error recorded"
            raise VerifiersEnvError(f"verifiers episode failed{' (timeout)' if episode.is_timeout else ''}: {what}")
        if len(episode.traces) != 1:
            raise VerifiersEnvError(f"the episode has {len(episode.traces)} traces; rlhforge trains single-agent "
                                    "verifiers environments (one trace per episode)")
        trace = episode.traces[0]
        if sess.tokens is None:
            raise VerifiersEnvError("the episode made no model call")
        self._check_trace(trace, sess)
        reward = float(trace.reward)
        if not math.isfinite(reward):
            raise VerifiersEnvError(f"the rubric's reward is {reward} ({_terms(trace)})")
        extra = {"agent_turns": float(sess.calls), "agent_env_tokens": float(sess.env_tokens)}
        for name, r in trace.rewards.items():
            if r is not None and math.isfinite(float(r.score)):
                extra[f"reward_{name}"] = float(r.score)
        for name, v in trace.metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v)):
                extra[name] = float(v)
        return Trajectory(
            token_ids=list(sess.tokens), prompt_len=sess.prompt_len, action_ranges=list(sess.action_ranges),
            rollout_logprobs=list(sess.logprobs),
            finish_reason="length" if (sess.cut or sess.last_finish == "length") else "stop",
            label=req.label, datasource=req.datasource, prompt_index=req.prompt_index, sample_index=req.sample_index,
            reward=reward, score=reward, extra=extra,
            engine_turns=list(sess.turns) if s.check_tokens else None,
        )

    @staticmethod
    def _check_trace(trace, sess) -> None:
        """verifiers' own token record of the trace equals rlhforge's (when it kept one)."""
        branches = trace.branches
        if len(branches) != 1 or not branches[0].token_ids:
            return
        ids, sampled = list(branches[0].token_ids), list(branches[0].sampled_mask)
        mask = [0] * len(sess.tokens)
        for a, b in sess.action_ranges:
            mask[a:b] = [1] * (b - a)
        if ids != sess.tokens[: len(ids)] or [int(x) for x in sampled] != mask[: len(sampled)]:
            raise VerifiersEnvError(
                f"verifiers' token record of the episode ({len(ids)} tokens, {sum(map(bool, sampled))} sampled) "
                f"differs from the tokens rlhforge served ({len(sess.tokens)}, {sum(mask)} sampled)")


def _known_context_length(url: str, model: str, max_len: int | None) -> list:
    """Tell ``renderers.client`` the session's context length up front (its cache, keyed by base URL
    and model): it would otherwise ask ``GET /v1/models`` once per session URL under a module-level
    ``asyncio.Lock``, which breaks when episodes run on more than one event loop (rollout and eval
    threads, tests)."""
    try:
        from renderers import client as rc
    except ImportError:
        return []
    cache = getattr(rc, "_max_prompt_len_cache", None)
    if not isinstance(cache, dict):
        return []
    keys = [(url, model), (url.rstrip("/") + "/", model)]
    for k in keys:
        cache[k] = max_len
    return keys


def _forget_context_length(keys: list) -> None:
    from renderers import client as rc

    for k in keys:
        rc._max_prompt_len_cache.pop(k, None)


def _terms(trace) -> str:
    return ", ".join(f"{k}={getattr(v, 'score', v)}" for k, v in trace.rewards.items()) or "no reward terms"


def main(argv: list[str] | None = None) -> int:
    """``python -m rlhforge.agents.envs.verifiers TASKSET OUT.jsonl [ARGS_JSON]``: one prompt record per task."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) not in (2, 3):
        print(main.__doc__, file=sys.stderr)
        return 2
    records = taskset_records(argv[0], json.loads(argv[2]) if len(argv) == 3 else None)
    Path(argv[1]).write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"{len(records)} tasks -> {argv[1]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
