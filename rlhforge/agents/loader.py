"""Pick the agent executor of a run from ``--train.agent_func_path``.

=============================  ==================================================================
(unset)                        single-turn generation scored by the reward source
``path/to/file.py``            the file is imported; the first of these it defines is used:
                               ``AgentExecutor`` (a class, OpenRLHF's convention: built with no
                               arguments), ``AgentInstance`` (an :class:`AgentInstanceBase`
                               subclass, run by :class:`MultiTurnAgentExecutor`), ``run_agent``
                               (an OpenAI-client agent, :class:`OpenAIServerAgentExecutor`);
                               a file that only calls ``register_task``/``register_env`` selects
                               the registry executor
``registry``                   the registry executor with the built-in tasks (``math``,
                               ``math_tir``) and whatever other files registered
=============================  ==================================================================
"""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

from rlhforge.agents.episode import AgentSettings, EpisodeExecutor
from rlhforge.config.parsing import ConfigError

__all__ = ["build_executor", "load_agent_executor"]


def _import(path: Path):
    from rlhforge.agents import registry

    before = (dict(registry.TASKS), dict(registry.ENVS))
    spec = importlib.util.spec_from_file_location(f"rlhforge_agent_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001
        raise ConfigError(f"--train.agent_func_path {path}: importing it failed: {type(err).__name__}: {err}") from err
    registered = before != (registry.TASKS, registry.ENVS)
    return module, registered


def load_agent_executor(path: str) -> EpisodeExecutor:
    """The executor a ``--train.agent_func_path`` value names (not yet configured)."""
    from rlhforge.agents.multi_turn import AgentInstanceBase, MultiTurnAgentExecutor
    from rlhforge.agents.openai_server import OpenAIServerAgentExecutor
    from rlhforge.agents.registry import RegistryExecutor

    if path in ("registry", "builtin:registry"):
        return RegistryExecutor()
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--train.agent_func_path {path}: file not found (or use 'registry' for the task registry)")
    module, registered = _import(file)
    cls = getattr(module, "AgentExecutor", None)
    if inspect.isclass(cls):
        ex = cls()
        if not isinstance(ex, EpisodeExecutor):
            raise ConfigError(f"{path}: AgentExecutor must subclass rlhforge.agents.MultiTurnAgentExecutor "
                              f"(or OpenAIServerAgentExecutor / AgentExecutorBase); got {cls.__mro__[1].__name__}")
        return ex
    inst = getattr(module, "AgentInstance", None)
    if inspect.isclass(inst):
        if not issubclass(inst, AgentInstanceBase):
            raise ConfigError(f"{path}: AgentInstance must subclass rlhforge.agents.AgentInstanceBase")
        return MultiTurnAgentExecutor(inst)
    fn = getattr(module, "run_agent", None)
    if callable(fn):
        return OpenAIServerAgentExecutor(fn)
    if registered:
        return RegistryExecutor()
    raise ConfigError(f"{path} defines none of AgentExecutor, AgentInstance, run_agent(prompt, label, client), "
                      "and registers no task or env (register_task / register_env)")


def build_executor(cfg, tokenizer, reward_source):
    """The executor of an :class:`~rlhforge.config.rl.RLConfig` run, configured."""
    from rlhforge.agents.single_turn import SingleTurnExecutor

    path = cfg.train.agent_func_path
    if not path:
        return SingleTurnExecutor(tokenizer, reward_source)
    ex = load_agent_executor(path)
    return ex.configure(tokenizer=tokenizer, reward_source=reward_source, settings=AgentSettings.from_config(cfg))
