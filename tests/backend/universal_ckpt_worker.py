"""Run under torchrun (or plainly, for one rank): train / resume a tiny model with DeepSpeed ZeRO.

Usage: universal_ckpt_worker.py MODEL_DIR CKPT_ROOT OUT.pt STAGES MODE   (STAGES: e.g. 2,3; one run each,
checkpoints under CKPT_ROOT/zero<STAGE>, results {stage: ...})
  MODE train:  2 optimizer steps, save a resume checkpoint (step_2), record the gathered weights and
               Adam moments, then 2 more steps recording each step's loss.
  MODE resume: load step_2 with --ds.use_universal_ckpt, record the weights and moments, then the
               same 2 steps recording each step's loss.
Every step uses the same global batch of 8 samples (step-indexed), split evenly over the ranks.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from dist_grad_worker import batch_tokens, nll_sum  # noqa: E402

GLOBAL, MICRO, STEPS = 8, 2, 4


def gathered_state(strategy):
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    opt = strategy.engine.optimizer
    if hasattr(opt, "_hp_optimizer_states_linked"):  # ZeRO-1/2 link the moments once, at the first step,
        opt._hp_optimizer_states_linked = False  # before every group has them: link again to read them all
        opt._lazy_init_hp_params_optimizer_state()
    out = {}
    for name, p in strategy.module.named_parameters():
        out[name] = {
            "fp32": safe_get_full_fp32_param(p).detach().clone(),
            "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").detach().clone(),
            "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").detach().clone(),
        }
    return out


def train_step(strategy, wrapped, step, world):
    samples = batch_tokens(1000, n=GLOBAL, seed=100 + step)
    per_rank = GLOBAL // world
    mine = samples[strategy.rank * per_rank:(strategy.rank + 1) * per_rank]
    total_targets = sum(float(m[1:].sum()) for _, m in samples)
    groups = [mine[i:i + MICRO] for i in range(0, len(mine), MICRO)]
    loss_sum = torch.zeros(())
    for k, group in enumerate(groups):
        s, _ = nll_sum(wrapped, group)
        strategy.backward(s * world / total_targets, is_last_micro_batch=k == len(groups) - 1)
        loss_sum += s.detach()
    stats = strategy.step()
    return strategy.all_reduce(loss_sum, "sum").item() / total_targets, stats


def run(model_dir, root, stage, mode):
    from transformers import AutoModelForCausalLM

    from rlhforge.backend.checkpoint import load_checkpoint, save_checkpoint
    from rlhforge.backend.factory import build_strategy
    from rlhforge.config.batching import plan_batches
    from rlhforge.config.components import AdamConfig, DSConfig, OptimConfig, TrainConfig

    world = int(os.environ.get("WORLD_SIZE", 1))
    ds = DSConfig(strategy="deepspeed", zero_stage=stage, param_dtype="fp32", use_universal_ckpt=mode == "resume")
    optim = OptimConfig(adam=AdamConfig(lr=1e-3), lr_scheduler="cosine", lr_warmup_ratio=0.25)
    plan = plan_batches(num_samples=GLOBAL * STEPS, batch_size=GLOBAL, micro_batch_size=MICRO, world_size=world,
                        max_epochs=1)
    strategy = build_strategy(ds, optim, TrainConfig(device="cpu", micro_batch_size=MICRO, batch_size=GLOBAL), plan)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    wrapped = strategy.prepare(model, STEPS)
    result = {"losses": [], "lr": []}
    if mode == "train":
        for step in range(2):
            train_step(strategy, wrapped, step, world)
        save_checkpoint(strategy, root, 2, {"global_step": 2, "samples_seen": 2 * GLOBAL})
    else:
        result["trainer_state"] = load_checkpoint(strategy, os.path.join(root, "step_2"))
    result["state"] = gathered_state(strategy)
    for step in range(2, STEPS):
        loss, stats = train_step(strategy, wrapped, step, world)
        result["losses"].append(loss)
        result["lr"].append(stats["lr"])
    strategy.engine.destroy()
    return strategy.rank, result


def main():
    model_dir, root, out_path, stages, mode = sys.argv[1:6]
    results = {}
    for stage in map(int, stages.split(",")):
        rank, results[stage] = run(model_dir, os.path.join(root, f"zero{stage}"), stage, mode)
    if rank == 0:
        torch.save(results, out_path)


if __name__ == "__main__":
    main()
