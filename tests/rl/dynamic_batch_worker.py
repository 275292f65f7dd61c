"""Run under torchrun (2 ranks): one actor step with fixed and with token-budget micro-batches.

Usage: torchrun --nproc_per_node 2 dynamic_batch_worker.py MODEL_DIR OUT.pt BUDGET STRATEGY[:STAGE] ...
Each rank trains on its contiguous half of ``experience_samples()``. Writes on rank 0
``{spec: {"fixed"|"budget": {"metrics", "grads", "passes"}}}`` (gradients gathered in full).
"""

from __future__ import annotations

import os
import sys

import torch

LENGTHS = [60, 6, 55, 8, 50, 10, 12, 7]


def experience_samples(lengths=LENGTHS, seed: int = 0):
    """Mixed-length experience with noisy old/ref log-probs and advantages (the same on every rank)."""
    from rlhforge.workers.experience import ExperienceSample

    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        prompt = max(2, n // 3)
        mask = [0] * prompt + [1] * (n - prompt)
        s = ExperienceSample(torch.randint(3, 90, (n,), generator=g).tolist(), mask, reward=0.0, score=0.0)
        noise = lambda: torch.randn(n, generator=g) * torch.tensor(mask, dtype=torch.float32)  # noqa: E731
        s.tensors.update(old_logprobs=-4.0 + 0.3 * noise(), ref_logprobs=-4.0 + 0.3 * noise(),
                         rollout_logprobs=-4.0 + 0.3 * noise(), advantages=noise(), values=0.3 * noise(),
                         returns=noise())
        out.append(s)
    return out


def full_grads(worker, name: str) -> dict:
    out = {}
    for pname, p in worker.strategy.module.named_parameters():
        if name == "deepspeed":
            from deepspeed.utils import safe_get_full_grad

            g = safe_get_full_grad(p)
        else:
            g = p.grad
            if g is not None and hasattr(g, "full_tensor"):  # FSDP2: a sharded DTensor
                g = g.full_tensor()
        if g is not None:
            out[pname] = g.detach().float().clone()
    return out


def main():
    model_dir, out_path, budget = sys.argv[1], sys.argv[2], int(sys.argv[3])
    from transformers import AutoTokenizer

    from rlhforge.config.parsing import from_dict
    from rlhforge.config.rl import RLConfig
    from rlhforge.workers.actor import ActorWorker, PolicyLossSpec
    from tests.rl.helpers import worker_plan

    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    samples = experience_samples()
    per = len(samples) // world
    mine = samples[rank * per : (rank + 1) * per]
    spec = PolicyLossSpec(loss_kwargs={"eps_low": 0.2, "eps_high": 0.2}, agg_mode="seq_mean_token_mean",
                          kl_loss_coef=0.1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    results = {}
    for item in sys.argv[4:]:
        name, _, stage = item.partition(":")
        cfg = from_dict(RLConfig, {
            "actor.model_name_or_path": model_dir, "data.prompt_dataset": "builtin:arithmetic",
            "reward.remote_url": "builtin:arithmetic", "rollout.batch_size": 8, "train.batch_size": 8,
            "train.micro_batch_size": 2, "ds.param_dtype": "fp32", "train.device": "cpu", "ds.strategy": name,
            "ds.zero_stage": int(stage or 0), "ds.packing_samples": True})
        results[item] = {}
        for mode, tokens, packed in (("fixed", None, False), ("budget", budget, True)):
            # a fresh worker per mode (same weights); DeepSpeed's config says 2 micro-batches per step,
            # the budget run does 3 on each rank
            worker = ActorWorker(cfg, tokenizer, worker_plan(cfg, 4, world), group_size=world)
            worker.train_tokens, worker.packed = tokens, packed
            grads: dict = {}
            step = worker.strategy.step

            def recording_step(step=step, grads=grads, worker=worker):
                grads.update(full_grads(worker, name))
                return step()

            worker.strategy.step = recording_step
            results[item][mode] = {"metrics": worker.train_step(mine, spec), "grads": grads}
    if rank == 0:
        torch.save(results, out_path)


if __name__ == "__main__":
    main()
