"""A custom executor written for OpenRLHF: its own execute() in OpenRLHF's signature, driving a
vLLM-style engine (token ids in, RequestOutput out) for two turns with a fixed reply between."""

from copy import deepcopy

import torch

from openrlhf.utils.agent import AgentExecutorBase

REPLY = "\nok, once more:\n"


class AgentExecutor(AgentExecutorBase):
    def __init__(self):
        self.turns = 2

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine):
        tokens = hf_tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"][0].tolist()
        log_probs = [0.0] * len(tokens)
        action_ranges = []
        lengths = []
        finish = None
        for turn in range(self.turns):
            params = deepcopy(sampling_params)
            params.max_tokens = min(6, max_length - len(tokens))
            if params.max_tokens <= 0:
                break
            output = (await llm_engine.generate(tokens, params)).outputs[0]
            action = list(output.token_ids)
            action_ranges.append((len(tokens), len(tokens) + len(action)))
            tokens = tokens + action
            for tok, lp in zip(action, output.logprobs):
                log_probs.append(lp[tok].logprob)
            lengths.append(len(output.text))
            finish = output.finish_reason
            if turn + 1 < self.turns:
                reply = hf_tokenizer(REPLY, add_special_tokens=False)["input_ids"]
                tokens = tokens + reply
                log_probs.extend([0.0] * len(reply))
        reward = torch.tensor(float(sum(lengths)) / 10.0)
        return {
            "prompt": prompt,
            "label": label,
            "observation_tokens": tokens,
            "action_ranges": action_ranges,
            "rollout_log_probs": log_probs,
            "reward": reward,
            "scores": 1.0 if label == "yes" else 0.0,
            "extra_logs": {"text_chars": float(sum(lengths))},
            "truncated": finish == "length",
        }
