"""Run in its own process (a one-rank DeepSpeed group): ``--ds.enable_sleep``'s DeepSpeed calls on a real
ZeRO-3 / ZeRO-2 engine on CPU. Prints one JSON object per stage: what ``offload_states`` moved (DeepSpeed's
own ``optimizer.offloaded_states``), whether a forward and an optimizer step still work, and the loss
sequence against a run that never slept.

Usage: python -m tests.rl.ds_sleep_worker STAGE
"""

from __future__ import annotations

import json
import sys

import torch


def _moved(strategy, asked: list[str]) -> dict:
    """What DeepSpeed records as offloaded, what was asked, and where the torch optimizer's states are."""
    inner = strategy.engine.optimizer.optimizer
    devices = {str(v.device) for st in inner.state.values() for v in st.values() if torch.is_tensor(v)}
    return {"deepspeed": sorted(s.value for s in strategy.engine.optimizer.offloaded_states), "asked": asked,
            "optimizer_state_devices": sorted(devices)}


def run(stage: int, sleep: bool) -> dict:
    from rlhforge.backend.factory import build_strategy
    from rlhforge.backend.sleep import deepspeed_sleep
    from rlhforge.config.batching import plan_batches
    from rlhforge.config.components import AdamConfig, DSConfig, OptimConfig, TrainConfig

    ds = DSConfig(strategy="deepspeed", zero_stage=stage, param_dtype="fp32")
    optim = OptimConfig(adam=AdamConfig(lr=1e-2), lr_warmup_ratio=0.0)
    plan = plan_batches(num_samples=4, batch_size=4, micro_batch_size=4, world_size=1, max_epochs=1)
    strategy = build_strategy(ds, optim, TrainConfig(device="cpu", micro_batch_size=4, batch_size=4), plan)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    wrapped = strategy.prepare(model, 10)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    out = {"losses": [], "offloaded": []}
    if sleep:  # right after start-up, as the trainer does
        asked = deepspeed_sleep(strategy.engine, stage, to_host=True, pin_memory=False)
        out["offloaded"].append(_moved(strategy, asked))
        with torch.no_grad():  # generation / weight sync read the parameters while the states sleep
            out["forward_while_asleep"] = float(wrapped(x).sum())
        out["weights_while_asleep"] = {k: float(v.float().sum()) for k, v in strategy.iter_full_weights()}
    for _ in range(3):
        if sleep:
            deepspeed_sleep(strategy.engine, stage, to_host=False)
        loss = wrapped(x).pow(2).mean()
        strategy.backward(loss, is_last_micro_batch=True)
        strategy.step()
        out["losses"].append(float(loss))
        if sleep:
            asked = deepspeed_sleep(strategy.engine, stage, to_host=True, pin_memory=False)
            out["offloaded"].append(_moved(strategy, asked))
    return out


if __name__ == "__main__":
    stage = int(sys.argv[1])
    print("RESULT", json.dumps({"slept": run(stage, True), "awake": run(stage, False)}))
