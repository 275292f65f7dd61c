"""Agent executors: turn a prompt into a token trajectory.

Single-turn (:mod:`.single_turn`), multi-turn environments with OpenRLHF's agent API
(:mod:`.multi_turn`), OpenAI-client agents over a local server (:mod:`.openai_server`), and the
task/env registry (:mod:`.registry`). All produce the same :class:`~rlhforge.agents.types.Trajectory`.
Files written for OpenRLHF load unchanged (``openrlhf.utils.agent`` is aliased while they are
imported, :mod:`rlhforge.openrlhf_alias`; a custom OpenRLHF ``execute()`` runs over a vLLM-shaped
engine, :mod:`.openrlhf_compat`).
"""

from rlhforge.agents.episode import AgentError, AgentSettings, Episode, EpisodeExecutor
from rlhforge.agents.multi_turn import AgentExecutorBase, AgentInstanceBase, MultiTurnAgentExecutor, chat_feedback
from rlhforge.agents.openai_server import OpenAIServerAgentExecutor
from rlhforge.agents.registry import RegistryExecutor, register_env, register_task

__all__ = ["AgentError", "AgentSettings", "Episode", "EpisodeExecutor", "AgentExecutorBase", "AgentInstanceBase",
           "MultiTurnAgentExecutor", "OpenAIServerAgentExecutor", "RegistryExecutor", "register_env", "register_task",
           "chat_feedback"]
