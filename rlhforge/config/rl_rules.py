"""Start-up rules of ``rlhforge rl``: features not built yet, validation (``cfg`` is an
:class:`~rlhforge.config.rl.RLConfig`; the OpenRLHF aliases live in :mod:`rlhforge.config.rl_aliases`).

Every accepted flag either works, or is refused here (:class:`ConfigError`, exit 2, one line naming
the flag, before any model is loaded: :data:`_NOT_BUILT`, the rules below and those of the
workers' layout in :mod:`rlhforge.config.rl_workers`), or prints exactly one
``[rlhforge] note: --flag ... has no effect: why`` line (:data:`_NO_EFFECT`, the DeepSpeed-only
``--ds.*`` knobs when no worker runs DeepSpeed). ``tests/config/test_flag_effects.py`` walks every
flag and holds the table.
"""

from __future__ import annotations

from rlhforge.config.deadline import check_deadlines
from rlhforge.config.parsing import ConfigError
from rlhforge.config.validation import (
    check_flash_attention_dtype,
    check_gpu_kernels,
    check_load_in_4bit,
    deepspeed_only_notices,
    muon_notices,
    notice,
    validate_aux_loss_coef,
    validate_experts_implementation,
    validate_fault_limits,
    validate_logging_steps,
)
from rlhforge.config.rl_distill import distill_notices, validate_distill
from rlhforge.config.rl_losses import policy_loss_notices, validate_policy_loss
from rlhforge.config.rl_workers import rl_strategy, uses_ray, uses_reward_model, validate_workers

__all__ = ["validate_rl", "no_effect_notices", "uses_ray", "uses_reward_model", "rl_strategy", "is_correction_band",
           "check_is_correction"]

# --------------------------------------------------------------------------------------------- validation

#: (section, field) -> default; a different value means a feature that is not built yet
_NOT_BUILT: dict[tuple[str, str], tuple[object, str]] = {
    ("algo", "dynamic_filtering_range"): (None, ""),  # checked below (has a real meaning)
}

#: (section, field) -> (default, why): OpenRLHF knobs that mean nothing here; a different value prints one notice
_NO_EFFECT: dict[tuple[str, str], tuple[object, str]] = {
    ("data", "dataloader_num_workers"): (0, "prompts are tokenised once, before training (no DataLoader workers)"),
}

def _get(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _validate_reward_client(cfg) -> None:
    """``--reward.timeout`` / ``--reward.retries`` / ``--reward.retry_backoff_s`` (HTTP reward servers)."""
    r = cfg.reward
    if not 0 < r.timeout < float("inf"):
        raise ConfigError(f"--reward.timeout must be a number of seconds > 0 (got {r.timeout})")
    if r.retries < 0:
        raise ConfigError(f"--reward.retries must be >= 0 (got {r.retries}; 0 = one attempt per server)")
    if not 0 <= r.retry_backoff_s < float("inf"):
        raise ConfigError(f"--reward.retry_backoff_s must be >= 0 (got {r.retry_backoff_s})")


def _validate_routing_replay(cfg) -> None:
    """``--train.routing_replay`` (the MoE check itself runs when the actor is loaded)."""
    if not cfg.train.routing_replay:
        return
    if cfg.actor.gradient_checkpointing_enable:
        raise ConfigError("--train.routing_replay cannot be combined with --actor.gradient_checkpointing_enable: "
                          "the forward recomputed during backward would route freely, not with the replayed experts")
    if (cfg.vllm.num_engines or 0) > 0:
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--train.routing_replay with --vllm.num_engines > 0 needs vLLM's routed-experts output, "
                              "which only its GPU model runners record (V1 on vLLM 0.26, V2 on 0.32); vLLM's CPU build "
                              "cannot record routing: use the HF engine (--vllm.num_engines 0)")


