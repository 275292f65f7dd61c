"""An agent written against the official ``openai`` client, trained with rlhforge.

rlhforge serves the policy on 127.0.0.1 (OpenAI chat-completions API) and passes ``run_agent`` a
client bound to this sample's session; every token the agent gets is recorded exactly. This agent
answers, asks itself to double-check once ("reflection" turn) and is rewarded by math-verify.

    rlhforge rl --config examples/agents/openai_agent.yaml
"""

from rlhforge.rewards.math import math_reward


async def run_agent(prompt, label, client):
    messages = [{"role": "user", "content": prompt}]
    first = await client.chat.completions.create(model="policy", messages=messages, max_tokens=96)
    answer = first.choices[0].message.content
    messages += [{"role": "assistant", "content": answer},
                 {"role": "user", "content": "Check your answer once more and give the final answer in \\boxed{}."}]
    second = await client.chat.completions.create(model="policy", messages=messages, max_tokens=96)
    final = second.choices[0].message.content
    reward = math_reward(final, str(label))
    return {"reward": reward, "scores": reward,
            "extra_logs": {"first_correct": math_reward(answer, str(label))}}
