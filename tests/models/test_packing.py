"""Packed (padding-free) vs padded forward: same per-token log-probs on the tiny model."""

from __future__ import annotations

import pytest
import torch

from rlhforge.data.packing import collate_packed, collate_padded
from rlhforge.data.sft import SFTSample
from rlhforge.models.forward import (
    hf_detects_packed_sequences,
    packed_causal_mask,
    sequence_logprob_sums,
    token_logprobs,
)

LENGTHS = [7, 3, 12, 5]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls: one intra-op thread avoids OpenMP spin-wait stalls on a shared 2-core box (~50x)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _samples(vocab: int) -> list[SFTSample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in LENGTHS:
        ids = torch.randint(4, vocab, (n,), generator=g).tolist()
        mask = [0] + [int(i % 3 != 0) for i in range(1, n)]
        out.append(SFTSample(ids, mask))
    return out


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=request.param)
    assert m.config._attn_implementation == request.param
    return m.eval()


def _reference(model, samples, temperature=1.0):
    """Each sample alone (no padding, no packing): log p(x_t | x_<t), 0 at t=0."""
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.input_ids])
            logits = model(input_ids=ids, use_cache=False).logits.float() / temperature
            lp = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
            out.append(torch.cat([torch.zeros(1), lp]))
    return out


def test_transformers_detects_packed_sequences():
    """transformers 5.x derives sample boundaries from resetting position ids (masking_utils)."""
    from transformers.masking_utils import find_packed_sequence_indices

    assert hf_detects_packed_sequences()
    pos = collate_packed(_samples(100))["position_ids"]
    expected = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    assert find_packed_sequence_indices(pos)[0].tolist() == expected.tolist()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_equals_padded_equals_separate(model, temperature):
    samples = _samples(model.config.vocab_size)
    padded = collate_padded(samples, pad_id=0)
    packed = collate_packed(samples)
    ref = _reference(model, samples, temperature)
    with torch.no_grad():
        lp_pad = token_logprobs(model, padded, temperature)
        lp_pack = token_logprobs(model, packed, temperature)
        lp_explicit = token_logprobs(model, packed, temperature, block_mask="explicit")
    assert lp_pad.shape == (len(LENGTHS), max(LENGTHS)) and lp_pack.shape == (1, sum(LENGTHS))
    torch.testing.assert_close(lp_pack, lp_explicit, atol=1e-5, rtol=0)
    for i, (n, r) in enumerate(zip(LENGTHS, ref)):
        start = sum(LENGTHS[:i])
        seg = lp_pack[0, start : start + n]
        assert (lp_pad[i, :n] - r).abs().max() < 1e-5
        assert (seg - r).abs().max() < 1e-5
        assert (seg - lp_pad[i, :n]).abs().max() < 1e-5
        assert seg[0] == 0 and (lp_pad[i, n:] == 0).all()  # no prediction: first token, padding
        assert (r[1:] < 0).all()
    sums_pad = sequence_logprob_sums(lp_pad, padded["loss_mask"])
    sums_pack, counts = sequence_logprob_sums(lp_pack, packed["loss_mask"], packed["seq_lens"], return_counts=True)
    torch.testing.assert_close(sums_pad, sums_pack, atol=1e-5, rtol=0)
    expected = torch.stack([(r * torch.tensor(s.loss_mask)).sum() for r, s in zip(ref, samples)])
    torch.testing.assert_close(sums_pack, expected, atol=1e-5, rtol=0)
    assert counts.tolist() == [sum(s.loss_mask) for s in samples]


def test_packed_samples_do_not_see_each_other(model):
    samples = _samples(model.config.vocab_size)
    changed = [SFTSample([(t + 1) % model.config.vocab_size for t in samples[0].input_ids], samples[0].loss_mask)]
    changed += samples[1:]
    with torch.no_grad():
        a = token_logprobs(model, collate_packed(samples))
        b = token_logprobs(model, collate_packed(changed))
    n0 = LENGTHS[0]
    assert (a[0, n0:] - b[0, n0:]).abs().max() < 1e-6
    assert (a[0, 1:n0] - b[0, 1:n0]).abs().max() > 1e-3


def test_gradients_match_between_layouts(model):
    samples = _samples(model.config.vocab_size)
    grads = []
    for batch in (collate_padded(samples, pad_id=0), collate_packed(samples)):
        model.zero_grad()
        lp = token_logprobs(model, batch)
        (-(lp * batch["loss_mask"]).sum()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    model.zero_grad()
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_packed_causal_mask():
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    allowed = packed_causal_mask(pos)[0, 0] == 0
    assert allowed.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [True, True, True, False, False],
        [False, False, False, True, False],
        [False, False, False, True, True],
    ]


def test_left_padding_without_position_ids(model):
    """A padded batch without position_ids gets them from the attention mask (left padding works)."""
    samples = _samples(model.config.vocab_size)
    width = max(LENGTHS)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(samples):
        ids[i, width - len(s) :] = torch.tensor(s.input_ids)
        mask[i, width - len(s) :] = 1
    with torch.no_grad():
        lp = token_logprobs(model, {"input_ids": ids, "attention_mask": mask})
    for i, r in enumerate(_reference(model, samples)):
        assert (lp[i, width - LENGTHS[i] :] - r).abs().max() < 1e-5
        assert (lp[i, : width - LENGTHS[i]] == 0).all()
