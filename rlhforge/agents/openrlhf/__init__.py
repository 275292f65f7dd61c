"""OpenRLHF's agent API: ``AgentInstanceBase`` / ``MultiTurnAgentExecutor`` (:mod:`.multi_turn`) and running an
OpenRLHF ``agent_func`` file's executor (:mod:`.execute`)."""
