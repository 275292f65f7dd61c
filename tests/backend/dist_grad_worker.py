"""Run under torchrun: per-rank micro-batched loss/gradients for several strategies.

Usage: torchrun --nproc_per_node N dist_grad_worker.py MODEL_DIR OUT.pt MICRO_BATCH STRATEGY[:STAGE] ...
Writes {name: {"loss": float, "grads": {param: tensor}}} on rank 0.
"""

import sys

import torch


def batch_tokens(vocab: int, n: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        length = 5 + (i * 3) % 7  # uneven lengths 5..11
        ids = torch.randint(3, vocab, (length,), generator=g)
        mask = torch.zeros(length)
        mask[length // 2 :] = 1.0  # uneven target counts
        samples.append((ids, mask))
    return samples


def nll_sum(model, samples):
    width = max(len(ids) for ids, _ in samples)
    input_ids = torch.zeros(len(samples), width, dtype=torch.long)
    attn = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width)
    for r, (ids, m) in enumerate(samples):
        input_ids[r, : len(ids)], attn[r, : len(ids)], mask[r, : len(ids)] = ids, 1, m
    logits = model(input_ids=input_ids, attention_mask=attn).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return -(logp * mask[:, 1:]).sum(), mask[:, 1:].sum()


def main():
    model_dir, out_path, micro = sys.argv[1], sys.argv[2], int(sys.argv[3])
    from transformers import AutoModelForCausalLM

    from rlhforge.backend.factory import build_strategy
    from rlhforge.config.batching import plan_batches
    from rlhforge.config.components import DSConfig, OptimConfig, TrainConfig

    results = {}
    for spec in sys.argv[4:]:
        name, _, stage = spec.partition(":")
        ds = DSConfig(strategy=name, zero_stage=int(stage or 0), param_dtype="fp32")
        train = TrainConfig(device="cpu", micro_batch_size=micro, batch_size=8)
        samples = batch_tokens(1000)
        import os

        world = int(os.environ.get("WORLD_SIZE", 1))
        plan = plan_batches(num_samples=8, batch_size=8, micro_batch_size=micro, world_size=world, max_epochs=1)
        strategy = build_strategy(ds, OptimConfig(), train, plan)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
        wrapped = strategy.prepare(model, 1)
        per_rank = 8 // world
        mine = samples[strategy.rank * per_rank : (strategy.rank + 1) * per_rank]
        total_targets = sum(float(m[1:].sum()) for _, m in samples)
        groups = [mine[i : i + micro] for i in range(0, len(mine), micro)]
        loss_total = torch.zeros(())
        for k, group in enumerate(groups):
            s, _ = nll_sum(wrapped, group)
            loss = s * world / total_targets
            strategy.backward(loss, is_last_micro_batch=k == len(groups) - 1)
            loss_total += s.detach()
        grads = {}
        for pname, p in strategy.module.named_parameters():
            if name == "deepspeed":
                from deepspeed.utils import safe_get_full_grad

                g = safe_get_full_grad(p)
            else:
                g = p.grad
                if g is not None and hasattr(g, "full_tensor"):  # FSDP2: a sharded DTensor
                    g = g.full_tensor()
            grads[pname] = g.detach().clone().float() if g is not None else None
        loss_value = strategy.all_reduce(loss_total, "sum").item() / total_targets
        results[spec] = {"loss": loss_value, "grads": grads}
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save(results, out_path)


if __name__ == "__main__":
    main()
