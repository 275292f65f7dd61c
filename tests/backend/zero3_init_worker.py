"""Run under torchrun (2 ranks): a model loaded inside ``DeepSpeedStrategy.model_init()`` under ZeRO-3 is
partitioned as it loads (each rank holds placeholders plus its shard), the same load outside it is
whole, and the prepared model's gathered weights equal the checkpoint's. Writes JSON on rank 0.

Usage: torchrun --nproc_per_node 2 zero3_init_worker.py MODEL_DIR OUT.json
"""

from __future__ import annotations

import json
import sys

import torch


def main():
    model_dir, out_path = sys.argv[1], sys.argv[2]
    import torch.distributed as dist
    from safetensors.torch import load_file
    from transformers.integrations import is_deepspeed_zero3_enabled

    from rlhforge.backend.factory import build_strategy
    from rlhforge.backend.collective import state_fingerprint
    from rlhforge.config.batching import plan_batches
    from rlhforge.config.components import DSConfig, ModelConfig, OptimConfig, TrainConfig
    from rlhforge.models.loading import load_causal_lm

    torch.set_num_threads(1)
    ds = DSConfig(strategy="deepspeed", zero_stage=3, param_dtype="fp32")
    plan = plan_batches(num_samples=4, batch_size=4, micro_batch_size=2, world_size=2, max_epochs=1)
    strategy = build_strategy(ds, OptimConfig(), TrainConfig(device="cpu", micro_batch_size=2, batch_size=4), plan)
    with strategy.model_init():
        inside = is_deepspeed_zero3_enabled()
        model = load_causal_lm(model_dir, ModelConfig(), ds, strategy.device)
    after = is_deepspeed_zero3_enabled()
    local = sum(p.numel() for p in model.parameters())  # placeholders: 0 elements each
    shard = sum(p.ds_tensor.numel() for p in model.parameters() if hasattr(p, "ds_tensor"))
    full = sum(p.ds_numel for p in model.parameters() if hasattr(p, "ds_numel"))
    whole = load_causal_lm(model_dir, ModelConfig(), ds, strategy.device)  # outside: a whole model again
    strategy.prepare(model, 4)
    gathered = dict(strategy.iter_full_weights())
    fp = state_fingerprint({k: v.clone() for k, v in gathered.items() if k in set(whole.state_dict())})
    ckpt = load_file(f"{model_dir}/model.safetensors")
    ref = {k: v for k, v in whole.state_dict().items()}
    mine = {"inside": inside, "after": after, "local_numel": local, "shard_numel": shard, "full_numel": full,
            "whole_numel": sum(p.numel() for p in whole.parameters()), "fingerprint": fp,
            "whole_fingerprint": state_fingerprint(ref),
            "ckpt_equal": all(torch.equal(gathered[k], v) for k, v in ckpt.items() if k in gathered)}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(ranks, f)


if __name__ == "__main__":
    main()
