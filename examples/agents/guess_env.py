"""Number guessing: a multi-turn environment in OpenRLHF's agent API.

The prompt asks for a number between 1 and 9; the label is the secret. Each turn the model's first
number is its guess; the environment answers "higher", "lower" or "correct" as the next user turn.
Reward 1.0 for a correct guess (0.5 when it took more than one try), the episode ends on a correct
guess or after 4 tries. An OpenRLHF agent file differs only in its import line.

    rlhforge rl --config examples/agents/guess.yaml
"""

import re

from rlhforge.agents import AgentInstanceBase, MultiTurnAgentExecutor, chat_feedback

MAX_TRIES = 4


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.tries = 0

    async def reset(self, states, **kwargs):
        # a guess is short: at most 8 new tokens per turn (rlhforge extension; OpenRLHF ignores it)
        return {"observation": states["observation"], "sampling_params": {"max_tokens": 8}}

    async def step(self, states, **kwargs):
        self.tries += 1
        secret = int(states["label"])
        match = re.search(r"\d+", states["action_text"])
        guess = int(match.group()) if match else None
        if guess == secret:
            reward, done, text = (1.0 if self.tries == 1 else 0.5), True, "correct"
        else:
            reward, done = 0.0, self.tries >= MAX_TRIES
            text = "no number found; answer with one number" if guess is None else (
                "higher" if guess < secret else "lower")
        tokenizer = kwargs.get("tokenizer")
        feedback = chat_feedback(tokenizer, text, after_eos=states.get("finish_reason") == "stop") if tokenizer \
            else f"\n{text}\n"
        return {
            "rewards": reward,
            "scores": reward,
            "environment_feedback": "" if done else feedback,
            "done": done,
            "sampling_params": states.get("sampling_params"),
            "extra_logs": {"guess_tries": float(self.tries), "guess_found_number": float(guess is not None)},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
