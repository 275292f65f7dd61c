"""Batched generation with HF ``generate`` (KV cache, left padding): token ids in, token ids out."""

from __future__ import annotations

from typing import Sequence

import torch


@torch.no_grad()
def generate_ids(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    eos_token_id: int | list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    batch_size: int = 32,
) -> list[list[int]]:
    """Completion ids per prompt (eos kept when generated, padding removed). ``temperature=0`` is greedy."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: list[list[int]] = []
    eos = set(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id])
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, p in enumerate(chunk):
            ids[row, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            attn[row, width - len(p) :] = 1
        sampling = dict(do_sample=temperature > 0)
        if temperature > 0:
            sampling.update(temperature=temperature, top_p=top_p, top_k=top_k or None)
        gen = model.generate(
            input_ids=ids.to(device), attention_mask=attn.to(device), max_new_tokens=max_new_tokens,
            pad_token_id=pad_token_id, eos_token_id=list(eos), **sampling,
        )
        for row in gen[:, width:].tolist():
            tokens = []
            for t in row:
                tokens.append(t)
                if t in eos:
                    break
            out.append(tokens)
    model.train(was_training)
    return out
