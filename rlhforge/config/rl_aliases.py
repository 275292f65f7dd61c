"""OpenRLHF's older names of ``train_ppo_ray`` flags and the argv rewriting that maps them to today's
dotted names, with one deprecation line each: 0.9's flat names (``--pretrain``, ``--remote_rm_url``...)
and 0.10's IS-correction pair (``--algo.advantage.is_correction_enable/type``)."""

from __future__ import annotations

import sys

from rlhforge.config.deadline import DEADLINE_ALIASES
from rlhforge.config.parsing import LEGACY_ALIASES, ConfigError, rewrite_aliases
from rlhforge.config.rl_losses import POLICY_LOSS_FLAG_ALIASES

__all__ = ["RL_LEGACY_ALIASES", "RL_LEGACY_SWITCHES", "IS_CORRECTION_TYPES", "rewrite_rl_argv"]

#: OpenRLHF <= 0.9 flat names of ``train_ppo_ray`` -> our dotted names (rewritten with a notice).
RL_LEGACY_ALIASES: dict[str, str] = {
    **{k: v for k, v in LEGACY_ALIASES.items() if not v.startswith(("--model.", "--data.", "--eval.dataset",
                                                                         "--eval.split", "--optim."))},
    "--pretrain": "--actor.model_name_or_path",
    "--reward_pretrain": "--reward.model_name_or_path",
    "--critic_pretrain": "--critic.model_name_or_path",
    "--remote_rm_url": "--reward.remote_url",
    "--colocate_all_models": "--train.colocate_all",
    "--colocate_actor_ref": "--train.colocate_actor_ref",
    "--colocate_critic_reward": "--train.colocate_critic_reward",
    "--ref_num_nodes": "--ref.num_nodes",
    "--ref_num_gpus_per_node": "--ref.num_gpus_per_node",
    "--reward_num_nodes": "--reward.num_nodes",
    "--reward_num_gpus_per_node": "--reward.num_gpus_per_node",
    "--critic_num_nodes": "--critic.num_nodes",
    "--critic_num_gpus_per_node": "--critic.num_gpus_per_node",
    "--actor_num_nodes": "--actor.num_nodes",
    "--actor_num_gpus_per_node": "--actor.num_gpus_per_node",
    "--vllm_num_engines": "--vllm.num_engines",
    "--vllm_tensor_parallel_size": "--vllm.tensor_parallel_size",
    "--vllm_sync_backend": "--vllm.sync_backend",
    "--vllm_sync_with_ray": "--vllm.sync_with_ray",
    "--enable_prefix_caching": "--vllm.enable_prefix_caching",
    "--enforce_eager": "--vllm.enforce_eager",
    "--vllm_enable_sleep": "--vllm.enable_sleep",
    "--vllm_gpu_memory_utilization": "--vllm.gpu_memory_utilization",
    "--deepspeed_enable_sleep": "--ds.enable_sleep",
    "--advantage_estimator": "--algo.advantage.estimator",
    "--gamma": "--algo.advantage.gamma",
    "--lambd": "--algo.advantage.lambd",
    "--no_advantage_std_norm": "--algo.advantage.no_std_norm",
    "--init_kl_coef": "--algo.kl.init_coef",
    "--kl_target": "--algo.kl.target",
    "--kl_horizon": "--algo.kl.horizon",
    "--kl_estimator": "--algo.kl.estimator",
    "--use_kl_loss": "--algo.kl.use_loss",
    "--dynamic_filtering": "--algo.dynamic_filtering_enable",
    "--dynamic_filtering_reward_range": "--algo.dynamic_filtering_range",
    "--async_train": "--train.async_enable",
    "--micro_rollout_batch_size": "--rollout.micro_batch_size",
    "--rollout_batch_size": "--rollout.batch_size",
    "--n_samples_per_prompt": "--rollout.n_samples_per_prompt",
    "--generate_max_len": "--rollout.max_new_tokens",
    "--temperature": "--rollout.temperature",
    "--top_p": "--rollout.top_p",
    "--num_episodes": "--train.num_episodes",
    "--actor_learning_rate": "--actor.adam.lr",
    "--critic_learning_rate": "--critic.adam.lr",
    "--lr_warmup_ratio": "--actor.lr_warmup_ratio",
    "--max_norm": "--actor.max_norm",
    "--l2": "--actor.adam.weight_decay",
    "--adam_betas": "--actor.adam.betas",
    "--eps_clip": "--actor.eps_clip",
    "--eps_clip_low_high": "--actor.eps_clip_low_high",
    "--dual_clip": "--actor.dual_clip",
    "--policy_loss_type": "--actor.policy_loss_type",
    "--entropy_loss_coef": "--actor.entropy_coef",
    "--value_clip": "--critic.value_clip",
    "--freezing_actor_steps": "--critic.freezing_steps",
    "--save_value_network": "--critic.save_value_network",
    "--normalize_reward": "--reward.normalize_enable",
    "--reward_clip_range": "--reward.clip_range",
    "--overlong_buffer_len": "--reward.overlong_buffer_len",
    "--overlong_penalty_factor": "--reward.overlong_penalty_factor",
    "--stop_properly_penalty_coef": "--reward.stop_properly_penalty_coef",
    "--ref_reward_offload": "--ref.offload",
    "--gradient_checkpointing": "--actor.gradient_checkpointing_enable",
    "--gradient_checkpointing_use_reentrant": "--actor.gradient_checkpointing_reentrant",
    "--aux_loss_coef": "--actor.aux_loss_coef",
    "--value_head_prefix": "--ds.value_head_prefix",
    "--prompt_data": "--data.prompt_dataset",
    "--prompt_data_probs": "--data.prompt_probs",
    "--prompt_split": "--data.prompt_split",
    "--eval_dataset": "--eval.dataset",
    "--eval_split": "--eval.split",
    "--eval_temperature": "--eval.temperature",
    "--eval_n_samples_per_prompt": "--eval.n_samples_per_prompt",
    "--input_key": "--data.input_key",
    "--label_key": "--data.label_key",
    "--input_template": "--data.input_template",
    "--apply_chat_template": "--data.apply_chat_template",
    "--tokenizer_chat_template": "--data.tokenizer_chat_template",
    "--max_len": "--data.max_len",
    "--prompt_max_len": "--data.prompt_max_len",
    "--max_samples": "--data.max_samples",
    "--disable_fast_tokenizer": "--data.disable_fast_tokenizer",
    "--agent_func_path": "--train.agent_func_path",
    "--best_metric_key": "--ckpt.best_metric_key",
}

