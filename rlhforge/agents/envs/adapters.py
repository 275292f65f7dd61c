"""The adapter seam for environments from other ecosystems (``--env.kind``), beside OpenRLHF's agent
API (``--train.agent_func_path``): a flat table kind -> builder of an
:class:`~rlhforge.agents.episode.EpisodeExecutor` (docs/env_adapters.md).

==============  ===============================================  ======================================
``--env.kind``  executor                                         ``--env.id``
==============  ===============================================  ======================================
``verifiers``   :class:`~rlhforge.agents.envs.verifiers.VerifiersEnvExecutor`  taskset module or ``.py`` file
``openenv``     :class:`~rlhforge.agents.envs.openenv.OpenEnvExecutor`          ``http://HOST:PORT``
==============  ===============================================  ======================================

A builder gets the run's config and tokenizer and returns the executor, not yet configured
(:func:`rlhforge.agents.loader.build_executor` configures it). Whatever goes wrong while building
(the package is missing, the taskset does not import, the server does not answer) is a
:class:`~rlhforge.config.parsing.ConfigError` naming the flag: exit 2 at start-up, before any step.
"""

from __future__ import annotations

import json
from typing import Callable

from rlhforge.config.parsing import ConfigError

__all__ = ["ENV_ADAPTERS", "build_env_adapter"]


def _verifiers(cfg, tokenizer):
    from rlhforge.agents.envs.verifiers import VerifiersEnvExecutor

    e = cfg.env
    return VerifiersEnvExecutor(e.id, args=_args(e), harness=e.harness, runtime=e.runtime,
                                model_path=cfg.actor.model_name_or_path)


def _openenv(cfg, tokenizer):
    from rlhforge.agents.envs.openenv import OpenEnvExecutor

    e = cfg.env
    return OpenEnvExecutor(e.id, action_key=e.action_key, observation_key=e.observation_key,
                           transport=e.transport, reset_args=_args(e), check=True)


ENV_ADAPTERS: dict[str, Callable] = {"verifiers": _verifiers, "openenv": _openenv}
_PACKAGES = {"verifiers": "verifiers==0.4.0", "openenv": "openenv-core==0.3.0"}


def _args(env) -> dict:
    return json.loads(env.args) if env.args else {}


def build_env_adapter(cfg, tokenizer):
    kind = cfg.env.kind
    if kind not in ENV_ADAPTERS:
        raise ConfigError(f"--env.kind {kind!r}: expected one of {', '.join(ENV_ADAPTERS)} (or none)")
    try:
        return ENV_ADAPTERS[kind](cfg, tokenizer)
    except ModuleNotFoundError as err:
        top = (err.name or "").split(".")[0]
        if top in ("verifiers", "openenv"):
            raise ConfigError(f"--env.kind {kind} needs the {top} package: pip install {_PACKAGES[kind]}") from err
        raise ConfigError(f"--env.id {cfg.env.id}: {type(err).__name__}: {err}") from err
    except Exception as err:  # noqa: BLE001 - whatever the environment's code raised, named with the flag
        raise ConfigError(f"--env.id {cfg.env.id} (--env.kind {kind}): {type(err).__name__}: {err}") from err
