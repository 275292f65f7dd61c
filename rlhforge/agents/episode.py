"""What every agent executor shares: the token recorder of one episode, a batching front for the
generation engine, per-call timeouts and concurrency limits, and failure handling.

:class:`Episode` is the only place where tokens enter a trajectory. ``await ep.generate()`` asks
the engine for the next action and appends the engine's token ids and log-probs unchanged (an
action span, trained on); ``ep.add_feedback(text)`` tokenises environment text once and appends it
outside every action span (never trained on). Nothing already recorded is ever re-tokenised, so a
trajectory is token-in-token-out whatever the executor.

**Images.** ``ep.vision`` holds every image of the tokens so far (a ``data.images.VisionInput``: the
prompt's, then each feedback's, in token order); every generation call sends it to the engine and
:meth:`Episode.trajectory` hands it on. ``ep.add_feedback(text, images=[...])`` (a step's
``environment_images``) places the images at the text's ``<image>`` placeholders, else before the
text, each as its vision tokens with the image token expanded (:mod:`rlhforge.agents.episode_images`);
they are feedback: outside the action spans, never trained on.

**Token budget.** ``rollout.max_new_tokens`` bounds everything after the prompt (actions and
feedback together, image tokens included; ``data.max_len`` bounds the whole sequence). Each turn may
generate what is left; feedback that does not fit is cut at the budget, except that an image is never
split: an image that does not fit whole is dropped with its vision tokens, and so is everything after
it (counted as ``agent_images_dropped``). An episode that runs out of budget before the environment says
``done`` - or whose last action was cut by the budget - is *truncated*: its ``finish_reason`` is
``"length"``, so the stop-properly penalty (``--reward.stop_properly_penalty_coef``) applies to
multi-turn runs too.

:class:`EpisodeExecutor` runs a batch of episodes concurrently (``asyncio``), routes their
generation requests through one :class:`BatchingEngine` (requests that arrive together are decoded
together), bounds environment calls with a per-call timeout and a semaphore, and turns any failure
into an :class:`AgentError` that names the sample. A failed sample is returned with
``drop_reason="env_error"``; :func:`drop_failed_groups` (called by the trainer) removes its whole
prompt group from the batch and counts it, unless ``--train.agent_fail_fast`` makes the first
failure stop the run.

**Threads.** Plain (synchronous) environment code - ``def step()``, ``def reset()``, a sync
constructor, task reward or ``run_agent`` - runs in the executor's own :class:`EnvThreadPool` of
daemon threads, never in the event loop's default executor, and HF/vLLM generation runs in a
pool of its own (:mod:`rlhforge.agents.batching`), so environments cannot starve generation. A sync call
that outlives ``--train.agent_step_timeout`` fails its sample exactly like a timed-out async call;
its thread cannot be killed, so it is *abandoned*: left behind, counted
(``rollout/agent_stuck_threads``) and replaced by a fresh one, so the calls of other samples keep
their full ``--train.agent_env_concurrency``. A thread that does return later goes back to the
pool and stops being counted. More than ``--train.agent_max_stuck_threads`` stuck at once stops
the run with :class:`EnvironmentStuckError`, naming the environment and the count.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from rlhforge.agents.batching import BatchingEngine
from rlhforge.agents.env_threads import EnvironmentStuckError, EnvThreadPool
from rlhforge.agents.episode_images import FeedbackPiece, check_image_tokens, feedback_pieces
from rlhforge.agents.single_turn import PromptRequest
from rlhforge.agents.types import AgentError, EngineTurn, Trajectory
from rlhforge.rollout.engine import SamplingParams

__all__ = ["AgentError", "EnvironmentStuckError", "AgentSettings", "Action", "Episode", "BatchingEngine",
           "EnvThreadPool", "EpisodeExecutor", "EpisodeContext", "drop_failed_groups", "sample_id", "turn_seed"]

_SEED_MOD = 2**62


@dataclass(frozen=True)
class AgentSettings:
    """Robustness knobs (from ``--train.agent_*``)."""

    step_timeout: float = 60.0
    """Seconds one environment call (reset, step, tool call, reward) may take."""
    episode_timeout: float = 1800.0
    """Seconds one whole episode may take (generation included)."""
    env_concurrency: int = 64
    """Environment calls running at once (OpenAI-client agents: episodes at once)."""
    max_stuck_threads: int = 16
    """Synchronous environment calls that may hang past their timeout (threads abandoned) before the
    run stops with :class:`EnvironmentStuckError`."""
    fail_fast: bool = False
    """Stop the run at the first failing sample instead of dropping its group."""
    max_len: int | None = None
    """Longest prompt + response (``data.max_len``)."""
    prefix_mismatch: str = "error"
    """OpenAI server: what a request whose prompt does not extend the session does (error|new_segment)."""
    check_tokens: bool = False
    """Record every generation call (``Trajectory.engine_turns``) for the token checker."""
    server_max_body_mb: float = 8.0
    """Agent servers: largest request body in MiB (``--train.agent_server_max_body_mb``)."""
    server_max_message_chars: int = 262_144
    """Agent servers: longest message / new text of one request (``--train.agent_server_max_message_chars``)."""
    server_api_key: str | None = field(default=None, repr=False)
    """Agent servers: the key clients must send (``--train.agent_server_api_key``; None: $RLHFORGE_AGENT_API_KEY)."""

    @classmethod
    def from_config(cls, cfg) -> "AgentSettings":
        t = cfg.train
        return cls(step_timeout=t.agent_step_timeout, episode_timeout=t.agent_episode_timeout,
                   env_concurrency=t.agent_env_concurrency, fail_fast=t.agent_fail_fast, max_len=cfg.data.max_len,
                   prefix_mismatch=t.agent_openai_prefix_mismatch, check_tokens=getattr(t, "check_tokens", False),
                   max_stuck_threads=getattr(t, "agent_max_stuck_threads", cls.max_stuck_threads),
                   server_max_body_mb=getattr(t, "agent_server_max_body_mb", cls.server_max_body_mb),
                   server_max_message_chars=getattr(t, "agent_server_max_message_chars", cls.server_max_message_chars),
                   server_api_key=getattr(t, "agent_server_api_key", None))


def sample_id(req: PromptRequest) -> str:
    src = f", datasource {req.datasource}" if req.datasource else ""
    return f"prompt {req.prompt_index} sample {req.sample_index}{src}"


def turn_seed(seed: int | None, turn: int) -> int | None:
    """Seed of turn ``turn`` of an episode whose first turn uses ``seed`` (None stays None)."""
    if seed is None or turn == 0:
        return seed
    return (seed + turn * 1_000_000_007) % _SEED_MOD


# --------------------------------------------------------------------------------------------- episode


@dataclass
class Action:
    """One generated turn."""

    text: str
    """Decoded action (special tokens removed) - what the environment reads."""
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class Episode:
    """Records one episode's tokens (see the module docstring)."""

    def __init__(self, ctx: "EpisodeContext", request: PromptRequest, sampling: SamplingParams,
                 prompt_ids: Sequence[int] | None = None):
        self.ctx, self.request, self.sampling = ctx, request, sampling
        ids = list(request.prompt_ids if prompt_ids is None else prompt_ids)
        self.token_ids: list[int] = ids
        self.prompt_len = len(ids)
        self.budget = sampling.max_new_tokens
        self.action_ranges: list[tuple[int, int]] = []
        self.logprobs: list[float] = []
        self.routing = None
        """MoE routing replay: the engine's expert choices per token so far (earliest record wins)."""
        self.vision = request.vision
        """Every image of :attr:`token_ids` so far (prompt's, then feedback's), or None."""
        self.turns = 0
        self.env_tokens = 0
        self.env_images = 0
        self.images_dropped = 0
        self.cut = False
        """The budget ran out (feedback cut, or no room for another turn)."""
        self.last_finish = "stop"
        self.done = False
        """Set by the executor when the environment ended the episode."""
        self.engine_turns: list[EngineTurn] | None = [] if getattr(getattr(ctx, "settings", None), "check_tokens", False) else None

    def reset_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Replace the prompt (only before the first turn: e.g. ``reset`` rewrote the observation)."""
        if self.turns:
            raise AgentError("the prompt can only be replaced before the first turn")
        check_image_tokens(prompt_ids, self.vision, self.ctx.tokenizer, "the new prompt")
        self.token_ids, self.prompt_len = list(prompt_ids), len(prompt_ids)

    @property
    def remaining(self) -> int:
        """Tokens that may still be appended."""
        left = self.prompt_len + self.budget - len(self.token_ids)
        if self.ctx.settings.max_len is not None:
            left = min(left, self.ctx.settings.max_len - len(self.token_ids))
        return max(left, 0)

    @property
    def truncated(self) -> bool:
        return self.last_finish == "length" and self.remaining == 0 or self.cut or (not self.done and self.remaining == 0)

    async def generate(self, sampling: SamplingParams | None = None) -> Action | None:
        """Generate the next action (at most what the budget leaves); None when nothing is left (or
        the last feedback was cut)."""
        left = self.remaining
        if left <= 0 or self.cut:
            self.cut = True
            return None
        sp = sampling or self.sampling
        sp = replace(sp, max_new_tokens=max(1, min(sp.max_new_tokens, left)),
                     seed=turn_seed(self.sampling.seed, self.turns))
        seen = tuple(self.token_ids) if self.engine_turns is not None else ()
        out = await self.ctx.engine.generate_one(self.token_ids, sp, vision=self.vision)
        ids = list(out.token_ids)
        if len(ids) != len(out.logprobs):
            raise AgentError(f"engine returned {len(ids)} tokens but {len(out.logprobs)} log-probs")
        if self.engine_turns is not None:
            self.engine_turns.append(EngineTurn(seen, tuple(ids), tuple(float(x) for x in out.logprobs)))
        start = len(self.token_ids)
        self.token_ids.extend(ids)
        if ids:
            self.action_ranges.append((start, start + len(ids)))
        self.logprobs.extend(float(x) for x in out.logprobs)
        self.routing = merge_routing(self.routing, out.extra.get("routed_experts"))
        self.turns += 1
        self.last_finish = out.finish_reason
        return Action(self.ctx.decode(ids, skip_special_tokens=True), ids, list(out.logprobs), out.finish_reason)

    def add_feedback(self, feedback: str | Sequence[int], images: Sequence | None = None,
                     what: str = "the environment") -> int:
        """Append environment text (tokenised once, ``add_special_tokens=False``) or token ids, and
        ``images`` (module docstring), outside the action spans; cut to the budget (an image is never
        split). ``what`` names the caller in errors (e.g. ``step 2``). Returns the tokens appended."""
        if images:
            pieces = feedback_pieces(self.ctx, feedback, images, what)
        else:
            pieces = [FeedbackPiece(self.ctx.encode(feedback) if isinstance(feedback, str)
                                    else [int(i) for i in feedback])]
        left, kept = self.remaining, []
        for piece in pieces:
            if len(piece.ids) > left:  # the budget ends here: cut text, drop an image whole
                self.cut = True
                if piece.vision is None and left:
                    kept.append(FeedbackPiece(piece.ids[:left]))
                break
            kept.append(piece)
            left -= len(piece.ids)
        n = 0
        for piece in kept:
            self.token_ids.extend(piece.ids)
            n += len(piece.ids)
            if piece.vision is not None:
                self.vision = piece.vision if self.vision is None else self.vision + piece.vision
                self.env_images += 1
        self.images_dropped += sum(p.vision is not None for p in pieces) - sum(p.vision is not None for p in kept)
        self.env_tokens += n
        return n

    def trajectory(self) -> Trajectory:
        r = self.request
        return Trajectory(
            token_ids=list(self.token_ids), prompt_len=self.prompt_len, action_ranges=list(self.action_ranges),
            rollout_logprobs=list(self.logprobs), finish_reason="length" if self.truncated else "stop",
            label=r.label, datasource=r.datasource, prompt_index=r.prompt_index, sample_index=r.sample_index,
            extra=self._extra(), routed_experts=self.routing, vision=self.vision,
            engine_turns=None if self.engine_turns is None else list(self.engine_turns),
        )

    def _extra(self) -> dict[str, float]:
        extra = {"agent_turns": float(self.turns), "agent_env_tokens": float(self.env_tokens)}
        if getattr(self.ctx.tokenizer, "image_processor", None) is not None:  # a VLM actor: every sample logs them
            extra.update(agent_env_images=float(self.env_images), agent_images_dropped=float(self.images_dropped))
        return extra


def merge_routing(old, new):
    """One routing record over a growing token sequence: where both calls computed a token, the earlier
    record wins (it produced the earlier action, and with a prefix cache the later call reused it)."""
    if new is None or old is None:
        return new if old is None else old
    merged = new.clone()
    n = min(len(old), len(new))
    merged[:n] = old[:n].where(old[:n] >= 0, new[:n])
    return merged


class EpisodeContext:
    """Shared by the episodes of one ``execute_batch``: engine front, tokenizer, limits."""

    def __init__(self, engine: BatchingEngine, tokenizer, settings: AgentSettings, tokenizer_lock=None,
                 env_pool: "EnvThreadPool | None" = None):
        self.engine, self.tokenizer, self.settings = engine, tokenizer, settings
        self.semaphore = asyncio.Semaphore(max(1, settings.env_concurrency))
        self.env_pool = env_pool or EnvThreadPool(settings.env_concurrency, settings.max_stuck_threads)
        """Where synchronous environment code runs (the executor's pool, shared by its batches)."""
        self.lock = tokenizer_lock or threading.RLock()
        self.env_seconds = 0.0

    def encode(self, text: str) -> list[int]:
        with self.lock:
            return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        with self.lock:
            return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                                         clean_up_tokenization_spaces=False)

    async def call(self, fn: Callable, *args, what: str, timeout: float | None = None, **kwargs) -> Any:
        """Call environment code (async, or sync in a thread of :attr:`env_pool`) under the concurrency
        limit and the per-call timeout; a hang or an exception becomes an :class:`AgentError` naming
        ``what`` (a hung sync call abandons its thread; too many of those raise
        :class:`EnvironmentStuckError`)."""
        timeout = self.settings.step_timeout if timeout is None else timeout
        async with self.semaphore:
            t0 = time.perf_counter()
            try:
                if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
                    result = await asyncio.wait_for(fn(*args, **kwargs), timeout)
                else:
                    result = await self.env_pool.run(fn, args, kwargs, timeout=timeout, what=what)
                    if inspect.isawaitable(result):  # a sync function that returned a coroutine
                        left = max(timeout - (time.perf_counter() - t0), 1e-3)
                        result = await asyncio.wait_for(result, left)
            except asyncio.TimeoutError:
                raise AgentError(f"{what} did not return within {timeout:g} s (--train.agent_step_timeout)") from None
            except AgentError:
                raise
            except Exception as err:  # noqa: BLE001 - user code: report it with context
                raise AgentError(f"{what} raised {type(err).__name__}: {err}") from err
            finally:
                self.env_seconds += time.perf_counter() - t0
        return result

    async def guard(self, awaitable, *, what: str, timeout: float | None = None) -> Any:
        """Await ``awaitable`` (e.g. a tool call) under the concurrency limit and per-call timeout."""
        async def run():
            return await awaitable
        return await self.call(run, what=what, timeout=timeout)


