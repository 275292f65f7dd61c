"""``--ds.enable_sleep``: move a trainer's optimizer states to host memory between its phases.

In the hybrid engine (``--train.colocate_all``) the actor, critic, reference and the generation
engines take turns on the same devices. While the engines generate, a sleeping trainer keeps
only its weights on the device: Adam's moments (2x the fp32 weights, the largest state) wait in
pinned host memory and come back before the next update.

- DeepSpeed (ZeRO 1-3): ``engine.offload_states(include=DEEPSPEED_OFFLOAD)`` / ``reload_states()``
  (DeepSpeed >= 0.16; states already offloaded by ``--ds.adam_offload`` are left alone). The include
  list is OpenRLHF's: the optimizer states, the fp32 master weights and the contiguous gradient buffer.
  Never ``lp_params``: DeepSpeed's default (everything) also moves the training-dtype parameters, which
  ZeRO-3 gathers for the weight sync and generation (a crash at the first sync), nor ``lp_grads``.
  The trainer offloads once right after start-up (the engines wake into the room it leaves) and then
  around every update (trainers/rl/loop.py).
- Plain torch: every optimizer state tensor is moved to CPU and back.
- On a CPU device there is nowhere to offload to: both calls report ``{"moved_bytes": 0}``.
  The GPU paths are tested where a GPU is available (``tests/rl/test_sleep.py``, marked ``gpu``).
"""

from __future__ import annotations

import torch

__all__ = ["offload_states", "reload_states", "move_optimizer_states", "move_master_weights", "DEEPSPEED_OFFLOAD", "deepspeed_offload_kwargs",
           "deepspeed_sleep"]

# what a sleeping DeepSpeed trainer moves to host memory (OffloadStateTypeEnum values); lp_params and
# lp_grads stay on the device (see the module docstring)
DEEPSPEED_OFFLOAD = ("optim_states", "hp_params", "contiguous_grad_buffer")


def deepspeed_offload_kwargs(pin_memory: bool = True) -> dict:
    """The arguments of ``engine.offload_states`` for ``--ds.enable_sleep``."""
    from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

    return {"include": [OffloadStateTypeEnum(v) for v in DEEPSPEED_OFFLOAD], "device": OffloadDeviceEnum.cpu,
            "pin_memory": pin_memory, "non_blocking": False}


def deepspeed_sleep(engine, zero_stage: int, to_host: bool, pin_memory: bool = True) -> list[str]:
    """Offload (``to_host``) or reload a DeepSpeed engine's states as ``--ds.enable_sleep`` does (ZeRO 1-3);
    returns what was asked to move. ZeRO-3's ``offload_states`` moves the optimizer states and master
    weights of DeepSpeed's FusedAdam only (it asserts so); with another optimizer (rlhforge's torch AdamW,
    Muon) DeepSpeed moves the gradient buffer, and the optimizer's own state tensors and the fp32 master
    partitions (``fp32_partitioned_groups_flat``, ``4P/N`` bytes per rank) are moved here, as DeepSpeed's
    own ``hp_params`` branch moves them (gpu-review-2 F8: they used to stay on the device)."""
    if zero_stage == 0:
        raise ValueError("--ds.enable_sleep under DeepSpeed needs --ds.zero_stage 1-3 (its offload_states has no "
                         "ZeRO-0 optimizer); use --ds.strategy torch for an unsharded actor")
    inner = getattr(engine.optimizer, "optimizer", None)  # the torch optimizer ZeRO wraps
    own_states = zero_stage == 3 and type(inner).__name__ != "FusedAdam"
    device = torch.device(engine.device)  # the engine's own (DeepSpeedEngine sets it at start-up)
    if not to_host:
        engine.reload_states()
        if own_states:
            move_master_weights(engine.optimizer, device)
            move_optimizer_states(inner, device)
        return []
    kwargs = deepspeed_offload_kwargs(pin_memory)
    if own_states:
        kwargs["include"] = [s for s in kwargs["include"] if s.value == "contiguous_grad_buffer"]
        move_master_weights(engine.optimizer, "cpu", pin_memory)
        move_optimizer_states(inner, "cpu")
    engine.offload_states(**kwargs)
    if zero_stage == 3:
        engine.empty_partition_cache()  # ZeRO-3's gathered-parameter cache: rebuilt by the next forward
    own = ["hp_params (fp32 master partitions)", "optim_states (torch optimizer)"] if own_states else []
    return [s.value for s in kwargs["include"]] + own


def move_master_weights(zero_optimizer, device: torch.device | str, pin_memory: bool = True) -> int:
    """Move ZeRO-3's fp32 master partitions (``fp32_partitioned_groups_flat``: the torch optimizer's own
    parameters, so its state stays keyed to them) to ``device`` in place (``.data``); returns the bytes."""
    moved = 0
    target = torch.device(device)
    for flat in getattr(zero_optimizer, "fp32_partitioned_groups_flat", []):
        if flat.device == target:
            continue
        new = flat.data.to(target)
        if pin_memory and target.type == "cpu" and flat.device.type == "cuda":
            new = new.pin_memory()
        flat.data = new
        moved += flat.numel() * flat.element_size()
    return moved


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
    if strategy.device.type == "cpu":  # (DeepSpeed ZeRO-0 is refused at start-up: config/rl_workers.py)
        return {"moved_bytes": 0}
    if _is_deepspeed(strategy):
        if getattr(strategy.ds_cfg, "adam_offload", False):
            return {"moved_bytes": 0}  # the states already live in host memory
        deepspeed_sleep(strategy.engine, strategy.ds_cfg.zero_stage, to_host)
        if to_host:
            torch.cuda.empty_cache()
        return {"moved_bytes": -1}  # DeepSpeed does not report it
    moved = move_optimizer_states(strategy.optimizer, "cpu" if to_host else strategy.device)
    if to_host:
        torch.cuda.empty_cache()
    return {"moved_bytes": moved}


def offload_states(strategy) -> dict:
    return _move(strategy, to_host=True)


def reload_states(strategy) -> dict:
    return _move(strategy, to_host=False)
