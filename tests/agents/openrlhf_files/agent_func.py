"""A multi-turn environment written for OpenRLHF (imports openrlhf, returns tensors); rlhforge's
tests load it unchanged.

The "echo" game: the label is the number of turns; each turn pays 1 if the action has an even
number of characters, else 0; the environment answers with a short hint until the last turn.
"""

import torch

from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0
        self.turns = 1

    async def reset(self, states: dict, **kwargs):
        self.turns = int(states["label"])
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        self.turn += 1
        done = self.turn >= self.turns
        reward = torch.tensor(1.0 if len(states["action_text"]) % 2 == 0 else 0.0)
        params = states["sampling_params"]
        params.max_tokens = 5  # vLLM-style attribute, mutated in place
        return {
            "rewards": reward,
            "scores": torch.tensor(0.25),
            "environment_feedback": "" if done else f"\nhint {self.turn}:\n",
            "done": done,
            "sampling_params": params,
            "extra_logs": {"echo_turn": torch.tensor(float(self.turn))},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
