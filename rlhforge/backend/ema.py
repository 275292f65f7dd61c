"""Exponential moving average of a model's trainable parameters (``--train.enable_ema``).

After every applied optimizer step ``ema <- beta * ema + (1 - beta) * theta`` (OpenRLHF's
``moving_average``: once per optimizer step, the EMA starting from the initial weights). The EMA is
kept in fp32 on the host, one tensor per trainable parameter *as this rank stores it*:

- plain torch, DDP, ZeRO 0-2: the full parameter (every rank holds the same EMA);
- ZeRO-3: the rank's flat partition (``param.ds_tensor``);
- FSDP2: the rank's DTensor shard (``param.to_local()``).

So no rank ever gathers for the update, and the EMA costs one fp32 copy of the local shard. To
export it, ``swapped()`` copies the EMA into the local storage, lets the strategy gather and write
as it does for the live model (``save_hf``), and restores the live values bit for bit. The resume
checkpoint holds each rank's EMA in ``ema_rank{R}.pt`` beside the strategy's state.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch

__all__ = ["ParamEMA", "ema_update_"]


def ema_update_(ema: torch.Tensor, value: torch.Tensor, beta: float) -> None:
    """In place: ``ema = beta * ema + (1 - beta) * value`` (value cast to the EMA's dtype and device)."""
    ema.mul_(beta).add_(value.detach().to(ema.device, ema.dtype), alpha=1.0 - beta)


def _local(param: torch.nn.Parameter) -> torch.Tensor:
    """The tensor this rank stores for ``param`` (a ZeRO-3 partition, an FSDP2 shard, or the parameter)."""
    ds = getattr(param, "ds_tensor", None)
    if ds is not None:
        return ds.data
    if hasattr(param, "to_local"):
        return param.to_local()
    return param.data


class ParamEMA:
    """EMA of ``module``'s trainable parameters on this rank (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, beta: float, rank: int = 0, device: str | torch.device = "cpu"):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"the EMA beta must be in [0, 1) (got {beta})")
        self.module, self.beta, self.rank = module, float(beta), int(rank)
        self.device = torch.device(device)
        with torch.no_grad():
            self.shadow: dict[str, torch.Tensor] = {
                name: _local(p).detach().to(self.device, torch.float32, copy=True) for name, p in self._params()}

    def _params(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return ((n, p) for n, p in self.module.named_parameters() if p.requires_grad)

    @torch.no_grad()
    def update(self) -> None:
        """One EMA step towards the current parameters (call after an applied optimizer step)."""
        for name, p in self._params():
            ema_update_(self.shadow[name], _local(p), self.beta)

    @contextlib.contextmanager
    def swapped(self):
        """Inside the block the module's (local) parameters hold the EMA; afterwards, the live values again."""
        live = {}
        with torch.no_grad():
            for name, p in self._params():
                local = _local(p)
                live[name] = local.detach().clone()
                local.copy_(self.shadow[name].to(local.device, local.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for name, p in self._params():
                    _local(p).copy_(live[name])

    # -- resume ------------------------------------------------------------------------------------
    def path(self, directory: str | Path) -> Path:
        return Path(directory) / f"ema_rank{self.rank}.pt"

    def save(self, directory: str | Path) -> None:
        from rlhforge.backend.checkpoint import torch_save

        torch_save({"beta": self.beta, "shadow": self.shadow}, self.path(directory))

    def load(self, directory: str | Path) -> None:
        path = self.path(directory)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no EMA state for rank {self.rank} (was the checkpoint written without "
                                    "--train.enable_ema, or by another number of ranks?)")
        shadow = torch.load(path, map_location=self.device, weights_only=True)["shadow"]
        mismatch = sorted(set(shadow) ^ set(self.shadow)) + sorted(
            n for n in shadow if n in self.shadow and shadow[n].shape != self.shadow[n].shape)
        if mismatch:
            raise ValueError(f"{path}: EMA state does not fit this model/sharding (first differences: {mismatch[:3]})")
        self.shadow = {n: t.to(self.device, torch.float32) for n, t in shadow.items()}
