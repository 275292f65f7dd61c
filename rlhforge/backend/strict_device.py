"""Strict-device mode: make "a CPU tensor in an NCCL collective" fail on a CPU-only machine too.

On GPUs the training group is NCCL, which only takes CUDA tensors: ``dist.all_reduce(torch.tensor(1.0))``
dies with "No backend type associated with device type cpu". On CPU the group is gloo and the same call
works, so the bug stays invisible until the first multi-GPU run. Under ``RLHFORGE_STRICT_DEVICE=1``
(the test suite sets it for itself and for every process it starts: torchrun ranks, Ray workers):

- every collective that rlhforge issues takes its tensors through :func:`place`, which moves them to
  the group's device and marks them;
- :func:`check` (called by rlhforge's own collectives, and by :func:`install`'s wrappers of
  ``torch.distributed``'s collectives for calls made from ``rlhforge.*`` modules) refuses a tensor
  that is not marked, or whose device type is not the group backend's (nccl: cuda, gloo: cpu), with
  :class:`StrictDeviceError` naming the call site.

So a new call site that hands a host tensor straight to a collective fails the CPU suite, and the
device-type check is the real NCCL rule on a GPU. Outside strict mode :func:`place` is a plain
``.to(device)`` and :func:`check` does nothing.
"""

from __future__ import annotations

import functools
import os
import sys

import torch

__all__ = ["ENV", "StrictDeviceError", "enabled", "place", "check", "install", "backend_device_type"]

ENV = "RLHFORGE_STRICT_DEVICE"
_MARK = "_rlhforge_on_group_device"
# collective -> position of its input tensor (the one a caller builds; outputs are allocated alike)
_WRAPPED = {"all_reduce": 0, "broadcast": 0, "reduce": 0, "all_gather": 1, "all_gather_into_tensor": 1,
            "reduce_scatter_tensor": 1}


class StrictDeviceError(RuntimeError):
    """A collective got a tensor that is not on its group's device (strict-device mode)."""


def enabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no")


def backend_device_type(backend: str | None) -> str | None:
    """The device type a process-group backend takes (None: mixed or unknown, e.g. ``cpu:gloo,cuda:nccl``)."""
    return {"nccl": "cuda", "gloo": "cpu"}.get(str(backend or "").lower())


def place(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` on ``device`` (a copy when it moves), marked as placed for a collective in strict mode."""
    out = tensor.to(device)
    if enabled():
        setattr(out, _MARK, True)
    return out


def check(tensor: torch.Tensor, backend: str | None, where: str) -> None:
    """Strict mode: ``tensor`` must have gone through :func:`place` and sit on ``backend``'s device type."""
    if not enabled():
        return
    want = backend_device_type(backend)
    if want is not None and tensor.device.type != want:
        raise StrictDeviceError(f"{where}: a {tensor.device.type} tensor in a {backend} collective (needs {want}); "
                                "move it with rlhforge.backend.strict_device.place(tensor, group device)")
    if not getattr(tensor, _MARK, False):
        raise StrictDeviceError(f"{where}: a tensor that was not put on the group's device reached a collective "
                                f"({tensor.device.type}, {backend}); on NCCL a host tensor here fails the first "
                                "multi-GPU step: use rlhforge.backend.strict_device.place(tensor, group device)")


def _group_backend(group) -> str | None:
    import torch.distributed as dist

    try:
        return str(dist.get_backend(group))
    except Exception:  # noqa: BLE001 - not initialised, or a group of another kind
        return None


def _caller_module(depth: int = 2) -> str:
    try:
        return sys._getframe(depth).f_globals.get("__name__", "")
    except ValueError:
        return ""


def install() -> bool:
    """Strict mode: wrap ``torch.distributed``'s tensor collectives so that calls made from ``rlhforge.*``
    modules are checked (DeepSpeed's, FSDP's and torch's own calls pass untouched). Idempotent; returns
    whether the wrappers are in place."""
    if not enabled():
        return False
    import torch.distributed as dist

    for name in _WRAPPED:
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, "_rlhforge_strict", False):
            continue
        setattr(dist, name, _wrap(name, fn))
    return True


def _wrap(name: str, fn):
    @functools.wraps(fn)
    def checked(*args, **kwargs):
        module = _caller_module()
        if module.startswith("rlhforge."):
            pos = _WRAPPED[name]
            tensor = args[pos] if len(args) > pos else next(
                (v for k, v in kwargs.items() if k in ("tensor", "input_tensor", "input")), None)
            if torch.is_tensor(tensor):
                check(tensor, _group_backend(kwargs.get("group")), f"torch.distributed.{name} called from {module}")
        return fn(*args, **kwargs)

    checked._rlhforge_strict = True
    return checked