# --------------------------------------------------------------------------------------------- executor


class EpisodeExecutor:
    """Base of the multi-turn, OpenAI-server and registry executors: subclasses implement
    :meth:`run_episode`; this class runs a batch concurrently and handles failures."""

    tokenizer = None
    reward_source = None
    settings = AgentSettings()
    name = "agent"

    def configure(self, *, tokenizer, reward_source=None, settings: AgentSettings | None = None) -> "EpisodeExecutor":
        """Called by the trainer builder (user subclasses keep OpenRLHF's argument-free ``__init__``)."""
        self.tokenizer, self.reward_source = tokenizer, reward_source
        self.settings = settings or AgentSettings()
        self._tokenizer_lock = threading.RLock()
        self.last_batch_sizes: list[int] = []
        pool = getattr(self, "_env_pool", None)
        if pool is None:
            self._env_pool = EnvThreadPool(self.settings.env_concurrency, self.settings.max_stuck_threads,
                                           self.env_name)
        else:  # reconfigured: same threads (and stuck count), new limits
            pool.configure(max_threads=self.settings.env_concurrency, max_stuck=self.settings.max_stuck_threads,
                           env_name=self.env_name)
        return self

    @property
    def env_name(self) -> str:
        """How errors name the environment: its class (``agent_instance_cls``) or this executor's."""
        target = getattr(self, "agent_instance_cls", None) or type(self)
        return f"environment class {getattr(target, '__qualname__', target)}"

    @property
    def env_pool(self) -> "EnvThreadPool":
        """The threads this executor's synchronous environment code runs in (see :class:`EnvThreadPool`)."""
        pool = getattr(self, "_env_pool", None)
        if pool is None:
            pool = self._env_pool = EnvThreadPool(self.settings.env_concurrency, self.settings.max_stuck_threads,
                                                  self.env_name)
        return pool

    async def run_episode(self, ep: Episode, ctx: EpisodeContext) -> Trajectory:
        raise NotImplementedError

    async def execute(self, request: PromptRequest, sampling: SamplingParams, engine) -> Trajectory:
        return (await self.execute_batch([request], [sampling], engine))[0]

    async def execute_batch(self, requests: Sequence[PromptRequest], sampling: Sequence[SamplingParams], engine
                            ) -> list[Trajectory]:
        if self.tokenizer is None:
            raise AgentError(f"{type(self).__name__} was not configured (call .configure(tokenizer=...))")
        batcher = BatchingEngine(engine)
        ctx = EpisodeContext(batcher, self.tokenizer, self.settings, getattr(self, "_tokenizer_lock", None),
                             env_pool=self.env_pool)
        await self.before_batch(ctx)
        try:
            tasks = [asyncio.ensure_future(self._one(req, sp, ctx)) for req, sp in zip(requests, sampling)]
            if tasks:
                # a sample only raises with --train.agent_fail_fast or when the run must stop
                # (EnvironmentStuckError): then the other episodes are cancelled
                _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                for t in pending:
                    t.cancel()
                if pending:
                    await asyncio.gather(*pending, return_exceptions=True)
                errors = [t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception()]
                fatal = [e for e in errors if isinstance(e, EnvironmentStuckError)]
                if errors:
                    raise (fatal or errors)[0]
            trajs = [t.result() for t in tasks]
        finally:
            await self.after_batch(ctx)
        stuck = float(self.env_pool.stuck)
        for t in trajs:  # logged as rollout/agent_stuck_threads (the mean over samples is the count)
            t.extra["agent_stuck_threads"] = stuck
        self.last_batch_sizes = list(batcher.batches)
        ok = [t for t in trajs if t.drop_reason is None]
        if ok and self.reward_source is not None:
            await self.add_source_rewards(ok)
        await self.finish_batch(trajs, list(requests), ctx)
        return trajs

    async def before_batch(self, ctx: EpisodeContext) -> None:
        pass

    async def after_batch(self, ctx: EpisodeContext) -> None:
        pass

    async def finish_batch(self, trajs: list[Trajectory], requests: list[PromptRequest], ctx: EpisodeContext) -> None:
        """Hook after every episode finished (the registry applies its per-experience filters)."""

    async def _one(self, req: PromptRequest, sp: SamplingParams, ctx: EpisodeContext) -> Trajectory:
        ep = Episode(ctx, req, sp)
        t0 = time.perf_counter()
        try:
            traj = await asyncio.wait_for(self.run_episode(ep, ctx), self.settings.episode_timeout)
        except EnvironmentStuckError:
            raise  # the run stops: never a dropped sample
        except asyncio.TimeoutError:
            err = AgentError(f"{self.name}: {sample_id(req)}: episode did not finish within "
                             f"{self.settings.episode_timeout:g} s (--train.agent_episode_timeout)")
            return self._failed(req, err)
        except AgentError as err:
            return self._failed(req, AgentError(f"{self.name}: {sample_id(req)}: {err}"))
        except Exception as err:  # noqa: BLE001
            return self._failed(req, AgentError(f"{self.name}: {sample_id(req)}: {type(err).__name__}: {err}"))
        traj.extra.setdefault("agent_episode_seconds", time.perf_counter() - t0)
        return traj

    def _failed(self, req: PromptRequest, err: AgentError) -> Trajectory:
        if self.settings.fail_fast:
            raise err
        print(f"[rlhforge] {err} (its prompt group is dropped from the batch; --train.agent_fail_fast stops instead)")
        return Trajectory(token_ids=list(req.prompt_ids), prompt_len=len(req.prompt_ids), action_ranges=[],
                          rollout_logprobs=[], finish_reason="stop", label=req.label, datasource=req.datasource,
                          prompt_index=req.prompt_index, sample_index=req.sample_index, drop_reason="env_error",
                          error=str(err))

    async def add_source_rewards(self, trajs: list[Trajectory]) -> None:
        """With ``--reward.*`` set as well: the reward source scores the whole trajectory; its reward is
        added to the environment's and its score replaces the environment's."""
        from rlhforge.agents.single_turn import SingleTurnExecutor

        env_rewards = [t.reward or 0.0 for t in trajs]
        env_extra = [dict(t.extra) for t in trajs]
        await SingleTurnExecutor(self.tokenizer, self.reward_source).score(trajs)
        for t, r, extra in zip(trajs, env_rewards, env_extra):
            t.extra = {**extra, **t.extra, "env_reward": r}
            t.reward = r + t.reward

    def close(self) -> None:
        pool = getattr(self, "_env_pool", None)
        if pool is not None:
            pool.close()
            self._env_pool = None


# --------------------------------------------------------------------------------------------- trainer helper


def drop_failed_groups(trajs: Sequence[Trajectory], n: int) -> tuple[list[Trajectory], dict[str, float]]:
    """Remove every prompt group (``n`` consecutive samples) that holds a trajectory with a
    ``drop_reason``; returns the kept trajectories and counts (``agent_failed_samples``,
    ``agent_dropped_groups``, ``<reason>_groups``)."""
    kept: list[Trajectory] = []
    counts: dict[str, float] = {}
    n = max(n, 1)
    for g in range(0, len(trajs), n):
        group = list(trajs[g : g + n])
        reasons = {t.drop_reason for t in group if t.drop_reason is not None}
        if not reasons:
            kept.extend(group)
            continue
        counts["agent_dropped_groups"] = counts.get("agent_dropped_groups", 0.0) + 1
        counts["agent_failed_samples"] = counts.get("agent_failed_samples", 0.0) + sum(
            t.drop_reason == "env_error" for t in group)
        for reason in reasons:
            counts[f"{reason}_groups"] = counts.get(f"{reason}_groups", 0.0) + 1
    return kept, counts