def validate_rl(cfg) -> None:
    """Start-up checks with messages that show the value, the rule and the fix."""
    if cfg.actor.model_name_or_path is None:
        raise ConfigError("--actor.model_name_or_path is required (an HF hub id or a local folder)")
    if cfg.data.prompt_dataset is None:
        raise ConfigError("--data.prompt_dataset is required (files, folders, hub ids or builtin:NAME; comma-separated)")
    validate_aux_loss_coef(cfg.actor.aux_loss_coef, "--actor.aux_loss_coef")
    validate_experts_implementation(cfg.ds.experts_implementation)
    if cfg.use_ms:
        raise ConfigError("--use_ms (ModelScope) is not supported; download the model and pass a local folder")
    for (section, name), (default, what) in _NOT_BUILT.items():
        if not what:
            continue
        value = _get(cfg, f"{section}.{name}")
        if value != default:
            raise ConfigError(
                f"--{section}.{name} {value} needs {what}, which rlhforge does not have yet (leave it at {default})"
            )
    _validate_vllm(cfg)
    _validate_routing_replay(cfg)
    validate_workers(cfg)  # ring attention, AutoTP, worker groups (config/rl_workers.py)
    _validate_reward_client(cfg)
    t = cfg.train
    if t.agent_step_timeout <= 0 or t.agent_episode_timeout <= 0:
        raise ConfigError(f"--train.agent_step_timeout and --train.agent_episode_timeout must be > 0 "
                          f"(got {t.agent_step_timeout} and {t.agent_episode_timeout})")
    if t.agent_env_concurrency < 1:
        raise ConfigError(f"--train.agent_env_concurrency must be >= 1 (got {t.agent_env_concurrency})")
    if not t.agent_server_max_body_mb > 0 or t.agent_server_max_message_chars < 1:
        raise ConfigError(f"--train.agent_server_max_body_mb must be > 0 and --train.agent_server_max_message_chars "
                          f">= 1 (got {t.agent_server_max_body_mb} and {t.agent_server_max_message_chars})")
    _validate_env_adapter(cfg)
    if cfg.reward.model_name_or_path is None and cfg.reward.remote_url is None and not t.agent_func_path \
            and cfg.env.kind == "none":
        raise ConfigError(
            "no reward source: set --reward.remote_url (a .py file with reward_func, an http:// reward server, "
            "or builtin:NAME), --reward.model_name_or_path (a reward model), or --train.agent_func_path (an "
            "environment or agent that returns rewards)"
        )
    if cfg.reward.model_name_or_path is not None and not [p for p in cfg.reward.model_name_or_path.split(",") if p.strip()]:
        raise ConfigError(f"--reward.model_name_or_path {cfg.reward.model_name_or_path!r} names no model (one path, or "
                          "several comma-separated: their rewards are summed)")
    est = cfg.algo.advantage.estimator
    n = cfg.rollout.n_samples_per_prompt
    if cfg.algo.advantage.record.groups and n <= 1:
        raise ConfigError(f"{est} needs rollout.n_samples_per_prompt > 1 (got {n}): it compares samples of one prompt")
    if cfg.algo.dynamic_filtering_enable and n <= 1:
        raise ConfigError(f"--algo.dynamic_filtering_enable needs rollout.n_samples_per_prompt > 1 (got {n})")
    lo, hi = cfg.algo.dynamic_filtering_range
    if not lo < hi:
        raise ConfigError(f"--algo.dynamic_filtering_range needs low < high (got {lo} {hi})")
    gen_bs = cfg.rollout.vllm_generate_batch_size
    if gen_bs is not None and gen_bs < 1:
        raise ConfigError(f"--rollout.vllm_generate_batch_size must be >= 1 prompts per generation call (got {gen_bs})")
    if cfg.actor.dual_clip is not None and cfg.actor.dual_clip <= 1:
        raise ConfigError(f"--actor.dual_clip must be > 1 (got {cfg.actor.dual_clip})")
    validate_policy_loss(cfg)  # --actor.policy_loss_type and --actor.policy_loss.* (config/rl_losses.py)
    validate_distill(cfg)  # --teacher.* and --algo.distill.* (config/rl_distill.py)
    if cfg.train.enable_ema and not 0.0 <= cfg.train.ema_beta < 1.0:
        raise ConfigError(f"--train.ema_beta must be in [0, 1) (got {cfg.train.ema_beta}): ema = beta * ema + "
                          "(1 - beta) * weights after each optimizer step")
    if cfg.algo.kl.init_coef < 0:
        raise ConfigError(f"--algo.kl.init_coef must be >= 0 (got {cfg.algo.kl.init_coef})")
    if cfg.algo.kl.target is not None and cfg.algo.kl.init_coef <= 0:
        raise ConfigError("--algo.kl.target (adaptive KL) needs --algo.kl.init_coef > 0")
    if cfg.algo.kl.use_loss and cfg.algo.kl.estimator == "k1":
        print("[rlhforge] note: --algo.kl.use_loss with estimator k1 has a zero-mean gradient; k3 or k2 is usual")
    if cfg.rollout.temperature <= 0:
        raise ConfigError(f"--rollout.temperature must be > 0 for RL sampling (got {cfg.rollout.temperature})")
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError(f"--rollout.top_p must be in (0, 1] (got {cfg.rollout.top_p})")
    if cfg.eval.n_samples_per_prompt < 1:
        raise ConfigError(f"--eval.n_samples_per_prompt must be >= 1 (got {cfg.eval.n_samples_per_prompt})")
    if cfg.reward.stop_properly_penalty_coef is not None and cfg.reward.stop_properly_penalty_coef > 1:
        raise ConfigError(f"--reward.stop_properly_penalty_coef must be <= 1 (got {cfg.reward.stop_properly_penalty_coef})")
    if cfg.reward.overlong_buffer_len is not None:
        max_new = cfg.rollout.max_new_tokens
        if max_new is None or not 0 < cfg.reward.overlong_buffer_len <= max_new:
            raise ConfigError(
                f"--reward.overlong_buffer_len {cfg.reward.overlong_buffer_len} needs --rollout.max_new_tokens set "
                f"and 0 < buffer_len <= max_new_tokens (got max_new_tokens={max_new})"
            )
    if cfg.ds.lora.rank < 0:
        raise ConfigError(f"--ds.lora.rank must be >= 0 (got {cfg.ds.lora.rank})")
    if cfg.ds.load_in_4bit and cfg.ds.lora.rank == 0:
        raise ConfigError("--ds.load_in_4bit (QLoRA) needs LoRA adapters: set --ds.lora.rank > 0")
    if cfg.ds.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"--ds.zero_stage must be 0, 1, 2 or 3 (got {cfg.ds.zero_stage})")
    if cfg.data.input_template is not None and "{}" not in cfg.data.input_template:
        raise ConfigError(f"--data.input_template must contain '{{}}' for the prompt (got {cfg.data.input_template!r})")
    if cfg.data.prompt_probs is not None:
        if len(cfg.data.prompt_probs.split(",")) != len(cfg.data.prompt_dataset.split(",")):
            raise ConfigError(
                f"--data.prompt_probs has {len(cfg.data.prompt_probs.split(','))} values for "
                f"{len(cfg.data.prompt_dataset.split(','))} datasets ({cfg.data.prompt_dataset})"
            )
    _validate_dynamic_batch(cfg)
    if cfg.critic.freezing_steps > 0 and not cfg.uses_critic:
        raise ConfigError("--critic.freezing_steps needs a critic (--algo.advantage.estimator gae)")
    validate_logging_steps(cfg)
    validate_fault_limits(cfg.train)
    check_is_correction(cfg.algo.advantage)
    check_deadlines(cfg.deadline)
    _validate_remote_reward(cfg)
    if cfg.ds.load_in_4bit:
        check_load_in_4bit(cfg.train.device)
    check_gpu_kernels(cfg.ds, cfg.train.device)
    check_flash_attention_dtype(cfg.ds, cfg.train.device)
    from rlhforge.config.batching import plan_rl_batches

    plan_rl_batches(rollout_batch_size=cfg.rollout.batch_size, n_samples_per_prompt=n,
                    train_batch_size=cfg.train.batch_size, micro_batch_size=cfg.planned_micro_batch_size,
                    rollout_micro_batch_size=cfg.rollout.micro_batch_size, world_size=1, num_prompts=None,
                    num_episodes=cfg.train.num_episodes, max_epochs=cfg.train.max_epochs)
    for line in no_effect_notices(cfg):
        notice(line)


