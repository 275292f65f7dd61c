"""All derived batch counts come from here (one tested function).

Algorithmic sizes are global (``train.batch_size`` samples per optimizer step over all ranks);
performance knobs are per device (``train.micro_batch_size``, ``train.max_tokens_per_device``).
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhforge.config.parsing import ConfigError


@dataclass(frozen=True)
class BatchPlan:
    batch_size: int
    """Samples per optimizer step, all ranks together."""
    world_size: int
    """Data-parallel ranks (ranks / ``ds.ring_attn_size``: the ranks of one ring share their samples)."""
    micro_batch_size: int
    """Samples per micro-batch on one device (upper bound when a token budget is used)."""
    per_rank_batch: int
    """Samples each rank processes per optimizer step."""
    grad_accum_steps: int
    """Micro-batches per optimizer step on each rank (fixed-size micro-batching)."""
    steps_per_epoch: int
    """Optimizer steps per pass over the data (a trailing partial batch is dropped)."""
    total_steps: int
    """Optimizer steps in the whole run."""


def plan_batches(
    *, num_samples: int, batch_size: int, micro_batch_size: int, world_size: int, max_epochs: int, max_steps: int = -1,
    ring_size: int = 1,
) -> BatchPlan:
    """Derive gradient accumulation and step counts, or fail showing the arithmetic.

    ``world_size`` ranks in rings of ``ring_size`` (``--ds.ring_attn_size``) are ``world_size / ring_size``
    data-parallel ranks: that is what the batch is divided by."""
    if ring_size < 1 or world_size % ring_size:
        raise ConfigError(f"--ds.ring_attn_size {ring_size} must divide the {world_size} training ranks")
    ranks = f"{world_size // ring_size} data-parallel ranks ({world_size} ranks / ring {ring_size})" \
        if ring_size > 1 else f"{world_size} ranks"
    world_size //= ring_size
    if batch_size <= 0 or micro_batch_size <= 0:
        raise ConfigError(
            f"train.batch_size ({batch_size}) and train.micro_batch_size ({micro_batch_size}) must be positive"
        )
    if batch_size % (micro_batch_size * world_size):
        raise ConfigError(
            f"train.batch_size {batch_size} is not divisible by train.micro_batch_size {micro_batch_size} x "
            f"{ranks} = {micro_batch_size * world_size}"
        )
    per_rank = batch_size // world_size
    steps_per_epoch = num_samples // batch_size
    if steps_per_epoch == 0:
        raise ConfigError(
            f"the training data has {num_samples} samples, fewer than one optimizer step "
            f"(train.batch_size {batch_size}); lower train.batch_size or add data"
        )
    total = steps_per_epoch * max_epochs
    if max_steps > 0:
        total = min(total, max_steps)
    return BatchPlan(
        batch_size=batch_size,
        world_size=world_size,
        micro_batch_size=micro_batch_size,
        per_rank_batch=per_rank,
        grad_accum_steps=per_rank // micro_batch_size,
        steps_per_epoch=steps_per_epoch,
        total_steps=total,
    )


@dataclass(frozen=True)
class RLBatchPlan:
    """The RL run's batch plan: derived counts of one RL step (:func:`plan_rl_batches`), computed once from
    the config (:func:`plan_rl_run`) and handed whole to the trainer and the worker groups."""

    rollout_samples: int
    """Samples generated per RL step: rollout.batch_size prompts x n_samples_per_prompt."""
    batch_size: int
    """Samples per optimizer step, all ranks together (``train.batch_size``, as :attr:`BatchPlan.batch_size`)."""
    updates_per_epoch: int
    """Optimizer steps per pass over one rollout."""
    updates_per_step: int
    """Optimizer steps per RL step (x max_epochs)."""
    grad_accum_steps: int
    """Micro-batches per optimizer step on each rank."""
    steps_per_episode: int
    """RL steps per pass over the prompts (0 when the prompt count is not known yet)."""
    total_steps: int
    """RL steps in the whole run (0 when the prompt count is not known yet)."""
    total_updates: int
    """Optimizer steps in the whole run (for the lr schedule)."""
    micro_batch_size: int
    """Samples per micro-batch on one device (``train.micro_batch_size``; 1 with token budgets)."""
    world_size: int
    """Data-parallel actor ranks (ranks / (ring x tensor-parallel size))."""
    train_tokens: int | None = None
    """Token budget of a training micro-batch (``--train.max_tokens_per_gpu`` with dynamic batching; None: off)."""
    pass_tokens: int | None = None
    """Token budget of a no-grad pass micro-batch (log-probs, values; None: off)."""

    def strategy_plan(self, world_size: int) -> BatchPlan:
        """The :class:`BatchPlan` of one worker group's strategy (DeepSpeed's micro-batch and accumulation)
        when its optimizer steps are split over ``world_size`` data-parallel ranks: the actor's are
        :attr:`world_size`; a critic group of another size splits the same :attr:`batch_size` over its own."""
        accum = max(self.batch_size // (self.micro_batch_size * world_size), 1)
        total = max(self.total_updates, 1)
        return BatchPlan(batch_size=self.batch_size, world_size=world_size, micro_batch_size=self.micro_batch_size,
                         per_rank_batch=self.micro_batch_size * accum, grad_accum_steps=accum,
                         steps_per_epoch=max(self.updates_per_epoch, 1), total_steps=total)


def plan_rl_batches(
    *, rollout_batch_size: int, n_samples_per_prompt: int, train_batch_size: int, micro_batch_size: int,
    rollout_micro_batch_size: int, world_size: int, num_prompts: int | None, num_episodes: int = 1,
    max_epochs: int = 1, max_steps: int = -1, ring_size: int = 1, tp_size: int = 1,
    token_budgets: tuple[int | None, int | None] = (None, None),
) -> RLBatchPlan:
    """RL counterpart of :func:`plan_batches`: ``rollout.batch_size x n_samples_per_prompt`` samples per
    RL step are cut into optimizer steps of ``train.batch_size`` samples, each of ``micro_batch_size x
    world_size x grad_accum`` samples (``world_size / (ring_size x tp_size)`` data-parallel actor ranks
    with ``--ds.ring_attn_size`` / ``--ds.tensor_parallel_size``: the ranks of one ring or AutoTP group
    share their samples). Fails showing the arithmetic."""
    if ring_size < 1 or world_size % ring_size:
        raise ConfigError(f"--ds.ring_attn_size {ring_size} must divide the {world_size} actor ranks")
    if tp_size < 1 or world_size % (ring_size * tp_size):
        raise ConfigError(f"--ds.tensor_parallel_size {tp_size} must divide the {world_size // ring_size} actor "
                          "ranks per ring" if ring_size > 1 else f"--ds.tensor_parallel_size {tp_size} must divide "
                          f"the {world_size} actor ranks")
    replica = ring_size * tp_size
    what = " x ".join(([f"ring {ring_size}"] if ring_size > 1 else []) + ([f"tensor-parallel {tp_size}"] if tp_size > 1
                                                                           else []))
    ranks = f"{world_size // replica} data-parallel ranks ({world_size} ranks / {what})" \
        if replica > 1 else f"{world_size} ranks"
    world_size //= replica
    for name, value in (("rollout.batch_size", rollout_batch_size), ("rollout.n_samples_per_prompt", n_samples_per_prompt),
                        ("train.batch_size", train_batch_size), ("train.micro_batch_size", micro_batch_size),
                        ("rollout.micro_batch_size", rollout_micro_batch_size), ("train.max_epochs", max_epochs),
                        ("train.num_episodes", num_episodes)):
        if value <= 0:
            raise ConfigError(f"{name} must be positive (got {value})")
    samples = rollout_batch_size * n_samples_per_prompt
    if samples % train_batch_size:
        raise ConfigError(
            f"rollout.batch_size {rollout_batch_size} x rollout.n_samples_per_prompt {n_samples_per_prompt} = "
            f"{samples} samples per step is not divisible by train.batch_size {train_batch_size}"
        )
    if train_batch_size % (micro_batch_size * world_size):
        raise ConfigError(
            f"train.batch_size {train_batch_size} is not divisible by train.micro_batch_size {micro_batch_size} x "
            f"{ranks} = {micro_batch_size * world_size}"
        )
    if samples % world_size:
        raise ConfigError(f"{samples} samples per step do not split over {ranks}")
    updates_per_epoch = samples // train_batch_size
    steps_per_episode = total = 0
    if num_prompts is not None:
        steps_per_episode = num_prompts // rollout_batch_size
        if steps_per_episode == 0:
            raise ConfigError(
                f"the prompt dataset has {num_prompts} prompts, fewer than one RL step "
                f"(rollout.batch_size {rollout_batch_size}); lower rollout.batch_size or add prompts"
            )
        total = steps_per_episode * num_episodes
        if max_steps > 0:
            total = min(total, max_steps)
    return RLBatchPlan(
        rollout_samples=samples, batch_size=train_batch_size, updates_per_epoch=updates_per_epoch,
        updates_per_step=updates_per_epoch * max_epochs,
        grad_accum_steps=train_batch_size // (micro_batch_size * world_size), steps_per_episode=steps_per_episode,
        total_steps=total, total_updates=total * updates_per_epoch * max_epochs,
        micro_batch_size=micro_batch_size, world_size=world_size, train_tokens=token_budgets[0],
        pass_tokens=token_budgets[1],
    )


def plan_rl_run(cfg, *, world_size: int, num_prompts: int | None) -> RLBatchPlan:
    """The RL run's batch plan, computed once from its config (``RLConfig``) over ``world_size`` actor
    ranks; the trainer and the worker groups read it (each strategy's via :meth:`RLBatchPlan.strategy_plan`)."""
    return plan_rl_batches(
        rollout_batch_size=cfg.rollout.batch_size, n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
        train_batch_size=cfg.train.batch_size, micro_batch_size=cfg.planned_micro_batch_size,
        rollout_micro_batch_size=cfg.rollout.micro_batch_size, world_size=world_size, num_prompts=num_prompts,
        ring_size=cfg.ds.ring_attn_size,  # the actor data-parallel size is world / ring
        tp_size=cfg.ds.tensor_parallel_size,  # ... / AutoTP size (backend/autotp.py)
        num_episodes=cfg.train.num_episodes, max_epochs=cfg.train.max_epochs, max_steps=cfg.train.max_steps,
        token_budgets=cfg.token_budgets(),
    )
