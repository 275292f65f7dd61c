"""Frozen models (the reference policy, reward models): prepared like the trained actor, optionally
offloaded to host memory between uses.

:class:`FrozenModel` wraps a loaded model for inference only. ``kind`` is the actor's strategy
(``torch``, ``deepspeed`` or ``fsdp2``); the frozen model gets the same precision mechanism, so a
reference that starts equal to the actor gives *identical* log-probs (KL exactly 0 before the first
update) in every dtype:

==============  ================================================================================
``torch``       fp32 parameters, forward under ``torch.autocast(--ds.param_dtype)`` (as
                :class:`~rlhforge.backend.torch_strategy.TorchStrategy`); replicated
``deepspeed``   ``deepspeed.initialize`` with an inference config (no optimizer; OpenRLHF's
                ``get_eval_ds_config``): parameters in ``--ds.param_dtype``, ZeRO-3 partitioned
                over the group's ranks when the actor runs ZeRO-3, else ZeRO-0 (replicated)
``fsdp2``       ``fully_shard`` per transformer block with the actor's mixed-precision policy
==============  ================================================================================

Offload (``--ref.offload`` / ``--reward.offload``): under ZeRO-3, DeepSpeed's ``offload_param`` keeps
the partitioned parameters in host memory and streams them to the device layer by layer (OpenRLHF's
behaviour); under FSDP2, ``CPUOffloadPolicy`` does the same. Otherwise :meth:`FrozenModel.use` moves
every parameter and buffer to host memory after each use and back before the next (the
``host_copy`` mode; :meth:`stats` counts the moves and the bytes). On a CPU device host memory *is*
the device: the same calls run, the counters move, and ``moved_bytes`` stays 0 - nothing is saved.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from rlhforge.backend.device import (collective_timeout_kwargs, destroy_group_at_exit, dist_info, init_process_group, resolve_dtype,
                                     one_rank_store, single_process_env)

__all__ = ["FrozenModel", "frozen_deepspeed_config"]


def frozen_deepspeed_config(ds_cfg, dtype: torch.dtype, *, offload: bool) -> dict:
    """DeepSpeed inference config of a frozen model: ZeRO-3 when the actor is ZeRO-3, else ZeRO-0."""
    stage = 3 if ds_cfg.zero_stage == 3 else 0
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["offload_param"] = {"device": "cpu" if offload else "none", "pin_memory": torch.cuda.is_available()}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def _move(module: torch.nn.Module, device: torch.device) -> int:
    """Parameters and buffers of ``module`` to ``device`` in place; the bytes that changed device."""
    moved = 0
    to_host = device.type == "cpu"
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if t.device == device:
                continue
            new = t.data.to(device, non_blocking=True)
            t.data = new.pin_memory() if to_host and t.device.type == "cuda" else new
            moved += t.numel() * t.element_size()
    if moved and torch.cuda.is_available():
        torch.cuda.synchronize()
        if to_host:
            torch.cuda.empty_cache()
    return moved


class FrozenModel:
    """A model that is never trained, on ``device``, numerically like the actor of strategy ``kind``."""

    def __init__(self, model: torch.nn.Module, ds_cfg, device: torch.device, *, kind: str = "torch",
                 offload: bool = False):
        if kind not in ("torch", "deepspeed", "fsdp2"):
            raise ValueError(f"unknown strategy kind {kind!r}; valid: torch, deepspeed, fsdp2")
        for p in model.parameters():
            p.requires_grad_(False)
        self.kind, self.device = kind, device
        self.dtype = resolve_dtype(ds_cfg.param_dtype, device)
        self.offloads = self.reloads = self.moved_bytes = 0
        self.held = False
        self.mode = "none"
        if kind == "deepspeed":
            self.model = self._deepspeed(model, ds_cfg, offload)
        elif kind == "fsdp2":
            self.model = self._fsdp2(model, offload)
        else:
            self.model = model.to(device)
        self.model.eval()
        if offload and self.mode == "none":
            self.mode = "host_copy"
            self._offload()

    # -- preparation ---------------------------------------------------------------------------
    def _deepspeed(self, model, ds_cfg, offload: bool):
        import deepspeed
        import torch.distributed as dist

        from rlhforge.backend.deepspeed_strategy import drop_stale_deepspeed_groups

        drop_stale_deepspeed_groups()
        if not dist.is_initialized():
            if dist_info().world_size == 1:
                single_process_env()
            with one_rank_store():
                deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo",
                                           **collective_timeout_kwargs())
            from rlhforge.backend.strict_device import install

            install()  # RLHFORGE_STRICT_DEVICE=1: collectives checked for the group's device
            destroy_group_at_exit()
        config = frozen_deepspeed_config(ds_cfg, self.dtype, offload=offload)
        if offload and config["zero_optimization"]["stage"] == 3:
            self.mode = "deepspeed_offload_param"
        engine, *_ = deepspeed.initialize(model=model, config=config)
        return engine

    def _fsdp2(self, model, offload: bool):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        from rlhforge.backend.fsdp2_strategy import _block_classes

        info = dist_info()
        if info.world_size == 1:
            single_process_env()
        init_process_group(self.device, force=True)
        model = model.to(device=self.device, dtype=torch.float32)
        kwargs: dict[str, Any] = {"mesh": init_device_mesh(self.device.type, (info.world_size,))}
        if self.dtype != torch.float32:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        if offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
            self.mode = "fsdp2_cpu_offload"
        for module in list(model.modules()):
            if type(module) in _block_classes(model):
                fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)
        return model

    # -- use -----------------------------------------------------------------------------------
    def _offload(self) -> None:
        self.moved_bytes += _move(self.model, torch.device("cpu"))
        self.offloads += 1

    def _reload(self) -> None:
        self.moved_bytes += _move(self.model, self.device)
        self.reloads += 1

    def autocast(self):
        if self.kind == "torch" and self.dtype != torch.float32:
            return torch.autocast(device_type=self.device.type, dtype=self.dtype)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def use(self) -> Iterator[torch.nn.Module]:
        """The model for one batch of forward passes (no grad, autocast as the actor's); with
        ``host_copy`` offload it comes back to the device first and leaves again afterwards (once for
        all uses inside :meth:`hold`)."""
        moves = self.mode == "host_copy" and not self.held
        if moves:
            self._reload()
        try:
            with torch.no_grad(), self.autocast():
                yield self.model
        finally:
            if moves:
                self._offload()

    @contextlib.contextmanager
    def hold(self):
        """Keep a ``host_copy``-offloaded model on the device for every :meth:`use` inside (e.g. one
        optimizer step's micro-batches)."""
        if self.mode != "host_copy" or self.held:
            yield
            return
        self._reload()
        self.held = True
        try:
            yield
        finally:
            self.held = False
            self._offload()

    def local_numel(self) -> int:
        """Parameter elements this rank holds (ZeRO-3 / FSDP2: its partition, else the whole model)."""
        total = 0
        for p in self.model.parameters():
            if hasattr(p, "ds_tensor"):
                total += p.ds_tensor.numel()
            elif hasattr(p, "to_local"):
                total += p.to_local().numel()
            else:
                total += p.numel()
        return total

    def stats(self) -> dict:
        """``mode`` (none | host_copy | deepspeed_offload_param | fsdp2_cpu_offload), ``offloads``,
        ``reloads``, ``moved_bytes`` (host_copy: bytes that changed device, 0 on a CPU device), the
        strategy ``kind``, ``dtype`` and ``local_numel``."""
        return {"mode": self.mode, "offloads": self.offloads, "reloads": self.reloads,
                "moved_bytes": self.moved_bytes, "kind": self.kind, "dtype": str(self.dtype).removeprefix("torch."),
                "local_numel": self.local_numel()}
