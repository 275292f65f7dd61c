"""The host allocator's thresholds: freed blocks of up to 32 MiB are kept for reuse instead of going back to
the kernel.

glibc's ``malloc`` serves a block above its ``mmap`` threshold (128 KiB at start, raised as such blocks are
freed) with a fresh ``mmap`` and returns it on ``free``, and trims the heap's free top above the trim
threshold. PyTorch's CPU tensors come straight from ``malloc``, so a loop that allocates and frees tensors of a
few MiB each step (the HF engine's sampler at a 151,936-token vocabulary: 16 rows x 4 tensors of 9.7 MB)
page-faults every page of each of them again, every step (~10,600 pages): one sampling step took 34 ms, and
8-11 ms with the thresholds below (docs/performance.md, "The real-vocabulary step, continued").
PyTorch's CPU tuning guides advise another allocator (jemalloc, tcmalloc) for the same reason; these two
``mallopt`` settings get most of it with the C library already loaded.

:func:`tune_host_allocator` sets, for this process (``mallopt``) and for the processes it starts
(``GLIBC_TUNABLES``: Ray workers, torchrun ranks, engines):

- ``M_MMAP_THRESHOLD`` = :data:`MMAP_THRESHOLD` (32 MiB, glibc's largest): smaller blocks come from the heap
  and are reused; larger ones (a head chunk's logits, a gradient) are still mapped and unmapped, so the peak
  resident memory does not grow with the heap's holes;
- ``M_TRIM_THRESHOLD`` = :data:`TRIM_THRESHOLD` (256 MiB): up to that much free memory at the heap's top is
  kept instead of being handed back after each step.

Nothing changes where ``GLIBC_TUNABLES`` is already set (the user's own settings), outside Linux/glibc, or
with ``RLHFORGE_MALLOC=system``.
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = ["tune_host_allocator", "MMAP_THRESHOLD", "TRIM_THRESHOLD", "tunables"]

#: blocks below this come from the heap and are reused (glibc's maximum: half of a 64 MiB heap)
MMAP_THRESHOLD = 32 << 20
#: free memory at the heap's top kept for the next allocations
TRIM_THRESHOLD = 256 << 20

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h


def tunables() -> str:
    """The ``GLIBC_TUNABLES`` value with the same two settings."""
    return f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD}:glibc.malloc.trim_threshold={TRIM_THRESHOLD}"


def tune_host_allocator(environ=os.environ) -> bool:
    """Set the two thresholds for this process and its children; True if they were set (module docstring)."""
    if environ.get("RLHFORGE_MALLOC", "").lower() == "system" or "GLIBC_TUNABLES" in environ:
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl names its C library otherwise)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return False
    environ["GLIBC_TUNABLES"] = tunables()
    return True
