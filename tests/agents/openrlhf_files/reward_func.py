"""An OpenRLHF reward file: plain function, torch tensors out."""

import torch


def reward_func(queries, prompts, labels, **kwargs):
    # reward: how many times the label occurs in the response part of the query
    counts = [float(q[len(p):].count(str(lab))) for q, p, lab in zip(queries, prompts, labels)]
    rewards = torch.tensor(counts)
    scores = (rewards > 0).float()
    return {"rewards": rewards, "scores": scores, "extra_logs": {"label_hits": rewards.clone()}}
