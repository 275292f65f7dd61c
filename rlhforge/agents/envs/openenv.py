"""OpenEnv environment servers (``openenv-core``) as rlhforge multi-turn environments (``--env.kind openenv``).

An OpenEnv server (``openenv.core.env_server.create_app(MyEnvironment, MyAction, MyObservation)``,
run with uvicorn or ``openenv serve``) is driven exactly as OpenEnv's own ``EnvClient`` drives it:
one WebSocket session per episode (``/ws``: ``reset``, ``step``, ``close`` messages; the session
owns one environment instance), or with ``--env.transport http`` the stateless ``POST /reset`` and
``POST /step`` routes (a fresh environment per request: for one-step environments). Per sample:

1. ``reset(seed=<the sample's seed>, **--env.args, **label)`` (a dict label's keys; the server keeps
   the keyword arguments its ``reset`` accepts). When the observation holds text (``--env.observation_key``,
   or the first of ``prompt``/``text``/``message``/``content``/``output``/``feedback``), that text is
   the episode's prompt, as a user turn in the chat template; otherwise the record's prompt is.
2. Generate a reply -> ``step({<--env.action_key>: reply text})`` -> ``observation``, ``reward``,
   ``done``. The observation's text goes back to the model as a user turn
   (:func:`~rlhforge.data.templates.chat_feedback`): tokenised once, outside the action spans
   (never trained on). Until ``done`` or the token budget is spent (then the sample is truncated).
3. The episode reward (and score) is the sum of the step rewards (``None`` counts 0).

Every reset/step is bounded by ``--train.agent_step_timeout`` and the whole episode by
``--train.agent_episode_timeout`` (a hung server is a counted timeout: the sample's group is
dropped and counted, or the run stops with ``--train.agent_fail_fast``). A reply that is not an
OpenEnv result (no ``observation`` object, a non-numeric or non-finite reward, a non-boolean
``done``, a server error message) is an :class:`OpenEnvError` naming the call.

The server must allow as many WebSocket sessions as episodes run at once: OpenEnv's default is one
(``create_app(..., max_concurrent_envs=N)`` with ``SUPPORTS_CONCURRENT_SESSIONS = True`` on the
environment); bound rlhforge's side with ``--train.agent_env_concurrency``.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from rlhforge.agents.episode import AgentError, Episode, EpisodeContext, EpisodeExecutor
from rlhforge.data.templates import chat_feedback
from rlhforge.data.records import json_label as parse_label
from rlhforge.agents.types import Trajectory

__all__ = ["OpenEnvExecutor", "OpenEnvError", "observation_text"]

TEXT_KEYS = ("prompt", "text", "message", "content", "output", "feedback")


class OpenEnvError(AgentError):
    """An OpenEnv server answered something that is not a usable result (names the call)."""


def observation_text(obs: dict, key: str = "") -> str:
    """The text of an observation: field ``key``, else the first of :data:`TEXT_KEYS` holding a string."""
    if key:
        if key not in obs:
            raise OpenEnvError(f"the observation has no field {key!r} (--env.observation_key; fields: {sorted(obs)})")
        value = obs[key]
        if value is None:
            return ""
        if not isinstance(value, str):
            raise OpenEnvError(f"observation field {key!r} is {type(value).__name__}; expected text")
        return value
    return next((obs[k] for k in TEXT_KEYS if isinstance(obs.get(k), str)), "")


def parse_result(payload: Any, what: str) -> tuple[dict, float | None, bool]:
    """``(observation, reward, done)`` of a reset/step reply (OpenEnv's ``{"observation", "reward", "done"}``)."""
    if not isinstance(payload, dict):
        raise OpenEnvError(f"{what} returned {type(payload).__name__}; expected an object with observation, reward, done")
    obs = payload.get("observation")
    if not isinstance(obs, dict):
        raise OpenEnvError(f"{what} returned observation {obs!r}; expected an object (keys: {sorted(payload)})")
    reward = payload.get("reward")
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise OpenEnvError(f"{what} returned reward {reward!r}; expected a number or null")
        reward = float(reward)
        if not math.isfinite(reward):
            raise OpenEnvError(f"{what} returned reward {reward}; expected a finite number")
    done = payload.get("done", False)
    if not isinstance(done, bool):
        raise OpenEnvError(f"{what} returned done {done!r}; expected true or false")
    return obs, reward, done


class _WSSession:
    """One OpenEnv WebSocket session (``/ws``), the messages of ``openenv.core.EnvClient``."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.ws = None

    async def _call(self, message: dict) -> dict:
        import json

        if self.ws is None:
            from websockets.asyncio.client import connect

            ws_url = self.url.replace("https://", "wss://", 1).replace("http://", "ws://", 1) + "/ws"
            self.ws = await connect(ws_url, max_size=100 * 2**20)
        await self.ws.send(json.dumps(message))
        reply = json.loads(await self.ws.recv())
        if not isinstance(reply, dict):
            raise OpenEnvError(f"the server answered {reply!r}")
        if reply.get("type") == "error":
            err = reply.get("data") or {}
            raise OpenEnvError(f"the server answered an error: {err.get('message', err)} (code {err.get('code', '?')})")
        return reply.get("data")

    async def reset(self, kwargs: dict) -> dict:
        return await self._call({"type": "reset", "data": kwargs})

    async def step(self, action: dict) -> dict:
        return await self._call({"type": "step", "data": action})

    async def close(self) -> None:
        if self.ws is not None:
            ws, self.ws = self.ws, None
            try:
                import json

                await asyncio.wait_for(ws.send(json.dumps({"type": "close"})), 2)
            except Exception:  # noqa: BLE001 - best effort, as EnvClient.disconnect
                pass
            try:
                await asyncio.wait_for(ws.close(), 2)
            except Exception:  # noqa: BLE001
                pass


class _HTTPSession:
    """OpenEnv's stateless routes: ``POST /reset``, ``POST /step`` (``{"action": {...}}``)."""

    def __init__(self, url: str):
        import httpx

        self.url = url.rstrip("/")
        self.http = httpx.AsyncClient(timeout=None)

    async def _post(self, path: str, body: dict) -> Any:
        r = await self.http.post(self.url + path, json=body)
        if r.status_code != 200:
            raise OpenEnvError(f"POST {path} answered HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    async def reset(self, kwargs: dict) -> dict:
        return await self._post("/reset", kwargs)

    async def step(self, action: dict) -> dict:
        return await self._post("/step", {"action": action})

    async def close(self) -> None:
        await self.http.aclose()


class OpenEnvExecutor(EpisodeExecutor):
    """Runs each sample as one episode of an OpenEnv server (module docstring)."""

    name = "OpenEnv env"

    def __init__(self, url: str, *, action_key: str = "message", observation_key: str = "", transport: str = "ws",
                 reset_args: dict | None = None, check: bool = False):
        if transport not in ("ws", "http"):
            raise ValueError(f"transport {transport!r}: expected ws or http")
        self.url, self.action_key, self.observation_key = url.rstrip("/"), action_key, observation_key
        self.transport, self.reset_args = transport, dict(reset_args or {})
        self.name = f"OpenEnv env {self.url}"
        if check:
            self.check_server()

    @property
    def env_name(self) -> str:
        return f"OpenEnv server {self.url}"

    def check_server(self) -> None:
        """The server answers ``GET /health`` (start-up check: a wrong URL fails before any model loads)."""
        import httpx

        try:
            r = httpx.get(self.url.replace("ws://", "http://", 1).replace("wss://", "https://", 1) + "/health",
                          timeout=10)
        except httpx.HTTPError as err:
            raise ConnectionError(f"no OpenEnv server answers at {self.url}: {type(err).__name__}: {err}") from None
        if r.status_code != 200:
            raise ConnectionError(f"{self.url}/health answered HTTP {r.status_code}")

    def _session(self):
        return _WSSession(self.url) if self.transport == "ws" else _HTTPSession(self.url)

    def _reset_kwargs(self, ep: Episode) -> dict:
        kwargs = dict(self.reset_args)
        if ep.sampling.seed is not None:
            kwargs["seed"] = int(ep.sampling.seed) % 2**31
        label = parse_label(ep.request.label)
        if isinstance(label, dict):
            kwargs.update(label)
        return kwargs

    async def run_episode(self, ep: Episode, ctx: EpisodeContext) -> Trajectory:
        conn = self._session()
        total, steps = 0.0, 0
        try:
            obs, _, done = parse_result(await ctx.call(conn.reset, self._reset_kwargs(ep), what="reset"), "reset")
            text = observation_text(obs, self.observation_key)
            if text:
                with ctx.lock:
                    prompt = ctx.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                               add_generation_prompt=True)
                ep.reset_prompt(ctx.encode(prompt))
            while not done:
                action = await ep.generate()
                if action is None:
                    break
                steps += 1
                what = f"step {steps}"
                obs, reward, done = parse_result(await ctx.call(conn.step, {self.action_key: action.text}, what=what), what)
                total += reward or 0.0
                if done:
                    ep.done = True
                    break
                text = observation_text(obs, self.observation_key)
                if text:
                    ep.add_feedback(chat_feedback(ctx.tokenizer, text, after_eos=action.finish_reason == "stop"),
                                    what=what)
                if ep.remaining <= 0:
                    break
        finally:
            try:
                await asyncio.wait_for(conn.close(), 5)
            except Exception:  # noqa: BLE001 - closing never fails the sample
                pass
        traj = ep.trajectory()
        traj.reward = traj.score = total
        traj.extra["openenv_steps"] = float(steps)
        return traj
