"""Issue 42's cuts of an RL step's overheads give the numbers of the paths they replace: the HF engine's
post-sync probe scores its sequences a few per forward (right-padded) and equals one forward per
sequence; the grouping of the probe is hand-checked."""

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