#: OpenRLHF <= 0.9 switches whose meaning is a value here.
RL_LEGACY_SWITCHES: dict[str, list[str]] = {
    "--enable_vllm_is_correction": ["--algo.advantage.is_correction_level", "token",
                                    "--algo.advantage.is_correction_mode", "clip"],
}


#: OpenRLHF 0.10's ``--algo.advantage.is_correction_type`` -> 0.11.2's level / mode / gating.
IS_CORRECTION_TYPES = {"tis": ("token", "clip", "ratio"), "icepop": ("token", "mask", "ratio"),
                       "seq-mask-tis": ("seq", "mask", "ratio")}


def _rewrite_is_correction(argv: list[str], warn) -> list[str]:
    """``--algo.advantage.is_correction_enable [--algo.advantage.is_correction_type T]`` (OpenRLHF 0.10)
    -> ``--algo.advantage.is_correction_{level,mode,gating}`` (0.11.2). The type alone does nothing,
    as in 0.10."""
    enable_flag, type_flag = "--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type"
    if enable_flag not in argv and type_flag not in argv:
        return argv
    out, enabled, kind, i = [], False, "tis", 0
    while i < len(argv):
        if argv[i] == enable_flag:
            enabled, i = True, i + 1
        elif argv[i] == type_flag:
            if i + 1 >= len(argv) or argv[i + 1] not in IS_CORRECTION_TYPES:
                got = argv[i + 1] if i + 1 < len(argv) else "nothing"
                raise ConfigError(f"{type_flag} must be one of {', '.join(IS_CORRECTION_TYPES)} (got {got})")
            kind, i = argv[i + 1], i + 2
        else:
            out.append(argv[i])
            i += 1
    if enabled:
        level, mode, gating = IS_CORRECTION_TYPES[kind]
        warn(f"[rlhforge] {enable_flag} / {type_flag} {kind} are OpenRLHF 0.10 names; use "
             f"--algo.advantage.is_correction_level {level} --algo.advantage.is_correction_mode {mode} "
             f"--algo.advantage.is_correction_gating {gating}")
        out += ["--algo.advantage.is_correction_level", level, "--algo.advantage.is_correction_mode", mode,
                "--algo.advantage.is_correction_gating", gating]
    return out


def rewrite_rl_argv(argv: list[str], warn=lambda msg: print(msg, file=sys.stderr)) -> list[str]:
    """OpenRLHF 0.9 flat names and 0.10 IS-correction names -> current dotted ones (one deprecation
    line each)."""
    argv = _rewrite_is_correction(list(argv), warn)
    out: list[str] = []
    for token in argv:
        if token in RL_LEGACY_SWITCHES:
            warn(f"[rlhforge] {token} is deprecated; use {' '.join(RL_LEGACY_SWITCHES[token])}")
            out.extend(RL_LEGACY_SWITCHES[token])
        else:
            out.append(token)
    return rewrite_aliases(out, current={**DEADLINE_ALIASES, **POLICY_LOSS_FLAG_ALIASES}, legacy=RL_LEGACY_ALIASES,
                           warn=warn)
