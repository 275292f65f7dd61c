"""The reward model(s) as a worker group (``--reward.model_name_or_path`` with Ray workers).

:class:`RewardWorker` is one rank of the ``reward`` group (``--reward.num_nodes`` x
``--reward.num_gpus_per_node`` ranks, placed by :func:`~rlhforge.distributed.placement.plan_placement`,
beside the critic with ``--train.colocate_critic_reward``). Every rank holds every reward model of
the comma-separated list (:class:`~rlhforge.rewards.sources.RewardModels`: the actor's precision,
ZeRO-3 partitioned over the group when the actor runs ZeRO-3, ``--reward.offload`` between uses);
the driver's :class:`RewardGroupScorer` shards the sequences over the ranks with the group's
``map_gather`` and gets ``[sample][model]`` rewards back, which
:class:`~rlhforge.rewards.sources.RewardModelSource` sums.

Without Ray the same :class:`~rlhforge.rewards.sources.RewardModels` run in the driver.
"""

from __future__ import annotations

import os

__all__ = ["RewardWorker", "RewardGroupScorer", "actor_strategy_kind"]


def actor_strategy_kind(cfg) -> str:
    """The strategy the actor trains with (``torch``, ``deepspeed`` or ``fsdp2``), as
    :func:`~rlhforge.backend.factory.build_strategy` picks it for the actor's ranks: frozen models
    (reference, reward models) are prepared the same way so their numerics match the actor's."""
    from rlhforge.config.rl_rules import uses_ray
    from rlhforge.config.validation import resolved_strategy

    in_ray = os.environ.get("RLHFORGE_RAY_WORKER") == "1" or uses_ray(cfg)
    world = cfg.actor.num_nodes * cfg.actor.num_gpus_per_node if in_ray else 1
    return resolved_strategy(cfg.ds.strategy, world)


class RewardWorker:
    """One rank of the reward group: every reward model of ``--reward.model_name_or_path``."""

    def __init__(self, cfg, tokenizer, device=None):
        from rlhforge.backend.device import dist_info, resolve_device
        from rlhforge.rewards.sources import RewardModels, reward_ds_config, reward_model_config, reward_model_paths

        device = device if device is not None else resolve_device(cfg.train.device, dist_info().local_rank)
        self.device = device
        self.paths = reward_model_paths(cfg.reward.model_name_or_path)
        self.models = RewardModels(self.paths, reward_model_config(cfg), reward_ds_config(cfg), device,
                                   pad_token_id=tokenizer.pad_token_id, normalize=cfg.reward.normalize_enable,
                                   micro_batch_size=cfg.rollout.micro_batch_size,
                                   value_head_prefix=cfg.ds.value_head_prefix, kind=actor_strategy_kind(cfg),
                                   offload=cfg.reward.offload, max_tokens=cfg.token_budgets()[1])

    def score(self, seqs) -> list[list[float]]:
        """``[sample][model]`` rewards of this rank's shard of token-id sequences."""
        return self.models.score(list(seqs))

    def offload_stats(self) -> list[dict]:
        return self.models.offload_stats()

    def release_cached_memory(self) -> int:
        from rlhforge.backend.device import release_cached_memory

        return release_cached_memory(self.device)


class RewardGroupScorer:
    """The driver's end: ``score(seqs)`` shards ``seqs`` over the reward group's ranks."""

    def __init__(self, group):
        self.group = group

    def score(self, seqs) -> list[list[float]]:
        return self.group.map_gather("score", list(seqs))
