"""Pick and build the training strategy of a run (the one place that knows every implementation)."""

from __future__ import annotations

from typing import Any

__all__ = ["build_strategy"]


def build_strategy(ds_cfg, optim_cfg, train_cfg, batch_plan) -> Any:
    """Pick the strategy: ``auto`` -> plain torch for one process, DeepSpeed for several."""
    from rlhforge.backend.device import dist_info

    name = ds_cfg.strategy
    if name == "auto":
        name = "deepspeed" if dist_info().world_size > 1 else "torch"
    if name == "torch":
        from rlhforge.backend.torch_strategy import TorchStrategy

        return TorchStrategy(ds_cfg, optim_cfg, train_cfg)
    if name == "deepspeed":
        from rlhforge.backend.deepspeed_strategy import DeepSpeedStrategy

        return DeepSpeedStrategy(ds_cfg, optim_cfg, train_cfg, batch_plan)
    if name == "fsdp2":
        from rlhforge.backend.fsdp2_strategy import FSDP2Strategy

        return FSDP2Strategy(ds_cfg, optim_cfg, train_cfg)
    raise ValueError(f"unknown --ds.strategy {name!r}; valid: auto, torch, deepspeed, fsdp2")