def no_effect_notices(cfg) -> list[str]:
    """The one-line notices of flags that are accepted but do nothing in this run."""
    out = []
    for (section, name), (default, why) in _NO_EFFECT.items():
        value = _get(cfg, f"{section}.{name}")
        if value != default:
            shown = "" if isinstance(value, bool) else f" {value}"
            out.append(f"--{section}.{name}{shown} has no effect: {why}")
    out += deepspeed_only_notices(cfg.ds, rl_strategy(cfg))
    if cfg.train.ema_beta != 0.992 and not cfg.train.enable_ema:
        out.append(f"--train.ema_beta {cfg.train.ema_beta} has no effect without --train.enable_ema")
    for role in ("actor", "critic"):
        out += muon_notices(getattr(cfg, role).optim_config(), f"--{role}.muon.", f"--{role}.max_norm",
                            f"--{role}.optim muon", rl_strategy(cfg) == "deepspeed")
    if cfg.algo.kl.unbiased_gradient and not (cfg.algo.kl.use_loss and cfg.algo.kl.init_coef > 0):
        out.append("--algo.kl.unbiased_gradient has no effect without --algo.kl.use_loss and --algo.kl.init_coef > 0 "
                   "(the KL is then a reward penalty, which is not differentiated)")
    out += policy_loss_notices(cfg)
    out += distill_notices(cfg)
    out += _frozen_model_notices(cfg)
    out += _dynamic_batch_notices(cfg)
    v = cfg.vllm
    v0 = type(v)()  # the defaults
    if not v.num_engines:
        for name in ("tensor_parallel_size", "enable_prefix_caching", "enforce_eager", "enable_sleep",
                     "gpu_memory_utilization", "sync_backend", "max_restarts", "request_timeout_s"):
            value = getattr(v, name)
            if value != getattr(v0, name):
                shown = "" if isinstance(value, bool) else f" {value}"
                out.append(f"--vllm.{name}{shown} has no effect without --vllm.num_engines (the in-process HF "
                           "engine generates)")
    ray = uses_ray(cfg)
    if v.num_engines and not ray:
        for name in ("sync_backend", "max_restarts", "request_timeout_s"):
            value = getattr(v, name)
            if value != getattr(v0, name):
                out.append(f"--vllm.{name} {value} has no effect: without Ray the engines live in this process "
                           "(engine actors need --train.workers ray or RAY_ADDRESS)")
    if v.sync_with_ray and not ray:
        out.append("--vllm.sync_with_ray has no effect without Ray workers (weights are synced in-process)")
    if v.sync_bucket_mb != v0.sync_bucket_mb and not ray and not v.num_engines:
        out.append(f"--vllm.sync_bucket_mb {v.sync_bucket_mb} has no effect: no Ray workers and no vLLM engines "
                   "(weights are synced in-process)")
    if cfg.reward.api_key and not _http_reward(cfg):
        out.append("--reward.api_key has no effect: it is sent to HTTP reward servers only "
                   "(--reward.remote_url http://... or endpoints:FILE)")
    if cfg.reward.wait_for_server_s and not _http_reward(cfg):
        out.append(f"--reward.wait_for_server_s {cfg.reward.wait_for_server_s} has no effect: there is no HTTP reward "
                   "server to wait for")
    return out


