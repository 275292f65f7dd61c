"""Where ``rlhforge rl``'s models run, and the start-up rules of that layout (part of
:func:`rlhforge.config.rl_rules.validate_rl`; ``cfg`` is an :class:`~rlhforge.config.rl.RLConfig`).

- :func:`uses_ray`, :func:`uses_reward_model`, :func:`rl_strategy`: Ray actor groups or this process,
  reward model(s) or not, the workers' training strategy;
- :func:`validate_workers`: ring attention, AutoTP, worker counts, colocation, async training and the
  batch divisibility of the Ray groups, refused with :class:`ConfigError` (exit 2) naming the flags.
"""

from __future__ import annotations

from rlhforge.config.parsing import ConfigError
from rlhforge.config.validation import resolved_strategy, validate_fp16

__all__ = ["uses_ray", "uses_reward_model", "rl_strategy", "validate_workers"]


def uses_ray(cfg) -> bool:
    """Whether the models run as Ray actor groups (``--train.workers``)."""
    import os

    if cfg.train.workers != "auto":
        return cfg.train.workers == "ray"
    sizes = [cfg.actor.num_nodes * cfg.actor.num_gpus_per_node]
    if cfg.uses_critic:
        sizes.append(cfg.critic.num_nodes * cfg.critic.num_gpus_per_node)
    if cfg.uses_ref:
        sizes.append(cfg.ref.num_nodes * cfg.ref.num_gpus_per_node)
    if cfg.uses_teacher:
        sizes.append(cfg.teacher.num_nodes * cfg.teacher.num_gpus_per_node)
    if uses_reward_model(cfg):
        sizes.append(cfg.reward.num_nodes * cfg.reward.num_gpus_per_node)
    return max(sizes) > 1 or bool(os.environ.get("RAY_ADDRESS"))


def uses_reward_model(cfg) -> bool:
    """Whether rewards come from reward model(s) (``--reward.model_name_or_path``; a ``--reward.remote_url``
    wins): with Ray workers they run in a Ray ``reward`` group, else in the driver."""
    return bool(cfg.reward.model_name_or_path) and not cfg.reward.remote_url


def rl_strategy(cfg) -> str:
    """The training strategy the actor/critic workers get (``deepspeed`` if any group does)."""
    if cfg.ds.strategy != "auto":
        return cfg.ds.strategy
    if not uses_ray(cfg):
        return "torch"  # one in-process worker per model
    sizes = [cfg.actor.num_nodes * cfg.actor.num_gpus_per_node]
    if cfg.uses_critic:
        sizes.append(cfg.critic.num_nodes * cfg.critic.num_gpus_per_node)
    return resolved_strategy("auto", max(sizes))


def validate_workers(cfg) -> None:
    """The layout rules, in order: ring attention before the batch arithmetic (which divides by the
    ring), then tensor parallelism (... and by the tensor-parallel size), then the worker groups."""
    _validate_ring_attention(cfg)
    _validate_tensor_parallel(cfg)
    _validate_distributed(cfg)
    _validate_sync_probe(cfg)


def _validate_sync_probe(cfg) -> None:
    """The post-sync effect check (rlhforge.backend.sync_probe): a probe of 2+ tokens, a positive bound."""
    t = cfg.train
    if t.sync_probe_tokens < 2:
        raise ConfigError(f"--train.sync_probe_tokens must be >= 2 (got {t.sync_probe_tokens}): the first token of "
                          "a sequence has no log-prob")
    if t.sync_probe_bound is not None and not t.sync_probe_bound > 0:
        raise ConfigError(f"--train.sync_probe_bound must be > 0 (got {t.sync_probe_bound}); leave it out for the "
                          "default of the run's precision")


def _validate_ring_attention(cfg) -> None:
    """``--ds.ring_attn_size N``: the actor's Ray workers form rings of N ranks (docs/long_context.md)."""
    from rlhforge.config.validation import validate_ring_attention

    size = cfg.ds.ring_attn_size
    actor_n = cfg.actor.num_nodes * cfg.actor.num_gpus_per_node
    if size > 1 and not uses_ray(cfg):
        raise ConfigError(f"--ds.ring_attn_size {size} splits each sequence over {size} actor ranks, which are Ray "
                          f"workers: set --actor.num_gpus_per_node (x --actor.num_nodes) to a multiple of {size}")
    validate_ring_attention(cfg.ds, actor_n)
    if size > 1 and cfg.train.routing_replay:
        raise ConfigError(f"--train.routing_replay cannot be combined with --ds.ring_attn_size {size} (the routing "
                          "is recorded per full sequence, each ring rank runs a slice)")
    if size > 1 and cfg.actor.aux_loss_coef:
        raise ConfigError(f"--actor.aux_loss_coef cannot be combined with --ds.ring_attn_size {size} (each ring "
                          "rank routes a slice of the sequence)")


