"""Every table of other names for our flags, in one place (issue 45): OpenRLHF 0.11's flat names that are
grouped here (rewritten silently), OpenRLHF <= 0.9's flat names and switches (rewritten with a one-line
deprecation notice), per command, and the names other frameworks use for the same flags. The rewriting itself
is :func:`rlhforge.config.parsing.rewrite_aliases` (and :func:`rlhforge.config.rl_aliases.rewrite_rl_argv` for
``rl``'s extra rules); each command hands its table to it. This module imports nothing of rlhforge."""

from __future__ import annotations

__all__ = ["CURRENT_FLAT_ALIASES", "LEGACY_ALIASES", "LEGACY_SWITCHES", "PREFERENCE_LEGACY_ALIASES", "RM_LEGACY_ALIASES", "DPO_LEGACY_ALIASES", "KTO_LEGACY_ALIASES", "SERVE_RM_LEGACY_ALIASES", "RL_LEGACY_ALIASES", "RL_LEGACY_SWITCHES", "DEADLINE_ALIASES", "POLICY_LOSS_FLAG_ALIASES"]

# OpenRLHF 0.11 names that are flat there but grouped here. Rewritten silently.
CURRENT_FLAT_ALIASES: dict[str, str] = {
    "--optim": "--optim.name",
    "--lr_scheduler": "--optim.lr_scheduler",
    "--lr_warmup_ratio": "--optim.lr_warmup_ratio",
    "--min_lr_ratio": "--optim.min_lr_ratio",
    "--max_norm": "--optim.max_norm",
    "--adam.lr": "--optim.adam.lr",
    "--adam.betas": "--optim.adam.betas",
    "--adam.eps": "--optim.adam.eps",
    "--adam.weight_decay": "--optim.adam.weight_decay",
    "--muon.lr": "--optim.muon.lr",
    "--muon.momentum": "--optim.muon.momentum",
    "--muon.ns_steps": "--optim.muon.ns_steps",
    "--muon.nesterov": "--optim.muon.nesterov",
    "--muon.no_nesterov": "--optim.muon.no_nesterov",
}

# OpenRLHF <= 0.9 flat names shared by SFT/RM/DPO (and PPO where the field exists).
# Rewritten with a deprecation notice. Per-command tables extend this one.
LEGACY_ALIASES: dict[str, str] = {
    "--pretrain": "--model.model_name_or_path",
    "--save_path": "--ckpt.output_dir",
    "--ckpt_path": "--ckpt.path",
    "--save_steps": "--ckpt.save_steps",
    "--save_hf_ckpt": "--ckpt.save_hf",
    "--disable_ds_ckpt": "--ckpt.disable_ds",
    "--max_ckpt_num": "--ckpt.max_num",
    "--max_ckpt_mem": "--ckpt.max_mem",
    "--load_checkpoint": "--ckpt.load_enable",
    "--logging_steps": "--logger.logging_steps",
    "--eval_steps": "--eval.steps",
    "--use_tensorboard": "--logger.tensorboard_dir",
    "--use_wandb": "--logger.wandb.key",
    "--wandb_org": "--logger.wandb.org",
    "--wandb_group": "--logger.wandb.group",
    "--wandb_project": "--logger.wandb.project",
    "--wandb_run_name": "--logger.wandb.run_name",
    "--micro_train_batch_size": "--train.micro_batch_size",
    "--train_batch_size": "--train.batch_size",
    "--max_epochs": "--train.max_epochs",
    "--seed": "--train.seed",
    "--full_determinism": "--train.full_determinism_enable",
    "--gradient_checkpointing": "--model.gradient_checkpointing_enable",
    "--gradient_checkpointing_use_reentrant": "--model.gradient_checkpointing_reentrant",
    "--aux_loss_coef": "--model.aux_loss_coef",
    "--zero_stage": "--ds.zero_stage",
    "--zpg": "--ds.zpg",
    "--adam_offload": "--ds.adam_offload",
    "--attn_implementation": "--ds.attn_implementation",
    "--packing_samples": "--ds.packing_samples",
    "--grad_accum_dtype": "--ds.grad_accum_dtype",
    "--overlap_comm": "--ds.overlap_comm",
    "--load_in_4bit": "--ds.load_in_4bit",
    "--lora_rank": "--ds.lora.rank",
    "--lora_alpha": "--ds.lora.alpha",
    "--target_modules": "--ds.lora.target_modules",
    "--lora_dropout": "--ds.lora.dropout",
    "--use_liger_kernel": "--ds.use_liger_kernel",
    "--ring_attn_size": "--ds.ring_attn_size",
    "--dataset": "--data.dataset",
    "--dataset_probs": "--data.dataset_probs",
    "--dataset_split": "--data.dataset_split",
    "--eval_dataset": "--eval.dataset",
    "--eval_split": "--eval.split",
    "--max_samples": "--data.max_samples",
    "--input_key": "--data.input_key",
    "--output_key": "--data.output_key",
    "--input_template": "--data.input_template",
    "--apply_chat_template": "--data.apply_chat_template",
    "--tokenizer_chat_template": "--data.tokenizer_chat_template",
    "--max_len": "--data.max_len",
    "--multiturn": "--data.multiturn",
    "--pretrain_mode": "--model.pretrain_mode_enable",
    "--disable_fast_tokenizer": "--data.disable_fast_tokenizer",
    "--learning_rate": "--optim.adam.lr",
    "--l2": "--optim.adam.weight_decay",
}