def _validate_dynamic_batch(cfg) -> None:
    """``--train.dynamic_batch_enable``: token-budget micro-batches are packed rows (OpenRLHF turns
    ``--ds.packing_samples`` on by itself; rlhforge asks for it, so the layout is what the command says)."""
    t, r = cfg.train, cfg.rollout
    if t.max_tokens_per_gpu < 1:
        raise ConfigError(f"--train.max_tokens_per_gpu must be >= 1 (got {t.max_tokens_per_gpu})")
    if r.max_tokens_per_gpu is not None and r.max_tokens_per_gpu < 1:
        raise ConfigError(f"--rollout.max_tokens_per_gpu must be >= 1 (got {r.max_tokens_per_gpu}; unset: the train value)")
    if t.dynamic_batch_enable and not cfg.ds.packing_samples:
        raise ConfigError("--train.dynamic_batch_enable needs --ds.packing_samples: token-budget micro-batches are "
                          "packed rows (OpenRLHF switches packing on by itself; add --ds.packing_samples)")


def _dynamic_batch_notices(cfg) -> list[str]:
    """The token budgets mean nothing with fixed micro-batches."""
    out = []
    if not cfg.train.dynamic_batch_enable:
        if cfg.train.max_tokens_per_gpu != 16192:
            out.append(f"--train.max_tokens_per_gpu {cfg.train.max_tokens_per_gpu} has no effect without "
                       "--train.dynamic_batch_enable (micro-batches hold --train.micro_batch_size samples)")
        if cfg.rollout.max_tokens_per_gpu is not None:
            out.append(f"--rollout.max_tokens_per_gpu {cfg.rollout.max_tokens_per_gpu} has no effect without "
                       "--train.dynamic_batch_enable (passes use --rollout.micro_batch_size samples)")
    return out


