"""Datasets: loading and mixing, formats and key mapping, chat templates, SFT samples, packing.

Main entry points (imported lazily, so ``import rlhforge.data.errors`` stays cheap):
:func:`load_dataset_spec`, :func:`build_sft_samples`, :class:`SFTSample`, :func:`collate_padded`,
:func:`collate_packed`, :func:`token_budget_batches`, :func:`split_into_micro_batches`,
:func:`check_answer`, :class:`DataError`. See docs/data.md.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "DataError": "rlhforge.data.errors",
    "load_dataset_spec": "rlhforge.data.loading",
    "build_sft_samples": "rlhforge.data.sft",
    "SFTSample": "rlhforge.data.sft",
    "collate_padded": "rlhforge.data.packing",
    "collate_packed": "rlhforge.data.packing",
    "token_budget_batches": "rlhforge.data.packing",
    "split_into_micro_batches": "rlhforge.data.packing",
    "check_answer": "rlhforge.data.builtin",
    "generate_builtin": "rlhforge.data.builtin",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rlhforge.data' has no attribute {name!r}")
