"""What the GPU check runs (standard library only): the stages and their order, each stage's timeout, the
model and rollout shapes of the GPU run and of the CPU smoke, and the RL CLI flags of the GRPO stages.
check_rl.py runs them."""

from __future__ import annotations

from pathlib import Path

# the vLLM stages (issue 44) come first after the model: a check cut short by the budget keeps them
ORDER = ("env", "bug1", "nccl_group", "ipc_sync", "model", "vllm_engine", "grpo_vllm", "trl_vllm", "hf_decode",
         "grpo_torch", "grpo_deepspeed", "trl", "grpo_fsdp2", "gpu_tests")
VLLM_STAGES = ("vllm_engine", "grpo_vllm", "trl_vllm")
STRATEGIES = ("torch", "fsdp2", "deepspeed")
# per-stage timeouts (s); the whole check also stops at --budget-s. The model build runs beside bug1..gpu_tests.
CAPS = {"gpu": {"env": 40, "bug1": 30, "nccl_group": 30, "ipc_sync": 50, "gpu_tests": 70, "model": 150,
                "vllm_engine": 150, "grpo_vllm": 240, "trl_vllm": 150,
                "hf_decode": 60, "grpo_torch": 80, "grpo_fsdp2": 80, "grpo_deepspeed": 150, "trl": 60},
        "cpu-smoke": {"env": 40, "bug1": 40, "nccl_group": 40, "ipc_sync": 60, "gpu_tests": 90, "model": 120,
                      "vllm_engine": 120, "grpo_vllm": 240, "trl_vllm": 60,
                      "hf_decode": 90, "grpo_torch": 100, "grpo_fsdp2": 100, "grpo_deepspeed": 200, "trl": 100}}
# issue 39, point 4: the DeepSpeed stage is ZeRO-3 with the hybrid engine's sleep and the optimizer on the host
# (DeepSpeed from the carried wheel, built here with DS_BUILD_OPS=0: its cpu_adam op is JIT-built on first use)
DEEPSPEED_FLAGS = ["--ds.zero_stage", "3", "--ds.enable_sleep", "--ds.adam_offload"]
# issue 44: the seed's hybrid engine on one GPU: actor, reference and one vLLM engine in one Ray placement group,
# both sides asleep while the other works, DeepSpeed ZeRO-3, weights into the engine by CUDA IPC, then the post-sync
# effect check (engine log-probs against the trainer's). vLLM's CPU build has no sleep mode: the smoke leaves it out.
HYBRID_FLAGS = ["--train.workers", "ray", "--train.colocate_all", "--vllm.num_engines", "1", "--ds.zero_stage", "3",
                "--ds.enable_sleep"]
HYBRID_GPU_FLAGS = ["--vllm.enable_sleep"]
HYBRID_KL = "0.001"  # > 0: the run builds the reference model, colocated with the actor and the engine
HYBRID_RETRY_UTIL = "0.5"  # the hybrid run again at this utilization when the default one ran out of memory
TRL_VLLM_UTIL = 0.3  # TRL's own default vllm_gpu_memory_utilization in colocate mode
# ~0.38B parameters: 24 x (attention 3.1M + MLP 12.6M) + 1k x 1024 tied embeddings; head_dim 64; Qwen3 family
MODEL = {"gpu": {"arch": "qwen3", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                 "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 1024},
         "cpu-smoke": {"arch": "qwen3"}}  # rlhforge tiny-model's default sizes: ~0.4M parameters
# rollout: prompts x samples x new tokens; one optimizer step per rollout (micro-batch = the batch, as TRL does)
SHAPE = {"gpu": {"prompts": 16, "samples": 4, "new_tokens": 128, "num_prompts": 512, "max_len": 512},
         "cpu-smoke": {"prompts": 4, "samples": 2, "new_tokens": 8, "num_prompts": 64, "max_len": 128}}
IPC_MODEL = {"gpu": {"vocab": 8192, "hidden": 1024, "intermediate": 3072, "layers": 8, "heads": 16, "kv_heads": 8},
             "cpu-smoke": {"vocab": 512, "hidden": 128, "intermediate": 256, "layers": 2, "heads": 4, "kv_heads": 2}}


def rl_flags(mode: str, model: Path, run: Path, reward: Path, strategy: str, steps: int, kl: str = "0") -> list[str]:
    """``python -m rlhforge.cli.train_ppo_ray`` flags of a GRPO stage: the built-in arithmetic prompts, ``reward``
    (a --reward.remote_url file), the mode's shape, one optimizer step per rollout, ``steps`` steps."""
    sh = SHAPE[mode]
    n, cuda = sh["prompts"] * sh["samples"], mode == "gpu"
    return [
        "--actor.model_name_or_path", str(model),
        "--data.prompt_dataset", f"builtin:arithmetic?n={sh['num_prompts']}&max=99",
        "--data.input_key", "prompt", "--data.label_key", "answer", "--data.apply_chat_template",
        "--data.max_len", str(sh["max_len"]), "--reward.remote_url", str(reward),
        "--rollout.batch_size", str(sh["prompts"]), "--rollout.n_samples_per_prompt", str(sh["samples"]),
        "--rollout.max_new_tokens", str(sh["new_tokens"]), "--rollout.temperature", "1.0",
        "--rollout.micro_batch_size", str(n), "--rollout.generate_batch_size", str(n),
        "--train.batch_size", str(n), "--train.micro_batch_size", str(n),
        "--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", kl,
        "--actor.adam.lr", "1e-5", "--actor.lr_warmup_ratio", "0", "--train.max_steps", str(steps),
        "--train.seed", "3", "--ds.strategy", strategy, "--ds.param_dtype", "bf16" if cuda else "fp32",
        "--train.device", "cuda" if cuda else "cpu",
        "--ckpt.output_dir", str(run), "--ckpt.path", str(run / "ckpts"), "--ckpt.disable_ds",
        "--logger.progress_bar", "off",
    ]