# Legacy switches whose meaning is carried by a value in the new layout.
LEGACY_SWITCHES: dict[str, list[str]] = {
    "--bf16": ["--ds.param_dtype", "bf16"],
    "--flash_attn": ["--ds.attn_implementation", "flash_attention_2"],
}

# OpenRLHF <= 0.9 flat names of train_rm / train_dpo (on top of the shared table).
PREFERENCE_LEGACY_ALIASES: dict[str, str] = {
    **LEGACY_ALIASES,
    "--prompt_key": "--data.prompt_key",
    "--chosen_key": "--data.chosen_key",
    "--rejected_key": "--data.rejected_key",
}

RM_LEGACY_ALIASES: dict[str, str] = {
    **PREFERENCE_LEGACY_ALIASES,
    "--loss": "--model.loss_type",
    "--margin_loss": "--model.margin_loss_enable",
    "--compute_fp32_loss": "--model.compute_fp32_loss_enable",
    "--value_head_prefix": "--ds.value_head_prefix",
}

DPO_LEGACY_ALIASES: dict[str, str] = {
    **PREFERENCE_LEGACY_ALIASES,
    "--beta": "--model.beta",
    "--ipo": "--model.ipo_enable",
    "--label_smoothing": "--model.label_smoothing",
    "--nll_loss_coef": "--model.nll_loss_coef",
    "--ref_pretrain": "--ref.model_name_or_path",
    "--ref_offload": "--ref.offload",
}

#: TRL's KTOConfig names and OpenRLHF's train_kto flat names (on top of the shared table)
KTO_LEGACY_ALIASES: dict[str, str] = {
    **LEGACY_ALIASES,
    "--beta": "--model.beta",
    "--loss_type": "--model.loss_type",
    "--desirable_weight": "--model.desirable_weight",
    "--undesirable_weight": "--model.undesirable_weight",
    "--desirable_loss_weight": "--model.desirable_weight",
    "--undesirable_loss_weight": "--model.undesirable_weight",
    "--prompt_key": "--data.prompt_key",
    "--completion_key": "--data.completion_key",
    "--output_key": "--data.completion_key",
    "--label_key": "--data.label_key",
    "--ref_pretrain": "--ref.model_name_or_path",
    "--ref_offload": "--ref.offload",
}

# OpenRLHF <= 0.9 flat names of serve_rm.
SERVE_RM_LEGACY_ALIASES: dict[str, str] = {
    "--reward_pretrain": "--reward.model_name_or_path",
    "--pretrain": "--reward.model_name_or_path",
    "--normalize_reward": "--reward.normalize_enable",
    "--value_head_prefix": "--ds.value_head_prefix",
    "--max_len": "--data.max_len",
    "--packing_samples": "--ds.packing_samples",
    "--load_in_4bit": "--ds.load_in_4bit",
    "--disable_fast_tokenizer": "--data.disable_fast_tokenizer",
}

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

#: the other deadlines, under the family's names (the older names stay the fields)
DEADLINE_ALIASES: dict[str, str] = {
    "--deadline.engine_request_s": "--vllm.request_timeout_s",
    "--deadline.weight_sync_s": "--vllm.sync_timeout_s",
    "--deadline.reward_s": "--reward.timeout",
    "--deadline.env_step_s": "--train.agent_step_timeout",
    "--deadline.env_episode_s": "--train.agent_episode_timeout",
}

#: other frameworks' flag names, rewritten silently (veRL ``policy_loss.loss_mode`` / ``tau_pos``; TRL
#: ``sapo_temperature_*``; prime-rl ``dppo_mask_*``)
POLICY_LOSS_FLAG_ALIASES = {
    "--actor.policy_loss.loss_mode": "--actor.policy_loss_type",
    "--actor.policy_loss.tau_pos": "--actor.policy_loss.sapo_tau_pos",
    "--actor.policy_loss.tau_neg": "--actor.policy_loss.sapo_tau_neg",
    "--actor.policy_loss.sapo_temperature_pos": "--actor.policy_loss.sapo_tau_pos",
    "--actor.policy_loss.sapo_temperature_neg": "--actor.policy_loss.sapo_tau_neg",
    "--actor.policy_loss.dppo_mask_low": "--actor.policy_loss.dppo_delta_low",
    "--actor.policy_loss.dppo_mask_high": "--actor.policy_loss.dppo_delta_high",
}