def _frozen_model_notices(cfg) -> list[str]:
    """``--reward.num_*``, ``--train.colocate_critic_reward``, ``--ref.offload``, ``--reward.offload``
    where there is no reward group / critic / reference / reward model for them to act on."""
    out, ray, rm = [], uses_ray(cfg), uses_reward_model(cfg)
    where = ("no reward model to place (--reward.model_name_or_path unset or overridden by --reward.remote_url)"
             if not rm else "without Ray workers the reward model runs in the driver process on one device "
             "(--train.workers ray puts it in a Ray group)")
    for name in ("num_nodes", "num_gpus_per_node"):
        value = getattr(cfg.reward, name)
        if value != 1 and not (ray and rm):
            out.append(f"--reward.{name} {value} has no effect: {where}")
    if cfg.train.colocate_critic_reward and not (ray and rm and cfg.uses_critic and not cfg.train.colocate_all):
        why = (where if not (ray and rm) else "there is no critic (--algo.advantage.estimator gae)" if not cfg.uses_critic
               else "--train.colocate_all already puts every model in one placement group")
        out.append(f"--train.colocate_critic_reward has no effect: {why}")
    if cfg.ref.offload and not cfg.uses_ref:
        out.append("--ref.offload has no effect: there is no reference model (--algo.kl.init_coef 0)")
    if cfg.reward.offload and not rm:
        out.append("--reward.offload has no effect: no reward model (--reward.model_name_or_path unset or overridden "
                   "by --reward.remote_url)")
    return out


def _http_reward(cfg) -> bool:
    url = cfg.reward.remote_url or ""
    return url.startswith(("http://", "https://", "endpoints:"))


def _validate_remote_reward(cfg) -> None:
    r = cfg.reward
    if r.wait_for_server_s < 0:
        raise ConfigError(f"--reward.wait_for_server_s must be >= 0 seconds (got {r.wait_for_server_s}; 0: fail at once "
                          "if a reward server does not answer at start-up)")


# --------------------------------------------------------------------------------------------- IS correction


def is_correction_band(threshold: tuple[float, ...]) -> tuple[float | None, float]:
    """``--algo.advantage.is_correction_threshold`` -> ``(low, high)`` as the trainer reads it (one value:
    an upper bound only, ``low=None``)."""
    return (None, threshold[0]) if len(threshold) == 1 else (threshold[0], threshold[1])


