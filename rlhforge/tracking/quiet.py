"""Known-harmless third-party messages that repeat every step, filtered in one table (issue 47, item 9).

Each entry names where the message comes from, what is done with it and why it is harmless here.
:func:`install_filters` installs them in this process; the commands call it at start-up
(:func:`rlhforge.cli.env.setup_cli_environment`), and the vLLM worker extension calls it where vLLM's
worker runs (its own process in multiprocess mode). Everything not listed is shown as before.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from dataclasses import dataclass

__all__ = ["KnownMessage", "KNOWN_MESSAGES", "install_filters", "expected_new_weights"]


@dataclass(frozen=True)
class KnownMessage:
    kind: str
    """``warning`` (a Python FutureWarning whose text starts with ``pattern``: not shown) or ``log`` (a logging
    record of ``source``: dropped)."""
    source: str
    """The warning category's module, or the logger's name."""
    pattern: str
    """A regular expression the message text starts with (``warning``), or the log record's format string
    plus its first argument, ``"FORMAT|ARG"`` (``log``)."""
    reason: str


KNOWN_MESSAGES: tuple[KnownMessage, ...] = (
    KnownMessage("warning", "torch.distributed", r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                 "DeepSpeed 0.19.8's ZeRO-3 calls it for every gathered parameter; torch 2.13 only renamed it "
                 "(FutureWarning, twice per collective under ZeRO-3); nothing for the user to change"),
    KnownMessage("warning", "torch.distributed", r"`torch\.distributed\.reduce_scatter_tensor` is deprecated",
                 "the same, for ZeRO-2/3's gradient reduce-scatter"),
    KnownMessage("log", "vllm.model_executor.model_loader.reload.layerwise", "%s: Failed to load weights|RotaryEmbedding",
                 "every weight sync reloads through vLLM's layerwise reload, which counts the rotary embedding's "
                 "cos/sin cache as loadable although no checkpoint holds it; vLLM then keeps its own cache (the "
                 "sync report and the post-sync probe check that the weights took effect)"),
)


class _DropKnown(logging.Filter):
    def __init__(self, entries: list[KnownMessage]):
        super().__init__()
        self.drop = [tuple(e.pattern.split("|", 1)) for e in entries]

    def filter(self, record: logging.LogRecord) -> bool:
        first = str(record.args[0]) if isinstance(record.args, tuple) and record.args else ""
        return not any(record.msg == fmt and first == arg for fmt, arg in self.drop)


_installed = False


def install_filters() -> None:
    """Install :data:`KNOWN_MESSAGES` in this process (once; no third-party package is imported)."""
    global _installed
    if _installed:
        return
    _installed = True
    logs: dict[str, list[KnownMessage]] = {}
    for e in KNOWN_MESSAGES:
        if e.kind == "warning":
            warnings.filterwarnings("ignore", message=e.pattern, category=FutureWarning)
        else:
            logs.setdefault(e.source, []).append(e)
    for name, entries in logs.items():
        logging.getLogger(name).addFilter(_DropKnown(entries))


#: transformers' logger of ``from_pretrained``'s "LOAD REPORT" table (transformers 5)
LOAD_REPORT_LOGGER = "transformers.modeling_utils"
_REPORT_ROW = re.compile(r"^(\S+)\s*\|\s*([A-Z]+)\s*\|", re.M)


class _DropExpectedReport(logging.Filter):
    def __init__(self, keys: set[str]):
        super().__init__()
        self.keys = keys

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "LOAD REPORT" not in text:
            return True
        rows = [(key, status) for key, status in _REPORT_ROW.findall(text) if key != "Key"]
        return not rows or any(status != "MISSING" or key not in self.keys for key, status in rows)


@contextlib.contextmanager
def expected_new_weights(keys: set[str]):
    """Within the block, transformers' "LOAD REPORT" of a ``from_pretrained`` whose only finding is that exactly
    ``keys`` were MISSING is dropped: rlhforge initialises those weights itself (a new reward/critic value head,
    issue 47 item 9) and says so in one line of its own. A report naming any other key, or any other status
    (unexpected, mismatched), is shown as before."""
    flt = _DropExpectedReport(set(keys))
    log = logging.getLogger(LOAD_REPORT_LOGGER)
    log.addFilter(flt)
    try:
        yield
    finally:
        log.removeFilter(flt)
