"""A padded CPU forward of a grouped-query model attends with ``enable_gqa``, not with repeated key/value heads:
the same log-probs bit for bit, the same gradients up to the order of a sum."""

from __future__ import annotations

import pytest
import torch

from rlhforge.models.forward import token_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _padded(vocab: int, lengths=(9, 14, 5, 12), left: bool = True) -> dict:
    g = torch.Generator().manual_seed(3)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        cols = slice(width - n, width) if left else slice(0, n)
        ids[i, cols] = torch.randint(4, vocab, (n,), generator=g)
        mask[i, cols] = 1
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture(scope="module")
def gqa_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # the tiny default is GQA
    return model


def _logprobs_and_grads(model, batch):
    model.zero_grad()
    logps = token_logprobs(model, batch)
    weights = torch.rand(logps.shape, generator=torch.Generator().manual_seed(5))
    (logps * weights).sum().backward()
    return logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _repeated_heads(monkeypatch):
    """Make the block a no-op: the forward attends as transformers' sdpa does (heads repeated under a mask)."""
    from rlhforge.models import segment_attention

    monkeypatch.setattr(segment_attention, "_padded_gqa_cpu", lambda model, kwargs: False)


@pytest.mark.parametrize("left", [True, False], ids=["left-padded", "right-padded"])
def test_padded_gqa_equals_the_repeated_heads(gqa_model, monkeypatch, left):
    from transformers.integrations import sdpa_attention

    batch = _padded(gqa_model.config.vocab_size, left=left)
    calls = []
    real = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: calls.append(n) or real(x, n))
    fast, fast_grads = _logprobs_and_grads(gqa_model, batch)
    assert calls == []  # no layer repeated its key/value heads
    with monkeypatch.context() as m:
        _repeated_heads(m)
        ref, ref_grads = _logprobs_and_grads(gqa_model, batch)
    assert len(calls) == 2 * gqa_model.config.num_hidden_layers  # key and value, every layer
    assert torch.equal(fast, ref)
    assert fast_grads.keys() == ref_grads.keys()
    for name, grad in fast_grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_block_leaves_other_forwards_to_transformers(gqa_model, tiny_model_dir, tmp_path):
    """Not entered for an unmasked or packed batch (their own paths), eager attention, a model whose key/value
    heads are not grouped, or gradient checkpointing."""
    from transformers import AutoModelForCausalLM

    from rlhforge.models.segment_attention import _padded_gqa_cpu
    from rlhforge.models.tiny import TinyModelSpec, build_tiny_model

    batch = _padded(gqa_model.config.vocab_size)
    kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    assert _padded_gqa_cpu(gqa_model, kwargs)
    assert not _padded_gqa_cpu(gqa_model, {"input_ids": batch["input_ids"], "attention_mask": None})
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager")
    assert not _padded_gqa_cpu(eager, kwargs)
    mha_dir = build_tiny_model(tmp_path / "mha", TinyModelSpec(num_key_value_heads=4), seed=0)
    mha = AutoModelForCausalLM.from_pretrained(mha_dir, dtype=torch.float32, attn_implementation="sdpa")
    assert mha.config.num_key_value_heads == mha.config.num_attention_heads
    assert not _padded_gqa_cpu(mha, kwargs)
    gqa_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    try:
        assert not _padded_gqa_cpu(gqa_model, kwargs)
    finally:
        gqa_model.gradient_checkpointing_disable()
