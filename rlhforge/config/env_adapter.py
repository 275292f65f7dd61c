"""``--env.*``: train on an environment from another ecosystem, used as it is (docs/env_adapters.md).

=============  =========================================================================================
``--env.kind``  ``--env.id``
=============  =========================================================================================
``verifiers``   a verifiers 0.4 (``verifiers.v1``) taskset: an installed module name (``gsm8k_v1``) or a
                ``.py`` file defining one; its episodes call the policy through vLLM's token route
                (``POST /inference/v1/generate``) served over rlhforge's engine
``openenv``     an OpenEnv server: ``http://HOST:PORT`` (``reset``/``step`` over its WebSocket ``/ws``,
                or plain HTTP with ``--env.transport http``)
=============  =========================================================================================

Both run as agent executors beside ``--train.agent_func_path`` (one of the two, never both): the
environment's reward is the sample's reward, its text is never trained on, and ``--train.agent_*``
(timeouts, concurrency, fail-fast) apply unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["EnvAdapterConfig", "ENV_KINDS"]

ENV_KINDS = ("none", "verifiers", "openenv")


@dataclass(frozen=True)
class EnvAdapterConfig:
    kind: Literal["none", "verifiers", "openenv"] = "none"
    """Where the environment comes from: ``verifiers`` (a verifiers 0.4 taskset), ``openenv`` (an
    OpenEnv server), ``none`` (``--train.agent_func_path`` or single turn)."""
    id: str = ""
    """verifiers: the taskset's module name or ``.py`` file; openenv: the server's ``http://HOST:PORT``."""
    args: str = ""
    """JSON object. verifiers: the taskset config's fields (``{"split": "train"}``); openenv: extra
    keyword arguments of every ``reset`` (besides ``seed`` and the record's label)."""
    harness: str = "rlhforge_chat"
    """verifiers: the harness that plays each task. ``rlhforge_chat`` (default): an in-process chat
    loop that needs no ``uv``/network; any other verifiers harness id runs as verifiers runs it."""
    runtime: str = "subprocess"
    """verifiers: the agent runtime type (``subprocess`` on this host; ``docker``, ``prime`` ...)."""
    action_key: str = "message"
    """openenv: the action field that receives the model's reply text (``{"message": text}``)."""
    observation_key: str = ""
    """openenv: the observation field whose text is fed back to the model; "" reads the first of
    ``prompt``, ``text``, ``message``, ``content``, ``output``, ``feedback`` that holds text."""
    transport: Literal["ws", "http"] = "ws"
    """openenv: ``ws`` (one WebSocket session per episode, as ``openenv``'s ``EnvClient``) or ``http``
    (``POST /reset``, ``POST /step``: the server builds a fresh environment per request, so only
    one-step environments or ones that keep their own state)."""
