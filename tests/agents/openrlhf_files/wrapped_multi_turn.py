"""OpenRLHF-style: a MultiTurnAgentExecutor subclass that overrides execute() and post-processes
the result of super().execute()."""

import torch

from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        pass

    async def step(self, states: dict, **kwargs):
        return {"rewards": torch.tensor(0.5), "environment_feedback": "", "done": True}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine):
        result = await super().execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine)
        result["reward"] = result["reward"] * 4  # a bonus on top of the environment's reward
        result["extra_logs"] = {"wrapped": 1.0}
        return result
