"""Small helpers shared by the algorithm modules (masked reductions, name lookup).

Private: import the public functions from the family modules instead.
"""

from __future__ import annotations

from typing import Mapping, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


def lookup(table: Mapping[str, T], name: str, family: str) -> T:
    """Return ``table[name]``; hyphens are read as underscores (``token-mean`` == ``token_mean``).

    Raises:
        ValueError: unknown name; the message lists the valid names of the family.
    """
    key = name.replace("-", "_") if isinstance(name, str) else name
    if key in table:
        return table[key]
    valid = ", ".join(sorted(table))
    raise ValueError(f"unknown {family} {name!r}; valid names: {valid}")


def as_bool(mask: Tensor) -> Tensor:
    """A float/int/bool mask as a bool tensor (non-zero = kept)."""
    return mask if mask.dtype == torch.bool else mask != 0


def like_mask(new_mask: Tensor, template: Tensor) -> Tensor:
    """Return the bool ``new_mask`` in the dtype of the caller's ``template`` mask."""
    return new_mask if template.dtype == torch.bool else new_mask.to(template.dtype)


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over positions where ``mask`` is set; masked values (even inf/NaN) are ignored."""
    m = as_bool(mask)
    z = torch.where(m, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return z.sum() if dim is None else z.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over masked-in positions; 0 where nothing is masked in (never NaN)."""
    m = as_bool(mask)
    count = m.sum() if dim is None else m.sum(dim)
    return masked_sum(x, m, dim) / count.clamp_min(1).to(x.dtype)


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Population variance (divide by the count) over all masked-in positions; 0 if none."""
    mean = masked_mean(x, mask)
    return masked_mean((x - mean) ** 2, mask)


def masked_metric(x: Tensor, mask: Tensor) -> Tensor:
    """A detached 0-dim float metric: the masked mean of ``x`` (bools count as 0/1)."""
    x = x.detach()
    if x.dtype == torch.bool:
        x = x.float()
    return masked_mean(x, mask).detach()


def check_same_shape(**tensors: Tensor) -> None:
    """Raise ValueError naming the tensors if their shapes differ."""
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.shape != first.shape:
            raise ValueError(
                f"shape mismatch: {first_name} is {tuple(first.shape)} but {name} is {tuple(t.shape)}"
            )

