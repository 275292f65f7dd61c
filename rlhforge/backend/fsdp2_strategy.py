"""FSDP2 strategy (``--ds.strategy fsdp2``): PyTorch's ``fully_shard``, parameters, gradients and
optimizer states sharded over the ranks (the ZeRO-3 layout), gloo on CPU and nccl on GPU.

- Each transformer block (the classes in the model's ``_no_split_modules``, e.g. ``LlamaDecoderLayer``)
  is its own FSDP unit; the root holds the embeddings, the final norm and the head (tied weights
  stay in one unit). Parameters are DTensors sharded on dim 0.
- Mixed precision: with ``--ds.param_dtype bf16|fp16`` the blocks compute in that dtype and reduce
  gradients in fp32; the sharded master weights and Adam states stay fp32.
- Gradient accumulation: gradients are reduce-scattered (averaged over ranks, as DDP does) only on
  the last micro-batch of an optimizer step (``set_requires_gradient_sync``).
- ``full_state_dict`` gathers full fp32 tensors to rank 0's host memory (for export and weight sync);
  checkpoints hold the full model and optimizer state written by rank 0, which every rank reads back
  (a shared file system, as for DeepSpeed checkpoints); fine up to a few billion parameters, where sharded DCP checkpoints
  would be the next step.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from rlhforge.backend.device import dist_info, init_process_group, resolve_device, resolve_dtype, single_process_env
from rlhforge.backend.optim import build_optimizer, build_scheduler
from rlhforge.backend.checkpoint import torch_save
from rlhforge.backend.guards import poison_nonfinite
from rlhforge.backend.strategy import all_reduce_tensor, barrier, clip_and_step


def _block_classes(model: torch.nn.Module) -> set[type]:
    names = set(getattr(model, "_no_split_modules", None) or [])
    base = getattr(model, "base_model", None)  # PEFT wrappers
    names |= set(getattr(getattr(base, "model", None), "_no_split_modules", None) or [])
    return {type(m) for m in model.modules() if type(m).__name__ in names}


class FSDP2Strategy:
    def __init__(self, ds_cfg, optim_cfg, train_cfg):
        info = dist_info()
        self.rank, self.world_size = info.rank, info.world_size
        self.device = resolve_device(train_cfg.device, info.local_rank)
        self.dtype = resolve_dtype(ds_cfg.param_dtype, self.device)
        self.ds_cfg, self.optim_cfg = ds_cfg, optim_cfg
        if self.world_size == 1:
            single_process_env()  # fully_shard needs a process group, even of one rank
        init_process_group(self.device, force=True)
        self.model: torch.nn.Module | None = None

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    def prepare(self, model: torch.nn.Module, total_steps: int) -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        model = model.to(device=self.device, dtype=torch.float32)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        kwargs = {"mesh": mesh}
        if self.dtype != torch.float32:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        blocks = _block_classes(model)
        for module in list(model.modules()):
            if type(module) in blocks:
                fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)
        self.model = model
        self.optimizer = build_optimizer(model, self.optim_cfg)
        self.scheduler = build_scheduler(self.optimizer, self.optim_cfg, total_steps)
        return model

    @property
    def module(self) -> torch.nn.Module:
        return self.model

    def model_init(self):
        """Where the model is loaded (``Strategy.model_init``): nothing to do here, the model loads whole."""
        return contextlib.nullcontext()

    def autocast(self):
        return contextlib.nullcontext()  # the mixed-precision policy casts

    def backward(self, loss: torch.Tensor, is_last_micro_batch: bool = True) -> None:
        self.model.set_requires_gradient_sync(is_last_micro_batch)
        poison_nonfinite(loss).backward()

    def step(self) -> dict[str, float]:
        return clip_and_step(self.model, self.optimizer, self.scheduler, self.optim_cfg.max_norm)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return all_reduce_tensor(tensor, op, self.world_size, self.device)

    def barrier(self) -> None:
        barrier(self.world_size)

    def _options(self, **kw):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, cpu_offload=True, **kw)

    def full_state_dict(self):
        """All ranks call this; rank 0 gets full fp32 CPU tensors, the others None."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        state = get_model_state_dict(self.model, options=self._options())
        if not self.is_rank0:
            return None
        out = {k: v.detach().to("cpu", torch.float32) for k, v in state.items()}
        # tied weights (lm_head = embed_tokens) come back as separate gathered copies; alias them again so
        # save_pretrained writes one tensor, as it does for an unsharded model
        first: dict[int, str] = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            if id(param) in first and name in out and first[id(param)] in out:
                out[name] = out[first[id(param)]]
            first.setdefault(id(param), name)
        return out

    def iter_full_weights(self):
        for name, t in self.model.state_dict().items():  # DTensor shards: one all-gather per entry
            yield name, (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()

    def save_state(self, directory: Path) -> None:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        model_state = self.full_state_dict()
        optim_state = get_optimizer_state_dict(self.model, self.optimizer, options=self._options())
        if self.is_rank0:
            torch_save({"model": model_state, "optimizer": optim_state, "scheduler": self.scheduler.state_dict()},
                       Path(directory) / "fsdp2_state.pt")
        self.barrier()

    def load_state(self, directory: Path) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        path = Path(directory) / "fsdp2_state.pt"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no FSDP2 training state here (was the checkpoint written by another "
                                    "--ds.strategy?)")
        state = torch.load(path, map_location="cpu", weights_only=False)
        opts = self._options(broadcast_from_rank0=False)
        set_model_state_dict(self.model, state["model"], options=opts)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=opts)
        self.scheduler.load_state_dict(state["scheduler"])

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        self.model.eval()
