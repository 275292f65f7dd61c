"""Tiny model folders the tests derive from the session's tiny causal LM (``tiny_model_dir``)."""

from __future__ import annotations

from pathlib import Path


def perturbed_copy(model_dir, out: Path, seed: int, scale: float = 0.05) -> Path:
    """The model with N(0, scale) noise on every weight (a DPO reference that differs from the policy)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def tiny_reward_model(model_dir, out: Path, *, head_std: float | None = 0.5, **config) -> Path:
    """A one-label sequence classifier on the tiny model (torch seed 0), its head redrawn N(0, head_std)
    (None: HF's init), extra ``config`` attributes (e.g. ``reward_mean``) stored, with its tokenizer."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1)
    if head_std is not None:
        with torch.no_grad():
            model.score.weight.normal_(0, head_std)
    for key, value in config.items():
        setattr(model.config, key, value)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out
