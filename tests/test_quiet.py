"""The table of known-harmless third-party messages (rlhforge/tracking/quiet.py; issue 47, item 9)."""

import logging
import subprocess
import sys


def test_known_warnings_are_filtered_and_others_shown_as_before():
    """In a fresh process: the renamed-API FutureWarnings DeepSpeed triggers at every collective are not shown,
    an unrelated FutureWarning still is, at every place."""
    code = """
import warnings
warnings.simplefilter("default")
from rlhforge.tracking.quiet import install_filters
install_filters()
for i in range(5):
    for text in ("`torch.distributed.all_gather_into_tensor` is deprecated. Please use ...",
                 "`torch.distributed.reduce_scatter_tensor` is deprecated. Please use ..."):
        warnings.warn_explicit(text, FutureWarning, f"site{i}.py", i)
    warnings.warn_explicit("something else", FutureWarning, f"site{i}.py", 100 + i)
"""
    err = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stderr
    assert err.count("all_gather_into_tensor") == 0 and err.count("reduce_scatter_tensor") == 0
    assert err.count("something else") == 5


def test_the_rotary_reload_message_is_dropped_and_other_layers_still_reported():
    from rlhforge.tracking.quiet import install_filters

    install_filters()
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    seen = []

    class Keep(logging.Handler):  # on the logger itself: vLLM's own logging set-up may stop propagation
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    log.addHandler(handler)
    try:
        log.warning("%s: Failed to load weights", "RotaryEmbedding")
        log.warning("%s: Failed to load weights", "QKVParallelLinear")  # a real missing layer: still said
    finally:
        log.removeHandler(handler)
    assert seen == ["QKVParallelLinear: Failed to load weights"]
