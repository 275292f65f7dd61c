"""Run under torchrun (2 ranks): the weights a LoRA actor hands its generation engines
(``ActorWorker._engine_weights``) under DeepSpeed ZeRO-3, per rank: the (name, dtype, shape) sequence,
the buckets a CUDA-IPC sync would send, and the fingerprint. Rank 0 also fingerprints the merged full
state dict the old path built. Writes JSON on rank 0.

Usage: torchrun --nproc_per_node 2 lora_stream_worker.py MODEL_DIR OUT.json
"""

from __future__ import annotations

import json
import sys

import torch


def main():
    model_dir, out_path = sys.argv[1], sys.argv[2]
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from rlhforge.backend.collective import Fingerprint, state_fingerprint, stream_buckets
    from rlhforge.config.parsing import from_dict
    from rlhforge.config.rl import RLConfig
    from rlhforge.workers.actor import ActorWorker
    from tests.rl.helpers import worker_plan

    torch.set_num_threads(1)
    cfg = from_dict(RLConfig, {
        "actor.model_name_or_path": model_dir, "data.prompt_dataset": "builtin:arithmetic",
        "reward.remote_url": "builtin:arithmetic", "rollout.batch_size": 8, "train.batch_size": 8,
        "train.micro_batch_size": 2, "ds.param_dtype": "fp32", "train.device": "cpu", "ds.strategy": "deepspeed",
        "ds.zero_stage": 3, "ds.lora.rank": 4, "ds.lora.alpha": 8})
    worker = ActorWorker(cfg, AutoTokenizer.from_pretrained(model_dir), worker_plan(cfg, 4))  # 4 micro-batches per step
    with torch.no_grad():  # adapters away from zero, so the merge changes the weights
        for name, p in worker.strategy.module.named_parameters():
            if "lora_B" in name:
                import deepspeed

                with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                    if dist.get_rank() == 0:
                        p.fill_(0.01)
    layout, fp = [], Fingerprint()
    for name, t in worker._engine_weights():
        layout.append([name, str(t.dtype), list(t.shape)])
        fp.add(name, t)
    buckets = [[e[0] for e in entries] for entries, _, _ in stream_buckets(worker._engine_weights(), 64 << 10)]
    full = worker.engine_state_dict()  # the merged full state dict (rank 0), the old path's
    mine = {"layout": layout, "fingerprint": fp.hexdigest(), "buckets": buckets}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        Path = __import__("pathlib").Path
        Path(out_path).write_text(json.dumps({"ranks": ranks, "full_fingerprint": state_fingerprint(full),
                                              "full_names": sorted(full)}))


if __name__ == "__main__":
    main()
