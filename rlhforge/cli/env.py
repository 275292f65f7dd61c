"""Process-wide settings for command-line runs: quiet third-party progress bars and warnings, the host
allocator's thresholds."""

from __future__ import annotations

import os
import sys


def setup_cli_environment() -> None:
    """Call once at the start of a command. Never overrides a variable the user has set."""
    from rlhforge.tracking.quiet import install_filters

    install_filters()  # known-harmless messages that repeat every step (rlhforge/tracking/quiet.py)
    from rlhforge.backend.host_memory import tune_host_allocator

    tune_host_allocator()  # freed blocks up to 32 MiB reused, not page-faulted again (backend/host_memory.py)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed: no "unable to detect" warning
            from rlhforge.models.cpu_linear import onednn_chosen

            try:
                onednn_chosen()  # decided once here and exported, so every rank and worker uses the same kernel
            except ValueError as err:  # an unknown RLHFORGE_CPU_LINEAR
                print(f"error: {err}", file=sys.stderr)
                raise SystemExit(2) from None
    except ImportError:  # pragma: no cover
        pass
    if not sys.stderr.isatty() or os.environ.get("CI") or os.environ.get("TQDM_DISABLE"):
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except ImportError:  # pragma: no cover
            pass