def _validate_tensor_parallel(cfg) -> None:
    """``--ds.tensor_parallel_size N``: DeepSpeed AutoTP in the actor's Ray workers (docs/parallelism.md)."""
    from rlhforge.config.validation import validate_tensor_parallel

    tp = cfg.ds.tensor_parallel_size
    if tp > 1 and not uses_ray(cfg):
        raise ConfigError(f"--ds.tensor_parallel_size {tp} splits the actor over {tp} ranks, which are Ray workers: "
                          f"set --actor.num_gpus_per_node (x --actor.num_nodes) to a multiple of {tp}")
    validate_tensor_parallel(cfg.ds, cfg.actor.num_nodes * cfg.actor.num_gpus_per_node)
    if tp > 1 and cfg.uses_critic:
        raise ConfigError(f"--ds.tensor_parallel_size {tp} runs AutoTP in the actor only; the critic would get it too "
                          "in OpenRLHF, which rlhforge does not build: use a critic-free estimator (group_norm, rloo, "
                          "reinforce_baseline, dr_grpo, reinforce) or --ds.tensor_parallel_size 1")
    if tp > 1 and cfg.ds.lora.rank > 0:
        raise ConfigError(f"--ds.tensor_parallel_size {tp} with LoRA (--ds.lora.rank {cfg.ds.lora.rank}): rlhforge "
                          "has no LoRA adapters on AutoTP-split layers (nor their merged weight sync); use one of the two")


def _on_cuda(device: str) -> bool:
    if device == "cpu":
        return False
    import torch

    return device == "cuda" or torch.cuda.is_available()


def _refuse_bf16_optimizer_sleep(cfg) -> None:
    """DeepSpeed (0.19) wraps bf16 + ZeRO-1 + fp32 gradient accumulation (no CPU offload) in its
    ``BF16_Optimizer``, which has no ``offload_states``: ``--ds.enable_sleep``'s first offload, right after
    start-up, would raise AttributeError (gpu-review-2 F9)."""
    ds = cfg.ds
    bf16 = ds.param_dtype == "bf16" or ds.param_dtype == "auto" and _on_cuda(cfg.train.device)
    if (ds.enable_sleep and rl_strategy(cfg) == "deepspeed" and ds.zero_stage == 1 and bf16 and not ds.adam_offload
            and str(ds.grad_accum_dtype or "").lower() in ("fp32", "float32")):
        raise ConfigError("--ds.enable_sleep with --ds.zero_stage 1, bf16 and --ds.grad_accum_dtype fp32: DeepSpeed "
                          "trains that combination with its BF16_Optimizer, which cannot offload its states (no "
                          "offload_states); use --ds.zero_stage 2 or 3, or drop --ds.grad_accum_dtype fp32")


def _refuse_expandable_segments(cfg) -> None:
    """CUDA-IPC weight sync (GPU engines on the actor's GPUs) shares the bucket buffers the actor allocates;
    with ``expandable_segments`` those live in segments that ``reduce_tensor`` can only export through
    ``pidfd_getfd``, which unprivileged containers and older kernels refuse (pytorch#165685, OpenRLHF#957):
    the first sync fails. Refused at start-up, naming the variable (gpu-review-2 F12)."""
    import os

    v = cfg.vllm
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    expandable = any(part.replace(" ", "").lower() == "expandable_segments:true" for part in conf.split(","))
    if (expandable and cfg.train.colocate_all and (v.num_engines or 0) > 0 and not v.sync_with_ray
            and _on_cuda(cfg.train.device)):
        raise ConfigError("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True with --train.colocate_all: the engines "
                          "load the weights by CUDA IPC from the actor's buffers, which that allocator setting cannot "
                          "share in many containers (pidfd_getfd; pytorch#165685); unset it for the trainer, or use "
                          "--vllm.sync_with_ray")


