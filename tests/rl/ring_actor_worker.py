"""Run under torchrun: the RL actor's log-prob pass and one optimizer step, with ring attention when
the launch has 2 ranks (--ds.ring_attn_size 2: one ring, both ranks hold all samples) or on 1 rank.

Usage: torchrun --nproc_per_node R ring_actor_worker.py MODEL_DIR OUT.pt
Writes on rank 0 {"logprobs": [per-sample tensors], "metrics": {...}, "grads": {name: full gradient}}.
"""

from __future__ import annotations

import os
import sys

import torch


def main():
    model_dir, out_path = sys.argv[1], sys.argv[2]
    from transformers import AutoTokenizer

    from rlhforge.config.parsing import from_dict
    from rlhforge.config.rl import RLConfig
    from rlhforge.workers.actor import ActorWorker, PolicyLossSpec
    from tests.rl.dynamic_batch_worker import experience_samples
    from tests.rl.helpers import worker_plan

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", 1))
    samples = experience_samples()  # 8 samples of mixed lengths; pairs of 66, 63, 60 and 19 tokens
    cfg = from_dict(RLConfig, {
        "actor.model_name_or_path": model_dir, "data.prompt_dataset": "builtin:arithmetic",
        "reward.remote_url": "builtin:arithmetic", "rollout.batch_size": 8, "train.batch_size": 8,
        "train.micro_batch_size": 2, "ds.param_dtype": "fp32", "train.device": "cpu", "ds.strategy": "torch",
        "ds.packing_samples": True, "ds.ring_attn_size": world, "ds.ring_attn_head_stride": 1})
    worker = ActorWorker(cfg, AutoTokenizer.from_pretrained(model_dir), worker_plan(cfg, 4, world), group_size=world)
    logprobs = worker.logprobs(samples, micro_batch_size=2, temperature=0.7)
    grads: dict = {}
    step = worker.strategy.step

    def recording_step():
        grads.update({n: p.grad.detach().clone() for n, p in worker.strategy.module.named_parameters()
                      if p.grad is not None})
        return step()

    worker.strategy.step = recording_step
    spec = PolicyLossSpec(loss_kwargs={"eps_low": 0.2, "eps_high": 0.2}, agg_mode="seq_mean_token_mean",
                          temperature=0.7, entropy_coef=0.01, kl_loss_coef=0.1)
    metrics = worker.train_step(samples, spec)
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save({"logprobs": logprobs, "metrics": metrics, "grads": grads}, out_path)


if __name__ == "__main__":
    main()