def check_is_correction(adv) -> None:
    """The refusals of :func:`rlhforge.algorithms.corrections.is_correction`, at start-up, with the flags
    named (``adv`` is the ``algo.advantage`` section). Nothing is checked when the level is ``off``."""
    level, mode, gating, th = (adv.is_correction_level, adv.is_correction_mode, adv.is_correction_gating,
                               tuple(adv.is_correction_threshold))
    if level == "off":
        return
    flag = "--algo.advantage.is_correction"
    shown = " ".join(f"{t:g}" for t in th)
    if len(th) not in (1, 2):
        raise ConfigError(f"{flag}_threshold takes one value (HIGH) or two (LOW HIGH), got {len(th)}: {shown}")
    low, high = is_correction_band(th)
    if mode == "clip" and level != "token":
        raise ConfigError(f"{flag}_mode clip works per token only: with {flag}_level {level} clamping a sequence "
                          f"statistic would not say which token weights to clamp; use {flag}_mode mask, or "
                          f"{flag}_level token")
    if mode == "clip" and gating != "ratio":
        raise ConfigError(f"{flag}_mode clip clamps the importance ratio, so it needs {flag}_gating ratio (got "
                          f"{gating}); a divergence gates with {flag}_mode mask")
    if gating != "ratio" and low not in (None, 0, 0.0):
        raise ConfigError(f"{flag}_gating {gating} takes an upper bound only (a divergence is >= 0), but "
                          f"{flag}_threshold {shown} has the lower bound {low:g}; give one value (HIGH, e.g. 0.003) "
                          f"or 0 HIGH")
    if gating == "ratio" and low is None:
        raise ConfigError(f"{flag}_gating ratio needs a band LOW HIGH with LOW > 0 (got the single value {shown}); "
                          f"e.g. {flag}_threshold 0.5 {high:g}")
    effective_low = 0.0 if gating != "ratio" else low
    if not effective_low <= high:
        raise ConfigError(f"{flag}_threshold {shown} needs LOW <= HIGH (got {effective_low:g} > {high:g})")


def _validate_vllm(cfg) -> None:
    """``--vllm.*``: engines are built when ``num_engines >= 1`` (None/0: the in-process HF engine)."""
    v = cfg.vllm
    if v.num_engines is None or v.num_engines == 0:
        return
    if v.num_engines < 0:
        raise ConfigError(f"--vllm.num_engines must be >= 0 (got {v.num_engines}; 0 or unset: the HF engine)")
    if v.max_restarts < 0:
        raise ConfigError(f"--vllm.max_restarts must be >= 0 (got {v.max_restarts})")
    if not v.request_timeout_s > 0:
        raise ConfigError(f"--vllm.request_timeout_s must be > 0 (got {v.request_timeout_s})")
    if not v.sync_timeout_s > 0:
        raise ConfigError(f"--vllm.sync_timeout_s must be > 0 (got {v.sync_timeout_s})")
    if v.tensor_parallel_size < 1:
        raise ConfigError(f"--vllm.tensor_parallel_size must be >= 1 (got {v.tensor_parallel_size})")
    if not 0 < v.gpu_memory_utilization <= 1:
        raise ConfigError(f"--vllm.gpu_memory_utilization must be in (0, 1] (got {v.gpu_memory_utilization})")
    if cfg.ds.lora.rank > 0 and cfg.ds.load_in_4bit:
        raise ConfigError(f"--vllm.num_engines {v.num_engines} with QLoRA (--ds.load_in_4bit) would need its 4-bit base "
                          "dequantised for the merged weight sync; drop --vllm.num_engines (the HF engine generates) "
                          "or train LoRA without --ds.load_in_4bit")


def _validate_env_adapter(cfg) -> None:
    """``--env.kind`` / ``--env.id`` (docs/env_adapters.md)."""
    env = cfg.env
    if env.kind == "none":
        return
    if cfg.train.agent_func_path:
        raise ConfigError(f"--env.kind {env.kind} and --train.agent_func_path {cfg.train.agent_func_path} both name the "
                          "episode's environment; set one")
    if not env.id:
        raise ConfigError(f"--env.kind {env.kind} needs --env.id ("
                          + ("a verifiers taskset module or .py file)" if env.kind == "verifiers"
                             else "the OpenEnv server's http://HOST:PORT)"))
    if env.kind == "openenv" and not env.id.startswith(("http://", "https://", "ws://", "wss://")):
        raise ConfigError(f"--env.id {env.id}: an OpenEnv server is named by its URL (http://HOST:PORT)")
    if env.args:
        import json

        try:
            ok = isinstance(json.loads(env.args), dict)
        except json.JSONDecodeError:
            ok = False
        if not ok:
            raise ConfigError(f"--env.args {env.args!r}: expected a JSON object, e.g. '{{\"split\": \"train\"}}'")
