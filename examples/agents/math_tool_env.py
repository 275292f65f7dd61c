"""Math with a Python tool, as a multi-turn environment (OpenRLHF's agent API).

Each turn the model may write a ```python block; the environment runs it in rlhforge's sandbox and
returns the output as the next user turn. A turn without code is the final answer, checked with
math-verify against the label (reward 1.0 or 0.0). At most 3 tool calls.

    rlhforge rl --config examples/agents/math_tool.yaml

(The built-in registry env ``math_tir`` does the same with ``--train.agent_func_path registry``.)
"""

from rlhforge.agents import AgentInstanceBase, MultiTurnAgentExecutor, chat_feedback
from rlhforge.agents.sandbox import Sandbox, SandboxConfig, extract_code_blocks, format_feedback
from rlhforge.rewards.math import math_reward

MAX_TOOL_CALLS = 3
SANDBOX = Sandbox(SandboxConfig(timeout_s=5.0, memory_bytes=512 << 20, concurrency=8))


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.tool_calls = 0

    async def step(self, states, **kwargs):
        action = states["action_text"]
        blocks = extract_code_blocks(action)
        if blocks and self.tool_calls < MAX_TOOL_CALLS:
            self.tool_calls += 1
            result = await SANDBOX.run(blocks[-1])
            text = f"```output\n{format_feedback(result)}\n```"
            tokenizer = kwargs.get("tokenizer")
            after_eos = states.get("finish_reason") == "stop"
            feedback = chat_feedback(tokenizer, text, after_eos=after_eos) if tokenizer else f"\n{text}\n"
            return {"rewards": 0.0, "environment_feedback": feedback, "done": False,
                    "extra_logs": {"tool_calls": float(self.tool_calls), "tool_ok": float(result.ok)}}
        reward = math_reward(action, str(states["label"]))
        return {"rewards": reward, "scores": reward, "environment_feedback": "", "done": True,
                "extra_logs": {"tool_calls": float(self.tool_calls)}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
