"""Agent executors: turn a prompt into a token trajectory.

The kernel is this folder's flat modules (:mod:`.types`, :mod:`.episode`, :mod:`.single_turn`, :mod:`.batching`,
:mod:`.env_threads`, :mod:`.episode_images`, :mod:`.token_check`, :mod:`.values`) and the one chooser
(:mod:`.loader`); each other concept is a sub-package that imports the kernel, never the reverse:
:mod:`.openrlhf` (OpenRLHF's agent API, ``AgentInstanceBase`` / ``MultiTurnAgentExecutor`` and custom
``execute()`` files), :mod:`.registry` (tasks and environments by name, the built-ins), :mod:`.serving` (the
OpenAI-compatible and token servers that record episodes), :mod:`.envs` (verifiers and OpenEnv, ``--env.kind``;
it may use :mod:`.serving`) and :mod:`.sandbox` (the code sandbox). All produce the same
:class:`~rlhforge.agents.types.Trajectory`. Files written for OpenRLHF load unchanged (``openrlhf.utils.agent``
is aliased while they are imported, :mod:`rlhforge.openrlhf_alias`).
"""

from rlhforge.agents.episode import AgentError, AgentSettings, Episode, EpisodeExecutor
from rlhforge.agents.openrlhf.multi_turn import AgentExecutorBase, AgentInstanceBase, MultiTurnAgentExecutor, chat_feedback
from rlhforge.agents.serving.chat import OpenAIServerAgentExecutor
from rlhforge.agents.registry import RegistryExecutor, register_env, register_task

__all__ = ["AgentError", "AgentSettings", "Episode", "EpisodeExecutor", "AgentExecutorBase", "AgentInstanceBase",
           "MultiTurnAgentExecutor", "OpenAIServerAgentExecutor", "RegistryExecutor", "register_env", "register_task",
           "chat_feedback"]