def _validate_distributed(cfg) -> None:
    t = cfg.train
    validate_fp16(cfg.ds, rl_strategy(cfg))
    if cfg.ds.enable_sleep and rl_strategy(cfg) == "deepspeed" and cfg.ds.zero_stage == 0:
        raise ConfigError("--ds.enable_sleep under DeepSpeed needs --ds.zero_stage 1-3 (DeepSpeed's offload_states "
                          "has no ZeRO-0 optimizer); use --ds.zero_stage 1-3, or --ds.strategy torch")
    _refuse_bf16_optimizer_sleep(cfg)
    _refuse_expandable_segments(cfg)
    if t.async_enable and t.colocate_all:
        raise ConfigError("--train.async_enable with --train.colocate_all: async training generates while the "
                          "actor trains, and colocated models and engines take turns on the same devices (as in "
                          "OpenRLHF, one or the other)")
    for name in ("actor", "critic", "ref"):
        sec = getattr(cfg, name)
        if sec.num_nodes < 1 or sec.num_gpus_per_node < 1:
            raise ConfigError(f"--{name}.num_nodes and --{name}.num_gpus_per_node must be >= 1 "
                              f"(got {sec.num_nodes} and {sec.num_gpus_per_node})")
    if t.async_queue_size < 1:
        raise ConfigError(f"--train.async_queue_size must be >= 1 (got {t.async_queue_size})")
    if (t.async_queue_size != 1 or t.partial_rollout_enable) and not t.async_enable:
        which = "--train.partial_rollout_enable" if t.partial_rollout_enable else "--train.async_queue_size"
        raise ConfigError(f"{which} needs --train.async_enable")
    if t.partial_rollout_enable and cfg.vllm.num_engines:
        raise ConfigError("--train.partial_rollout_enable pauses generation between decoding steps, which the HF "
                          "engine does; with --vllm.num_engines the generator finishes each batch before a weight "
                          "sync (drop --train.partial_rollout_enable)")
    for name in ("num_nodes", "num_gpus_per_node"):
        if getattr(cfg.reward, name) < 1:
            raise ConfigError(f"--reward.{name} must be >= 1 (got {getattr(cfg.reward, name)})")
    critic_n, reward_n = (cfg.critic.num_nodes * cfg.critic.num_gpus_per_node,
                          cfg.reward.num_nodes * cfg.reward.num_gpus_per_node)
    if (t.colocate_critic_reward and not t.colocate_all and cfg.uses_critic and uses_reward_model(cfg)
            and uses_ray(cfg) and critic_n != reward_n):
        raise ConfigError(f"--train.colocate_critic_reward needs as many reward workers as critic workers (critic "
                          f"{critic_n}, reward {reward_n}: --reward.num_nodes x --reward.num_gpus_per_node)")
    world = cfg.actor.num_nodes * cfg.actor.num_gpus_per_node
    if uses_ray(cfg):
        if cfg.ds.load_in_4bit:
            raise ConfigError("QLoRA (--ds.load_in_4bit) with Ray worker groups would need its 4-bit base dequantised "
                              "for the merged weight sync; train QLoRA with one worker (--train.workers local)")
        per_step = cfg.train.batch_size
        ring = cfg.ds.ring_attn_size if cfg.ds.ring_attn_size > 1 and world % cfg.ds.ring_attn_size == 0 else 1
        ring *= cfg.ds.tensor_parallel_size if world % (ring * cfg.ds.tensor_parallel_size) == 0 else 1  # AutoTP too
        groups = [("actor data-parallel" if ring > 1 else "actor", world // ring)]  # a ring / TP group shares samples
        if cfg.uses_critic:
            groups.append(("critic", cfg.critic.num_nodes * cfg.critic.num_gpus_per_node))
        mb = cfg.planned_micro_batch_size  # 1 with token budgets
        for name, n in groups:
            if per_step % (mb * n):
                raise ConfigError(
                    f"--train.batch_size {per_step} must be divisible by --train.micro_batch_size x {name} workers "
                    f"({mb} x {n} = {mb * n})")
    elif t.workers == "local" and world > 1:
        raise ConfigError(f"--train.workers local runs one worker per model, but the actor asks for {world} "
                          f"(--actor.num_nodes {cfg.actor.num_nodes} x --actor.num_gpus_per_node "
                          f"{cfg.actor.num_gpus_per_node}); use --train.workers ray")
    if t.plan_only and t.workers == "local":
        raise ConfigError("--train.plan_only plans the Ray placement groups, but --train.workers local runs every model "
                          "in this process; drop --train.workers local (or use --train.workers ray)")
