"""Non-finite steps, as every strategy handles them (docs/reliability.md, "Non-finite steps").

A step whose loss or gradient norm is NaN/inf is **skipped**: no optimizer or scheduler step (the
parameters, the optimizer state and the learning-rate schedule stay as they were), the gradients
are dropped, and the step reports ``skipped = 1``. Every rank takes the same decision.

- :func:`poison_nonfinite` (in ``backward``): a non-finite loss is multiplied by a detached NaN, so
  every gradient it reaches is NaN as well (a NaN in a term without a gradient path would otherwise
  leave finite gradients). A finite loss is multiplied by exactly 1.0 (bitwise the same loss and
  gradients). No host synchronisation.
- :func:`all_ranks_finite` (in ``step``): the gradient norm's finiteness. The torch (DDP) and FSDP2
  norms are already global; DeepSpeed ZeRO-0 checks its local gradients and reduces the flag with
  ``max`` over the ranks, so one rank's NaN skips the step everywhere.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["poison_nonfinite", "all_ranks_finite", "grads_finite"]


def poison_nonfinite(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` unchanged when finite; otherwise ``loss * NaN`` (NaN gradients everywhere it reaches)."""
    bad = ~torch.isfinite(loss.detach()).all()
    factor = torch.where(bad, torch.tensor(float("nan"), device=loss.device), torch.tensor(1.0, device=loss.device))
    return loss * factor.to(loss.dtype)


def all_ranks_finite(value: torch.Tensor, all_reduce: Callable | None = None) -> bool:
    """True when ``value`` is finite on every rank (``all_reduce(tensor, op="max")``: the strategy's)."""
    bad = (~torch.isfinite(value.detach().float()).all()).float().reshape(())
    if all_reduce is not None:
        bad = all_reduce(bad, op="max")
    return float(bad) == 0.0


def grads_finite(module: torch.nn.Module) -> torch.Tensor:
    """A 0-dim tensor: 1.0 when every local ``param.grad`` of ``module`` is finite, else NaN."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    if not grads:
        return torch.tensor(1.0)
    device = grads[0].device
    ok = torch.stack([torch.isfinite(g).all().to(device) for g in grads]).all()
    return torch.where(ok, torch.tensor(1.0, device=device), torch.tensor(float("nan"), device=device))
