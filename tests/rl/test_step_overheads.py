"""Issue 42's cuts of a step's overheads give the numbers of the paths they replace: the HF engine's
post-sync probe scores its sequences a few per forward (right-padded) and equals one forward per
sequence (the grouping hand-checked); a reused weight checksum equals a fresh read after any write; DPO's
lm_head on the response tokens only gives the sums and gradients of the head on every position."""

import pytest
import torch

from rlhforge.rollout.hf_engine import HFEngine, probe_batches


def test_probe_batches_group_in_order_within_the_padded_budget():
    # rows x longest <= 128: 8 x 16 fits, a 9th row does not; 127 goes alone; 200 (over budget) alone
    assert probe_batches([16] * 9, 128) == [list(range(8)), [8]]
    assert probe_batches([30, 40, 127, 2, 200, 5], 128) == [[0, 1], [2], [3], [4], [5]]
    assert probe_batches([60, 2, 3], 128) == [[0, 1], [2]]  # 3 x 60 > 128
    assert probe_batches([], 128) == []


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    return HFEngine(model, pad_token_id=0, eos_token_id=1)


def test_the_batched_probe_equals_one_forward_per_sequence(engine):
    vocab = engine.model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, vocab, (n,), generator=g).tolist() for n in (16, 9, 17, 2, 16, 40, 127, 5)]
    assert len(probe_batches([len(p) for p in prompts], engine.PROBE_BATCH_TOKENS)) < len(prompts)  # batched
    [(name, rows)] = engine.probe_logprobs(prompts)
    assert name == "HF engine" and [len(r) for r in rows] == [len(p) - 1 for p in prompts]
    with torch.no_grad():
        for ids, row in zip(prompts, rows):  # the former path: one plain forward per sequence
            x = torch.tensor([ids])
            want = torch.log_softmax(engine.model(input_ids=x).logits[0, :-1].float(), -1)
            want = want.gather(-1, x[0, 1:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(row), want, rtol=0, atol=1e-5)


def test_a_reused_checksum_is_read_again_after_any_write():
    from rlhforge.backend.fingerprint import _checksum, tensor_checksum

    t = torch.arange(12, dtype=torch.float32)
    first = tensor_checksum(t)
    assert tensor_checksum(t, reuse=True) == first == _checksum(t)
    t.add_(1.0)  # an in-place write: the version counter moves, the sums are read again
    assert tensor_checksum(t, reuse=True) == _checksum(t) != first
    with torch.no_grad():
        t[3] = 0.0  # so does an indexed write under no_grad
    assert tensor_checksum(t, reuse=True) == _checksum(t)
    view = t.view(3, 4)  # another object over the same storage is its own entry
    assert tensor_checksum(view, reuse=True) == _checksum(view)


def test_a_sync_into_the_hf_engine_reports_what_a_full_read_finds(engine):
    from rlhforge.backend.fingerprint import params_checksum, state_fingerprint

    state = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    for v in state.values():
        v.mul_(1.5)
    sent = state_fingerprint(state)  # the sender's print (remembered), then the engine's load
    engine.update_weights(state)
    [(_, [report])] = engine.sync_reports()
    assert report["fingerprint"] == sent == state_fingerprint({k: v.clone() for k, v in state.items()})
    assert report["params_changed"] is True
    assert params_checksum(engine.model, reuse=True) == params_checksum(engine.model)
    engine.update_weights(state)  # the same weights again: nothing changed, and that is what is reported
    assert engine.sync_reports()[0][1][0]["params_changed"] is False
    with torch.no_grad():
        next(engine.model.parameters()).add_(1.0)  # a write outside a load is seen by the next checksum
    assert params_checksum(engine.model, reuse=True) == params_checksum(engine.model)


@pytest.mark.parametrize("packed", [False, True])
def test_dpo_log_probs_on_response_tokens_only_equal_the_full_head(tiny_model_dir, packed):
    """DPO's sums and response token log-probs (policy and reference) with the lm_head on the response
    tokens only (``needed=loss_mask``) equal those of the head on every position; gradients too."""
    from rlhforge.data.preference import PreferenceSample, collate_pairs
    from rlhforge.models.forward import sequence_logprob_sums, token_logprobs
    from rlhforge.trainers.dpo import _sequence_logps

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    vocab = model.config.vocab_size

    def pair(prompt, chosen, rejected):
        p = torch.randint(2, vocab, (prompt,), generator=g).tolist()
        c, r = (torch.randint(2, vocab, (n,), generator=g).tolist() for n in (chosen, rejected))
        return PreferenceSample(p + c, [0] * prompt + [1] * chosen, p + r, [0] * prompt + [1] * rejected,
                                prompt_len=prompt)

    batch = collate_pairs([pair(12, 5, 9), pair(7, 11, 3), pair(20, 4, 4)], 0, packed=packed)
    sums, token_lp, mask = _sequence_logps(model, batch)
    full = token_logprobs(model, batch, share_prefixes=True)  # the head on every position (the former path)
    want = sequence_logprob_sums(full, batch["loss_mask"], batch["seq_lens"] if packed else None)
    torch.testing.assert_close(sums, want, rtol=0, atol=1e-5)
    (grad,) = torch.autograd.grad(sums.sum(), [model.get_output_embeddings().weight])
    (want_grad,) = torch.autograd.grad(want.sum(), [model.get_output_embeddings().weight])
    torch.testing.assert_close(grad, want_grad, rtol=1e-4, atol=1e-6)
    assert float(token_lp[mask == 0].abs().sum()) == 0.0 and mask.sum() == 5 + 11 + 4 + 9 + 3 + 4


def test_the_fused_adamw_of_the_cpu_strategy_follows_the_plain_one(tiny_model_dir):
    """The plain-torch strategy on CPU steps with torch's fused AdamW; five steps with weight decay on
    some parameters land where the per-op AdamW lands, up to float rounding."""
    from transformers import AutoModelForCausalLM

    from rlhforge.backend.optim import build_optimizer
    from rlhforge.config.components import AdamConfig, OptimConfig

    cfg = OptimConfig(adam=AdamConfig(lr=1e-3, weight_decay=0.1))
    weights = []
    for fused in (False, True):
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
        opt = build_optimizer(model, cfg, fused=fused)
        assert opt.defaults["fused"] is (True if fused else None)
        g = torch.Generator().manual_seed(7)
        for _ in range(5):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        weights.append([p.detach().clone() for p in model.parameters()])
    moved = max(float((a - b).abs().max()) for a, b in zip(weights[0], weights[1]))
    assert moved < 1e-6


@pytest.mark.parametrize("packed", [False, True])
def test_sft_nll_on_the_trained_tokens_only_equals_the_full_head(tiny_model_dir, packed):
    """SFT's per-token NLL with the lm_head on the loss-mask tokens only equals, on those tokens, the NLL
    of the head on every position; the gradient of the masked sum too."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from rlhforge.data.packing import collate_packed, collate_padded
    from rlhforge.models.forward import token_logprobs
    from rlhforge.trainers.sft import SFTTrainer

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    g = torch.Generator().manual_seed(9)
    vocab = model.config.vocab_size
    samples = [{"input_ids": torch.randint(2, vocab, (p + c,), generator=g).tolist(), "loss_mask": [0] * p + [1] * c}
               for p, c in ((10, 6), (3, 20), (15, 2))]
    collate = (lambda s: collate_packed(s)) if packed else (lambda s: collate_padded(s, 0))
    trainer = SimpleNamespace(model=model, ring=None, _collate=collate)
    nll, mask = SFTTrainer._token_nll(trainer, samples)
    full = -token_logprobs(model, collate(samples))  # the former path: the head on every position
    torch.testing.assert_close(nll * mask, full * mask, rtol=0, atol=1e-5)
    assert float(nll[mask == 0].abs().sum()) == 0.0  # prompt positions: no logits computed
    weight = model.get_output_embeddings().weight
    (got,) = torch.autograd.grad((nll * mask).sum(), [weight])
    (want,) = torch.autograd.grad((full * mask).sum(), [weight])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_the_int32_sampling_noise_has_the_bits_of_the_int64_form():
    """The HF engine's counter-based noise, hashed in int32, equals its former int64 arithmetic bit for bit
    (keys with the high bit set, steps past 2**31, vocabularies from 1 to a real one's size)."""
    from rlhforge.rollout.hf_generate import _counter_uniform_int64, counter_uniform, seed_keys

    g = torch.Generator().manual_seed(0)
    seeds = [int(x) for x in torch.randint(0, 2**62, (5,), generator=g)] + [0, 2**64 - 1, 2**63, 2**31]
    keys = seed_keys(seeds)
    assert bool((keys >= 2**31).any()) and bool((keys < 2**31).any())
    for vocab in (1, 7, 1000, 151936):
        for step in (0, 1, 63, 2**31 + 5, 2**32 - 1):
            got = counter_uniform(keys, step, vocab)
            assert torch.equal(got, _counter_uniform_int64(keys, step, vocab)), (vocab, step)
            assert 0 < float(got.min()) and float(got.max()) < 1
