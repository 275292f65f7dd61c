"""Start-up check of every model path of a command (docs/config.md, "Model and data paths").

Local-looking paths must exist (:func:`rlhforge.models.loading.check_model_path`: exit 2 naming the
flag). Hub ids are looked up only when they cannot be local, and only after one short probe of the
hub: when it cannot be reached, an id missing from the local Hugging Face cache ends the command in
seconds naming the flag and the id (``from_pretrained`` would retry for ~25 s per file, then fail
with a connection error), and ids that are cached load from the cache (``HF_HUB_OFFLINE=1``).
No network call is made for local paths.
"""

from __future__ import annotations

from typing import Callable, Iterable

from rlhforge.config.parsing import ConfigError
from rlhforge.config.paths import is_hub_id
from rlhforge.data.hub import go_offline, hub_endpoint, hub_offline, hub_unreachable, in_hub_cache

__all__ = ["check_model_sources"]


def check_model_sources(pairs: Iterable[tuple[str, str]], *, probe: Callable[[], str | None] = hub_unreachable,
                        log=print) -> None:
    """Check each ``(flag, path)`` before anything loads: a missing local path is a FileNotFoundError, a
    hub id that cannot be fetched (hub unreachable or offline, not cached) a ConfigError; both name the
    flag and exit 2 through :mod:`rlhforge.cli.errors`."""
    from rlhforge.models.loading import check_model_path

    pairs = list(pairs)
    for flag, path in pairs:
        check_model_path(path, flag)
    hub_ids = [(flag, path) for flag, path in pairs if is_hub_id(path)]
    if not hub_ids:
        return
    uncached = [(flag, path) for flag, path in hub_ids if not in_hub_cache(path)]
    if hub_offline():
        if uncached:
            flag, path = uncached[0]
            raise ConfigError(f"{flag} {path}: not a local folder, and not in the Hugging Face cache while "
                              "HF_HUB_OFFLINE is set; download it first or pass a local model folder")
        return
    reason = probe()
    if reason is None:
        return
    if uncached:
        flag, path = uncached[0]
        raise ConfigError(f"{flag} {path}: not a local folder, and the Hugging Face Hub ({hub_endpoint()}) could "
                          f"not be reached ({reason}); pass a local model folder, or download {path} where the "
                          "hub is reachable")
    go_offline()
    log(f"[rlhforge] the Hugging Face Hub ({hub_endpoint()}) could not be reached ({reason}): "
        f"{', '.join(sorted({p for _, p in hub_ids}))} load from the local cache (HF_HUB_OFFLINE=1)")
