"""Run under torchrun (or plainly, for one rank): DeepSpeed AutoTP on a tiny model.

Usage: autotp_worker.py MODEL_DIR OUT.pt STAGE:TP ...
For each spec: two optimizer steps on one global batch of 8 samples split over the data-parallel
ranks (ranks of one tensor-parallel group get the same samples); records each step's loss, the
first step's gradients (tensor-parallel shards gathered), the local parameter shapes, and the
gathered full state dict after the two steps. Rank 0 writes {spec: {...}}.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from dist_grad_worker import batch_tokens, nll_sum  # noqa: E402

GLOBAL, MICRO = 8, 2


def gathered_grads(strategy, full_shapes):
    """The full gradient of every parameter: a shard of a split layer is all-gathered over the
    tensor-parallel group along the dimension where its shape differs from the full one."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    tp_group = groups.get_tensor_model_parallel_group() if strategy.tp_size > 1 else None
    out = {}
    for name, p in strategy.module.named_parameters():
        g = p.grad.detach().clone().float()
        if tuple(g.shape) != tuple(full_shapes[name]):
            dim = next(d for d, (a, b) in enumerate(zip(g.shape, full_shapes[name])) if a != b)
            parts = [torch.empty_like(g) for _ in range(strategy.tp_size)]
            dist.all_gather(parts, g.contiguous(), group=tp_group)
            g = torch.cat(parts, dim=dim)
        out[name] = g
    return out


def run(model_dir, stage, tp):
    from transformers import AutoModelForCausalLM

    from rlhforge.backend.factory import build_strategy
    from rlhforge.config.batching import plan_batches
    from rlhforge.config.components import AdamConfig, DSConfig, OptimConfig, TrainConfig

    world = int(os.environ.get("WORLD_SIZE", 1))
    ds = DSConfig(strategy="deepspeed", zero_stage=stage, param_dtype="fp32", tensor_parallel_size=tp)
    optim = OptimConfig(adam=AdamConfig(lr=1e-3), lr_scheduler="constant", lr_warmup_ratio=0.0)
    plan = plan_batches(num_samples=GLOBAL * 2, batch_size=GLOBAL, micro_batch_size=MICRO, world_size=world // tp,
                        max_epochs=1)
    strategy = build_strategy(ds, optim, TrainConfig(device="cpu", micro_batch_size=MICRO, batch_size=GLOBAL), plan)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    wrapped = strategy.prepare(model, 2)
    result = {"losses": [], "local_shapes": {n: tuple(p.shape) for n, p in strategy.module.named_parameters()},
              "dp": (strategy.dp_rank, strategy.dp_size), "grad_accum": plan.grad_accum_steps}
    for step in range(2):
        samples = batch_tokens(1000, n=GLOBAL, seed=200 + step)
        per_rank = GLOBAL // strategy.dp_size
        mine = samples[strategy.dp_rank * per_rank:(strategy.dp_rank + 1) * per_rank]
        local = torch.tensor(sum(float(m[1:].sum()) for _, m in mine))
        # as the trainers do: the sum over *all* ranks (each tensor-parallel rank counts its group's
        # tokens once more) and the scale by the world size: nll * world / (tp * tokens) = nll * dp / tokens
        total = strategy.all_reduce(local.clone(), "sum").item()
        groups = [mine[i:i + MICRO] for i in range(0, len(mine), MICRO)]
        nll = torch.zeros(())
        for k, group in enumerate(groups):
            s, _ = nll_sum(wrapped, group)
            strategy.backward(s * world / total, is_last_micro_batch=k == len(groups) - 1)
            nll += s.detach()
        if step == 0 and stage == 0:
            result["grads"] = gathered_grads(strategy, full_shapes)
        strategy.step()
        result["losses"].append(strategy.all_reduce(nll, "sum").item() / total)
    result["state"] = strategy.full_state_dict()
    strategy.engine.destroy()
    return strategy.rank, result


def main():
    model_dir, out_path, *specs = sys.argv[1:]
    results = {}
    for spec in specs:
        stage, tp = map(int, spec.split(":"))
        rank, results[spec] = run(model_dir, stage, tp)
    if rank == 0:
        torch.save(results, out_path)


if __name__ == "__main__":
    main()
