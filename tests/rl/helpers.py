import dataclasses
import json
from pathlib import Path


def rl_args(model_dir, out, *extra, estimator="group_norm", steps=2):
    return [
        "--actor.model_name_or_path", str(model_dir),
        "--data.prompt_dataset", "builtin:arithmetic?n=32&max=9", "--data.input_key", "prompt",
        "--data.label_key", "answer", "--data.apply_chat_template",
        "--reward.remote_url", "builtin:arithmetic",
        "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "2", "--rollout.max_new_tokens", "6",
        "--rollout.micro_batch_size", "8", "--train.batch_size", "4", "--train.micro_batch_size", "2",
        "--algo.advantage.estimator", estimator, "--actor.adam.lr", "1e-3", "--critic.adam.lr", "1e-3",
        "--actor.lr_warmup_ratio", "0", "--train.max_steps", str(steps), "--ds.param_dtype", "fp32",
        "--ckpt.output_dir", str(out), "--ckpt.path", str(Path(out) / "ckpts"), "--train.seed", "3",
        *map(str, extra),
    ]


def metrics(run_dir) -> list[dict]:
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if x.strip()]


def per_step(run_dir, key) -> dict[int, float]:
    return {r["step"]: r[key] for r in metrics(run_dir) if key in r}


VARIED_REWARD = """
def reward_func(queries, prompts, labels, **kwargs):
    # deterministic, varied rewards so every estimator gets non-zero advantages on an untrained model
    rewards = [(len(r) % 3) / 2.0 for r in kwargs["responses"]]
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"resp_chars": [float(len(r)) for r in kwargs["responses"]]}}
"""


def write_reward(path: Path, body: str = VARIED_REWARD) -> Path:
    path.write_text(body)
    return path


def worker_plan(cfg, total_updates: int, world_size: int = 1):
    """The run's batch plan of ``cfg`` over ``world_size`` actor ranks, as ``train_ppo_ray`` hands it to the
    workers, with ``total_updates`` optimizer steps (the lr schedule of a worker built without a prompt set)."""
    from rlhforge.config.batching import plan_rl_run

    return dataclasses.replace(plan_rl_run(cfg, world_size=world_size, num_prompts=None), total_updates=total_updates)
