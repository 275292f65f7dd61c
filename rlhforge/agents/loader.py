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

Files written for OpenRLHF run unchanged: while the file is imported, ``openrlhf.utils.agent``
(and ``openrlhf.utils``) resolve to rlhforge's classes unless a real ``openrlhf`` is installed
(:mod:`rlhforge.openrlhf_alias`); an ``AgentExecutor`` with its own OpenRLHF-shaped ``execute()``
runs through :mod:`rlhforge.agents.openrlhf.execute`.
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
    from rlhforge.openrlhf_alias import alias_hint, openrlhf_alias

    spec = importlib.util.spec_from_file_location(f"rlhforge_agent_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        with openrlhf_alias():
            spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001
        raise ConfigError(f"--train.agent_func_path {path}: importing it failed: {type(err).__name__}: {err}"
                          f"{alias_hint(err)}") from err
    registered = before != (registry.TASKS, registry.ENVS)
    return module, registered


def load_agent_executor(path: str) -> EpisodeExecutor:
    """The executor a ``--train.agent_func_path`` value names (not yet configured)."""
    from rlhforge.agents.openrlhf.multi_turn import AgentInstanceBase, MultiTurnAgentExecutor
    from rlhforge.agents.serving.chat import OpenAIServerAgentExecutor
    from rlhforge.agents.registry import RegistryExecutor

    if path in ("registry", "builtin:registry"):
        return RegistryExecutor()
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--train.agent_func_path {path}: file not found (or use 'registry' for the task registry)")
    module, registered = _import(file)
    cls = getattr(module, "AgentExecutor", None)
    inst = getattr(module, "AgentInstance", None)
    if inspect.isclass(inst) and not (issubclass(inst, AgentInstanceBase) or _from_openrlhf(inst, "AgentInstanceBase")):
        raise ConfigError(f"{path}: AgentInstance must subclass rlhforge.agents.AgentInstanceBase "
                          f"(or openrlhf.utils.agent.AgentInstanceBase)")
    if inspect.isclass(cls):
        if not issubclass(cls, EpisodeExecutor):
            if (_from_openrlhf(cls, "MultiTurnAgentExecutor") and inspect.isclass(inst)
                    and _defining_class(cls, "execute").__module__.startswith("openrlhf")):
                return MultiTurnAgentExecutor(inst)  # real OpenRLHF's executor, unchanged: rlhforge runs the instance
            if any(k.__module__.startswith("openrlhf") for k in cls.__mro__):
                raise ConfigError(
                    f"{path}: AgentExecutor derives from the installed OpenRLHF's "
                    f"{next(k for k in cls.__mro__[1:] if k.__module__.startswith('openrlhf')).__qualname__} "
                    "(a real openrlhf package is importable, so rlhforge does not alias it) and overrides "
                    "execute(); rlhforge runs executors built on its own classes: change the import to "
                    "`from rlhforge.agents import AgentExecutorBase, MultiTurnAgentExecutor` or uninstall openrlhf")
            raise ConfigError(f"{path}: AgentExecutor must subclass rlhforge.agents.MultiTurnAgentExecutor "
                              f"(or OpenAIServerAgentExecutor / AgentExecutorBase); got {cls.__mro__[1].__name__}")
        _check_implemented(cls, path)
        return cls()
    if inspect.isclass(inst):
        return MultiTurnAgentExecutor(inst)
    fn = getattr(module, "run_agent", None)
    if callable(fn):
        return OpenAIServerAgentExecutor(fn)
    if registered:
        return RegistryExecutor()
    raise ConfigError(f"{path} defines none of AgentExecutor, AgentInstance, run_agent(prompt, label, client), "
                      "and registers no task or env (register_task / register_env)")


def _from_openrlhf(cls, base_name: str) -> bool:
    """``cls`` derives from a class ``base_name`` of a real (installed) ``openrlhf`` package."""
    return any(k.__name__ == base_name and k.__module__.startswith("openrlhf") for k in cls.__mro__)


def _defining_class(cls, attr: str):
    return next((k for k in cls.__mro__ if attr in vars(k)), object)


def _check_implemented(cls, path) -> None:
    from rlhforge.agents.openrlhf.multi_turn import AgentExecutorBase

    if _defining_class(cls, "run_episode") is AgentExecutorBase and _defining_class(cls, "execute") is EpisodeExecutor:
        raise ConfigError(f"{path}: AgentExecutor({cls.__mro__[1].__name__}) implements neither OpenRLHF's "
                          "async execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine) "
                          "nor rlhforge's async run_episode(ep, ctx)")


def build_executor(cfg, tokenizer, reward_source):
    """The executor of an :class:`~rlhforge.config.rl.RLConfig` run, configured."""
    from rlhforge.agents.single_turn import SingleTurnExecutor

    path = cfg.train.agent_func_path
    env = getattr(cfg, "env", None)
    if env is not None and env.kind != "none":  # --env.kind verifiers|openenv (docs/env_adapters.md)
        from rlhforge.agents.envs.adapters import build_env_adapter

        ex = build_env_adapter(cfg, tokenizer)
        return ex.configure(tokenizer=tokenizer, reward_source=reward_source, settings=AgentSettings.from_config(cfg))
    if not path:
        return SingleTurnExecutor(tokenizer, reward_source, check_tokens=cfg.train.check_tokens)
    from rlhforge.agents.registry.builtin import configure_sandbox

    try:  # this run's setting (None: back to $RLHFORGE_SANDBOX_URL, else a local sandbox)
        configure_sandbox(cfg.train.sandbox_url)
    except ValueError as err:
        raise ConfigError(f"--train.sandbox_url {cfg.train.sandbox_url}: {err}") from None
    ex = load_agent_executor(path)
    if getattr(tokenizer, "image_processor", None) is not None:  # a vision-language actor (docs/vlm.md)
        from rlhforge.agents.serving.chat import OpenAIServerAgentExecutor
        from rlhforge.agents.openrlhf.execute import user_execute
        from rlhforge.agents.openrlhf.multi_turn import AgentExecutorBase, MultiTurnAgentExecutor

        if isinstance(ex, OpenAIServerAgentExecutor) or user_execute(ex, AgentExecutorBase, MultiTurnAgentExecutor):
            raise ConfigError(f"--train.agent_func_path {path}: {type(ex).__name__} agents do not carry images yet; "
                              "with a vision-language actor use an AgentInstance environment (its step() may "
                              "return environment_images) or the single-turn executor (docs/vlm.md)")
    return ex.configure(tokenizer=tokenizer, reward_source=reward_source, settings=AgentSettings.from_config(cfg))
