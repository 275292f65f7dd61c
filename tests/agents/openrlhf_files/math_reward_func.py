"""An OpenRLHF math reward file: uses openrlhf.utils' boxed-answer helpers."""

import torch

from openrlhf.utils import extract_boxed_answer, grade_answer


def reward_func(queries, prompts, labels, **kwargs):
    correct = []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt):] if query.startswith(prompt) else query
        correct.append(1.0 if grade_answer(extract_boxed_answer(response), label) else 0.0)
    rewards = torch.tensor(correct, dtype=torch.float)
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"math_accuracy": rewards.mean()}}
