"""Reaching the Hugging Face Hub: one short probe, the local cache, offline mode (no rlhforge imports above
``data``: :mod:`rlhforge.models.hub` checks model paths with these, :mod:`rlhforge.data.loading` hub datasets)."""

from __future__ import annotations

import contextlib
import os

__all__ = ["PROBE_TIMEOUT_S", "hub_endpoint", "hub_unreachable", "in_hub_cache", "hub_offline", "go_offline",
           "offline_for_datasets"]

#: seconds the hub probe waits for an answer
PROBE_TIMEOUT_S = 3.0


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def hub_unreachable(timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when the hub answers at all (any HTTP status); else why not, in one line."""
    from huggingface_hub.utils import get_session

    try:
        get_session().head(hub_endpoint(), timeout=timeout)
    except Exception as err:  # noqa: BLE001 - any failure to get an answer means "unreachable"
        first = (str(err).strip().splitlines() or [""])[0]
        return f"{type(err).__name__}: {first}" if first else type(err).__name__
    return None


def in_hub_cache(repo_id: str) -> bool:
    """Whether the local Hugging Face cache holds ``repo_id``'s config.json or adapter_config.json (no network)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return any(isinstance(try_to_load_from_cache(repo_id, name), str) for name in ("config.json", "adapter_config.json"))
    except Exception:  # noqa: BLE001 - not a valid repo id: not cached
        return False


def hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def go_offline() -> None:
    """Load from the cache without asking the hub, here and in the processes this one starts."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True


@contextlib.contextmanager
def offline_for_datasets():
    """``datasets`` reads its offline switch at import: force it (and the hub's) on inside the block."""
    import datasets.config
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved
