"""Plain PyTorch strategy: one process, or DDP when launched with torchrun."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from rlhforge.backend.device import dist_info, init_process_group, resolve_device, resolve_dtype
from rlhforge.backend.optim import build_optimizer, build_scheduler
from rlhforge.backend.checkpoint import torch_save
from rlhforge.backend.guards import poison_nonfinite
from rlhforge.backend.strategy import all_reduce_tensor, barrier, clip_and_step


class TorchStrategy:
    """fp32 master weights; bf16/fp16 through autocast; DDP across ranks (gloo on CPU, nccl on GPU)."""

    def __init__(self, ds_cfg, optim_cfg, train_cfg):
        info = dist_info()
        self.rank, self.world_size = info.rank, info.world_size
        self.device = resolve_device(train_cfg.device, info.local_rank)
        self.dtype = resolve_dtype(ds_cfg.param_dtype, self.device)
        self.optim_cfg = optim_cfg
        init_process_group(self.device)
        self.model: torch.nn.Module | None = None
        self.optimizer = None
        self.scheduler = None

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    def prepare(self, model: torch.nn.Module, total_steps: int) -> torch.nn.Module:
        model = model.to(self.device)
        self._module = model
        if self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.model = model
        self.optimizer = build_optimizer(self._module, self.optim_cfg, fused=self.device.type == "cpu")
        self.scheduler = build_scheduler(self.optimizer, self.optim_cfg, total_steps)
        return model

    @property
    def module(self) -> torch.nn.Module:
        return self._module

    def model_init(self):
        """Where the model is loaded (``Strategy.model_init``): nothing to do here, the model loads whole."""
        return contextlib.nullcontext()

    def autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def no_sync(self, is_last_micro_batch: bool):
        if self.world_size > 1 and not is_last_micro_batch:
            return self.model.no_sync()
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, is_last_micro_batch: bool = True) -> None:
        # DDP averages gradients over ranks when the last micro-batch's backward runs.
        with self.no_sync(is_last_micro_batch):
            poison_nonfinite(loss).backward()

    def step(self) -> dict[str, float]:
        return clip_and_step(self._module, self.optimizer, self.scheduler, self.optim_cfg.max_norm)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return all_reduce_tensor(tensor, op, self.world_size, self.device)

    def barrier(self) -> None:
        barrier(self.world_size)

    def full_state_dict(self):
        if not self.is_rank0:
            return None
        return {k: v.detach().to("cpu", copy=True) for k, v in self._module.state_dict().items()}

    def iter_full_weights(self):
        yield from ((k, v.detach()) for k, v in self._module.state_dict().items())

    def save_state(self, directory: Path) -> None:
        if self.is_rank0:
            state = {
                "model": self.full_state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
            }
            torch_save(state, Path(directory) / "torch_state.pt")

    def load_state(self, directory: Path) -> None:
        path = Path(directory) / "torch_state.pt"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: no plain-torch training state here (was the checkpoint written by another --ds.strategy?)"
            )
        state = torch.load(path, map_location="cpu", weights_only=False)
        self._module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def train(self) -> None:
        self._module.train()

    def eval(self) -> None:
        self._module.eval()
