"""One or more Muon optimizer steps on a fixed batch of the tiny model under one strategy (run as a
subprocess: DeepSpeed and FSDP2 open a process group).

Usage: [torchrun --nproc_per_node N] muon_worker.py MODEL_DIR OUT.pt OPTIM STEPS STRATEGY[:ZERO_STAGE] ...
Writes {spec: {"losses": [...], "params": {name: full fp32 tensor after the steps}}}.
"""

import os
import sys

import torch


def fixed_batch(vocab: int, n: int = 4, length: int = 12, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (n, length), generator=g)
    return ids, torch.ones_like(ids)


def mean_nll(model, ids, attn):
    logits = model(input_ids=ids, attention_mask=attn).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return -logp.mean()


def run(model_dir: str, spec: str, optim: str, steps: int, lr: float = 0.02, max_norm: float = 0.0) -> dict:
    from transformers import AutoModelForCausalLM

    from rlhforge.backend.factory import build_strategy
    from rlhforge.config.batching import plan_batches
    from rlhforge.config.components import AdamConfig, DSConfig, MuonConfig, OptimConfig, TrainConfig

    name, _, stage = spec.partition(":")
    ds = DSConfig(strategy=name, zero_stage=int(stage or 0), param_dtype="fp32")
    optim_cfg = OptimConfig(name=optim, adam=AdamConfig(lr=1e-3), muon=MuonConfig(lr=lr), lr_scheduler="constant",
                            lr_warmup_ratio=0.0, max_norm=max_norm)
    world = int(os.environ.get("WORLD_SIZE", 1))  # every rank trains on the same batch: the mean gradient is one rank's
    plan = plan_batches(num_samples=4 * world, batch_size=4 * world, micro_batch_size=4, world_size=world, max_epochs=1)
    strategy = build_strategy(ds, optim_cfg, TrainConfig(device="cpu", micro_batch_size=4, batch_size=4 * world), plan)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    wrapped = strategy.prepare(model, steps)
    ids, attn = fixed_batch(model.config.vocab_size)
    losses = []
    for _ in range(steps):
        loss = mean_nll(wrapped, ids, attn)
        strategy.backward(loss, is_last_micro_batch=True)
        strategy.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        losses.append(float(mean_nll(wrapped, ids, attn)))
    return {"losses": losses, "params": strategy.full_state_dict()}


def deepspeed_reference(model_dir: str, lr: float = 0.02) -> dict:
    """One Muon step recomputed outside ZeRO: the plain-torch gradient of the fixed batch through DeepSpeed's
    own ``muon_update`` (zero momentum, its default fp16 "gram" Newton-Schulz), ``param - lr * update`` for
    the Muon matrices. ZeRO-2 and ZeRO-3 must each land on it within that Newton-Schulz's precision."""
    from deepspeed.runtime.zero.muon.original_muon import muon_update
    from transformers import AutoModelForCausalLM

    from rlhforge.backend.optim import muon_param_split

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    ids, attn = fixed_batch(model.config.vocab_size)
    mean_nll(model, ids, attn).backward()
    named = dict(model.named_parameters())
    muon, _ = muon_param_split(model)
    with torch.no_grad():
        params = {n: named[n] - lr * muon_update(named[n].grad.clone(), torch.zeros_like(named[n]), beta=0.95,
                                                 ns_method="gram") for n in muon}
    return {"losses": [], "params": params}


if __name__ == "__main__":
    model_dir, out, optim, steps = sys.argv[1:5]
    results = {spec: deepspeed_reference(model_dir) if spec == "deepspeed_reference" else run(model_dir, spec, optim, int(steps))
               for spec in sys.argv[5:]}
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save(results, out)
