"""``--ds.enable_sleep``: move a trainer's optimizer states to host memory between its phases.

In the hybrid engine (``--train.colocate_all``) the actor, critic, reference and the generation
engines take turns on the same devices. While the engines generate, a sleeping trainer keeps
only its weights on the device: Adam's moments (2x the fp32 weights, the largest state) wait in
pinned host memory and come back before the next update.

- DeepSpeed: ``engine.offload_states()`` / ``engine.reload_states()`` (DeepSpeed >= 0.16; states
  already offloaded by ``--ds.adam_offload`` are left alone).
- Plain torch: every optimizer state tensor is moved to CPU and back.
- On a CPU device there is nowhere to offload to: both calls report ``{"moved_bytes": 0}``.
  The GPU paths are tested where a GPU is available (``tests/rl/test_sleep.py``, marked ``gpu``).
"""

from __future__ import annotations

import torch

__all__ = ["offload_states", "reload_states", "move_optimizer_states"]


def move_optimizer_states(optimizer: torch.optim.Optimizer, device: torch.device | str) -> int:
    """Move every tensor in ``optimizer.state`` to ``device``; returns the bytes moved."""
    moved = 0
    target = torch.device(device)
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.device != target:
                pin = target.type == "cpu" and value.device.type == "cuda"
                new = value.to(target, non_blocking=True)
                state[key] = new.pin_memory() if pin else new
                moved += value.numel() * value.element_size()
    if target.type == "cuda":
        torch.cuda.synchronize()
    return moved


def _is_deepspeed(strategy) -> bool:
    return hasattr(strategy, "engine")


def _move(strategy, to_host: bool) -> dict:
    if strategy.device.type == "cpu":
        return {"moved_bytes": 0}
    if _is_deepspeed(strategy):
        if getattr(strategy.ds_cfg, "adam_offload", False):
            return {"moved_bytes": 0}  # the states already live in host memory
        if to_host:
            strategy.engine.offload_states()
            torch.cuda.empty_cache()
        else:
            strategy.engine.reload_states()
        return {"moved_bytes": -1}  # DeepSpeed does not report it
    moved = move_optimizer_states(strategy.optimizer, "cpu" if to_host else strategy.device)
    if to_host:
        torch.cuda.empty_cache()
    return {"moved_bytes": moved}


def offload_states(strategy) -> dict:
    return _move(strategy, to_host=True)


def reload_states(strategy) -> dict:
    return _move(strategy, to_host=False)
