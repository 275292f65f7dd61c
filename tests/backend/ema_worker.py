"""EMA of the tiny model's weights over a few optimizer steps under one strategy (run as a subprocess,
under torchrun for several ranks).

Usage: [torchrun --nproc_per_node N] ema_worker.py MODEL_DIR OUT_DIR BETA STEPS STRATEGY[:ZERO_STAGE] ...
Rank 0 writes OUT_DIR/SPEC/live.pt ({"init": state, "steps": [full state after each step]}) and the
EMA export OUT_DIR/SPEC/export (an HF folder, written through ``ParamEMA.swapped`` + ``save_hf``).
"""

import os
import sys
from pathlib import Path

import torch


def main():
    model_dir, out_dir, beta, steps = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).parent))
    from muon_worker import fixed_batch, mean_nll
    from rlhforge.backend.ema import ParamEMA
    from rlhforge.backend.factory import build_strategy
    from rlhforge.config.batching import plan_batches
    from rlhforge.config.components import AdamConfig, DSConfig, OptimConfig, TrainConfig
    from rlhforge.models.export import save_hf

    world = int(os.environ.get("WORLD_SIZE", 1))
    for spec in sys.argv[5:]:
        name, _, stage = spec.partition(":")
        ds = DSConfig(strategy=name, zero_stage=int(stage or 0), param_dtype="fp32")
        optim = OptimConfig(adam=AdamConfig(lr=1e-2), lr_scheduler="constant", lr_warmup_ratio=0.0)
        plan = plan_batches(num_samples=4, batch_size=4, micro_batch_size=4 // world, world_size=world, max_epochs=1)
        strategy = build_strategy(ds, optim, TrainConfig(device="cpu", micro_batch_size=4 // world, batch_size=4), plan)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
        wrapped = strategy.prepare(model, steps)
        ema = ParamEMA(strategy.module, beta, strategy.rank)
        record = {"init": strategy.full_state_dict(), "steps": []}
        ids, attn = fixed_batch(1024, n=4)
        per = 4 // world
        mine = slice(strategy.rank * per, (strategy.rank + 1) * per)
        for _ in range(steps):
            loss = mean_nll(wrapped, ids[mine], attn[mine])
            strategy.backward(loss, is_last_micro_batch=True)
            strategy.step()
            ema.update()
            record["steps"].append(strategy.full_state_dict())
        target = out_dir / spec.replace(":", "_")
        with ema.swapped():
            save_hf(strategy, None, target / "export")
        after = strategy.full_state_dict()  # the live weights are back after the export
        if strategy.is_rank0:
            record["after_export"] = after
            torch.save(record, target / "live.pt")
        strategy.barrier()


if __name__ == "__main__":
    main()
