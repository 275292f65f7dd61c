"""``rlhforge rl``'s ``--train.*`` section (:class:`RLTrainConfig`: batching and the loop), apart from
:mod:`rlhforge.config.rl` for size; re-exported there."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlhforge.config.parsing import secret


@dataclass(frozen=True)
class RLTrainConfig:
    """Batching and loop. ``batch_size`` is global (samples per optimizer step)."""

    batch_size: int = 128
    """Samples (prompt x sample pairs) per optimizer step; a rollout of ``rollout.batch_size x
    n_samples_per_prompt`` samples gives that many / batch_size optimizer steps per epoch."""
    micro_batch_size: int = 1
    """Samples per forward/backward on one device."""
    max_epochs: int = 1
    """Passes over each rollout (PPO epochs)."""
    num_episodes: int = 1
    """Passes over the prompt dataset."""
    max_steps: int = -1
    """Stop after this many RL steps (-1: all episodes). rlhforge-specific."""
    seed: int = 42
    """Seed for data order, initialisation and sampling (every request gets its own derived seed)."""
    full_determinism_enable: bool = False
    """Use deterministic algorithms."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the workers (auto: cuda when available). rlhforge-specific."""
    gpu_memory_gib: float | None = None
    """Memory of one GPU, for the start-up check of vLLM engines that share GPUs with models
    (``--train.colocate_all``, or vLLM beside the actor on one GPU). Default: measured on a GPU (the
    driver's, else a one-off Ray task on the cluster's), or 80 where no GPU can be seen (a CPU cluster
    declaring GPUs to plan a GPU run). rlhforge-specific; docs/distributed.md."""
    preempt_grace_s: float = 120.0
    """SIGTERM/SIGINT to the driver: wait at most this many seconds for the current RL step to end,
    then save a checkpoint (through the worker groups) and exit (143 / 130); if the step does not end
    in time, exit without saving (the last good checkpoint stays). 0: no limit. rlhforge-specific;
    docs/reliability.md."""
    max_skipped_steps_in_row: int = 3
    """Optimizer steps (actor or critic) with a non-finite loss or gradient norm are skipped (counted
    in ``train/skipped_steps``); this many in a row of one model stop the run (exit 5) naming the
    last good checkpoint. 0: never stop. rlhforge-specific; docs/reliability.md."""
    workers: Literal["auto", "local", "ray"] = "auto"
    """Where the models run: ``local`` (all in this process), ``ray`` (Ray actor groups, one per
    model, ``num_nodes x num_gpus_per_node`` ranks each), ``auto`` (ray when any group has more than
    one worker or ``RAY_ADDRESS`` names a cluster). rlhforge-specific; docs/distributed.md."""
    colocate_actor_ref: bool = False
    """Ray: actor and reference share one placement group (equal sizes)."""
    colocate_critic_reward: bool = False
    """Ray: critic and reward models share one placement group (equal sizes)."""
    colocate_all: bool = False
    """Ray: actor, ref and critic share one placement group (the hybrid engine); needed on a CPU
    cluster smaller than the sum of the groups."""
    async_enable: bool = False
    """Generate the next batches while training on this one (staleness <= async_queue_size)."""
    async_queue_size: int = 1
    """Async: how many weight versions generation may run ahead of training (>= 1)."""
    partial_rollout_enable: bool = False
    """Async: weight syncs pause in-flight generation (between decoding steps) instead of waiting
    for the batch to finish; generation resumes with the new weights (HF engine)."""
    agent_func_path: str | None = None
    """Agent file (docs/agents.md): a multi-turn environment (``AgentInstance``/``AgentExecutor``,
    OpenRLHF's API), an OpenAI-client agent (``run_agent(prompt, label, client)``) or task/env
    registrations; ``registry`` for the built-in tasks (math, math_tir). None: single turn."""
    agent_fail_fast: bool = False
    """Stop the run at the first failing environment/agent sample (default: drop its prompt group
    from the batch and count it in ``rollout/agent_dropped_groups``)."""
    agent_step_timeout: float = 60.0
    """Seconds one environment call (reset, step, tool call, task reward) may take. rlhforge-specific."""
    agent_episode_timeout: float = 1800.0
    """Seconds one whole episode may take, generation included (an OpenAI-client agent's
    ``run_agent``). rlhforge-specific."""
    agent_env_concurrency: int = 64
    """Environment calls running at once (OpenAI-client agents: episodes at once). rlhforge-specific."""
    agent_max_stuck_threads: int = 16
    """Plain (non-async) environment calls that hung past ``agent_step_timeout`` leave their thread
    behind (it cannot be killed; counted in ``rollout/agent_stuck_threads``); more than this many
    stuck at once stop the run (exit 3) naming the environment class and the count. rlhforge-specific."""
    sandbox_url: str | None = None
    """Where the built-in ``math_tir`` tool environment (and user envs calling
    ``rlhforge.agents.registry.builtin.sandbox()``) runs code: ``http://HOST:PORT`` of ``rlhforge
    serve-sandbox`` servers (comma-separated: failover) or ``endpoints:FILE`` (re-read on every call);
    None: ``$RLHFORGE_SANDBOX_URL``, else a local sandbox. The key: ``$RLHFORGE_SANDBOX_API_KEY``.
    rlhforge-specific (the agentic fork's code server)."""
    check_tokens: bool = False
    """Prove every step that the tokens trained on are the tokens the engine saw and produced, turn by
    turn (no re-tokenisation drift; feedback masked; docs/reliability.md): a mismatch stops the run
    naming the sample, turn and position (exit 3). Costs a copy of each turn's input. rlhforge-specific."""
    sync_probe_bound: float | None = None
    """After every weight sync (always on) the engines score a fixed probe (the run's first prompts) and
    their log-probs are compared with the actor's on the same tokens (``sync/probe_logprob_diff``: mean
    absolute per-token difference, the largest over engines). Above this bound the run stops (exit 4)
    naming the engine and the sync: the weights arrived but are not in effect. None: 1e-3 when engines
    and trainer run in fp32, 0.1 when either runs in bf16/fp16 (docs/rl.md, "Weights in effect after
    every sync"). rlhforge-specific."""
    sync_probe_tokens: int = 128
    """Tokens of that probe (at least 2): the first prompts of the dataset, in order, cut at this many."""
    agent_openai_prefix_mismatch: Literal["error", "new_segment"] = "error"
    """OpenAI-client agents: a request whose prompt does not extend the recorded conversation fails
    the sample (``error``) or restarts the trajectory from it (``new_segment``: only the last
    segment is trained on). rlhforge-specific."""
    agent_server_max_body_mb: float = 8.0
    """Agent servers (OpenAI-compatible and token routes): largest request body in MiB; a larger one is
    refused (413) before it is read (docs/security.md). rlhforge-specific."""
    agent_server_max_message_chars: int = 262_144
    """Agent servers: longest text of one chat message, and longest new text one request adds to its
    session (what the shared tokenizer works on for it); more is a 413 before tokenising. rlhforge-specific."""
    agent_server_api_key: str | None = secret()
    """Agent servers: require ``Authorization: Bearer KEY`` (or ``X-API-Key``) on every route but ``/health``
    (the trainer's own clients send it). Default: ``$RLHFORGE_AGENT_API_KEY`` if set, else no key (the
    servers bind 127.0.0.1). rlhforge-specific."""
    dynamic_batch_enable: bool = False
    """Token-budget micro-batches instead of ``micro_batch_size`` samples (needs ``--ds.packing_samples``):
    each rank's share of a step is split into the max over the DP ranks of its first-fit count under
    ``max_tokens_per_gpu``, balanced by length (docs/performance.md, "Dynamic batching")."""
    max_tokens_per_gpu: int = 16192
    """With ``--train.dynamic_batch_enable``: token budget per device of a training micro-batch."""
    plan_only: bool = False
    """Ray: build the placement groups, print the plan (bundles, GPU fractions, memory per device for
    every model and engine) and exit 0 without loading any weights. rlhforge-specific."""
    routing_replay: bool = False
    """MoE: the actor's old-log-prob and training forwards reuse the experts the rollout engine chose
    for every token (the engine records them; docs/models.md). HF engine; vLLM where it returns
    routed experts (GPU). rlhforge-specific (veRL/slime's rollout routing replay; OpenRLHF has none)."""
    enable_ema: bool = False
    """Keep an EMA of the actor's weights (updated after each optimizer step); the final export and
    intermediate HF saves are the EMA, generation engines get the live weights (docs/optim.md)."""
    ema_beta: float = 0.992
    """EMA decay: ``ema = beta * ema + (1 - beta) * weights`` (needs ``enable_ema``)."""
