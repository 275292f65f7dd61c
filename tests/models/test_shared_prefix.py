"""A prefix shared by several samples is computed once, with the outputs of the batch as it is."""

from __future__ import annotations

import pytest
import torch

from rlhforge.data.packing import collate_packed, collate_padded
from rlhforge.models.forward import token_logprobs
from rlhforge.models.shared_prefix import prefix_groups, shared_prefix_layout

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_groups_by_hand():
    a = list(range(20))
    seqs = [a + [1, 2], a[:12] + [7, 7, 7], a + [1, 3], [5] * 30, a + [9]]
    # sorted: [0..11, 7, 7, 7] (1), a+[1,2] (0), a+[1,3] (2), a+[9] (4), [5]*30 (3)
    # 1 and 0 share 12 tokens; 2 shares 12 with the first member (not less than 12): joins; so does 4
    groups = prefix_groups(seqs, min_prefix=8)
    assert sorted(m for _, ms in groups for m in ms) == [0, 1, 2, 3, 4]  # every sample once
    assert groups == [(12, [1, 0, 2, 4]), (0, [3])]
    # without the short sample the three long ones share 20 tokens (+ the common "1" of two of them: 21)
    assert prefix_groups([a + [1, 2], a + [1, 3], a + [9]], min_prefix=8) == [(20, [0, 1, 2])]
    assert prefix_groups([a + [1, 2], a + [1, 3]], min_prefix=8) == [(21, [0, 1])]
    assert prefix_groups([a, a], min_prefix=8) == [(19, [0, 1])]  # each member keeps one token of its own
    assert prefix_groups([a[:5] + [1], a[:5] + [2]], min_prefix=8) == [(0, [0]), (0, [1])]  # too short to share


def test_layout_by_hand():
    seqs = [list(range(10, 22)) + [1, 2], list(range(10, 22)) + [3], [7, 8, 9]]
    batch = collate_padded([{"input_ids": s, "loss_mask": [1] * len(s)} for s in seqs], pad_id=0)
    layout = shared_prefix_layout(batch, min_prefix=8)
    # sorted: the short sample (alone), then the 12 shared tokens once and the two own parts (2 and 1 tokens)
    assert layout.input_ids[0].tolist() == [7, 8, 9] + list(range(10, 22)) + [1, 2, 3]
    assert layout.position_ids[0].tolist() == [0, 1, 2] + list(range(12)) + [12, 13, 12]
    assert [s[:4] for s in layout.spans] == [(0, 3, 0, 0), (3, 15, 3, 3), (15, 17, 3, 15), (17, 18, 3, 15)]
    assert layout.spans[0][4] is None and layout.spans[1][4] is None
    assert layout.spans[2][4].tolist() == [[True] * 12 + [True, False], [True] * 14]
    width = batch["input_ids"].shape[1]
    assert width == 14
    assert layout.source.view(3, width).tolist() == [list(range(3, 17)), list(range(3, 15)) + [17, 18],
                                                     [0, 1, 2] + [18] * 11]
    x = torch.arange(1.0, 19.0)[None, :, None]
    back = layout.to_batch(x, batch["input_ids"].shape)[..., 0]
    assert back[2].tolist() == [1, 2, 3] + [0] * 11  # pads get zeros


def _grpo_samples(vocab: int, prompts=3, group=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for p in range(prompts):
        prompt = torch.randint(4, vocab, (10 + 3 * p,), generator=g).tolist()
        for k in range(group):
            resp = torch.randint(4, vocab, (3 + 2 * k + p,), generator=g).tolist()
            samples.append({"input_ids": prompt + resp, "loss_mask": [0] * len(prompt) + [1] * len(resp)})
    lone = torch.randint(4, vocab, (9,), generator=g).tolist()
    return samples + [{"input_ids": lone, "loss_mask": [0] * 4 + [1] * 5}]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_shared_prefixes_equal_the_batch_as_is(tiny_model_dir, layout):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    samples = _grpo_samples(model.config.vocab_size)
    batch = collate_padded(samples, pad_id=0) if layout == "padded" else collate_packed(samples)
    fed = []  # the tokens the layers compute on
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: fed.append(i[0].numel()))
    results = []
    for share in (False, True):
        model.zero_grad()
        lp, logits = token_logprobs(model, batch, 0.7, return_logits=True, share_prefixes=share)
        (-(lp * batch["loss_mask"]).sum()).backward()
        results.append((lp.detach(), logits.detach(), [p.grad.clone() for p in model.parameters()]))
    hook.remove()
    real = sum(len(s["input_ids"]) for s in samples)
    assert fed[1] == real - 3 * (10 + 13 + 16)  # each of the 3 prompts once instead of 4 times
    (lp0, logits0, g0), (lp1, logits1, g1) = results
    valid = batch["attention_mask"] if layout == "padded" else torch.ones_like(lp0)
    torch.testing.assert_close(lp1 * valid, lp0 * valid, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits1 * valid[..., None], logits0 * valid[..., None], atol=1e-5, rtol=0)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    assert model.config._attn_implementation == "sdpa"


def test_not_shared_where_it_does_not_apply(tiny_model_dir):
    """Eager attention, a batch without a shared prefix, routing records: the batch as it is (no layout)."""
    from transformers import AutoModelForCausalLM

    from rlhforge.models.forward import _shared_prefix_inputs

    batch = collate_padded(_grpo_samples(100), pad_id=0)
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager")
    sdpa = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    assert _shared_prefix_inputs(sdpa, batch, aux=False) is not None
    assert _shared_prefix_inputs(eager, batch, aux=False) is None
    assert _shared_prefix_inputs(sdpa, batch, aux=True) is None
    assert _shared_prefix_inputs(sdpa, {**batch, "routed_experts": torch.zeros(1)}, aux=False) is None
    # a 10-token prompt before two 100-token answers saves 10 of 220 tokens (< MIN_SAVED, 5%): kept whole
    long_answers = collate_padded([{"input_ids": list(range(4, 14)) + [20 + i] * 100, "loss_mask": [1] * 110}
                                   for i in range(2)], pad_id=0)
    assert shared_prefix_layout(long_answers) is None
    # before two 60-token answers it saves 10 of 140 (7%): shared
    short_answers = collate_padded([{"input_ids": list(range(4, 14)) + [20 + i] * 60, "loss_mask": [1] * 70}
                                    for i in range(2)], pad_id=0)
    assert shared_prefix_layout(short_answers).input_ids.shape[1] == 10 + 2 * 60
    distinct = collate_padded([{"input_ids": [i + 4] * 12, "loss_mask": [1] * 12} for i in range(4)], pad_id=0)
    assert shared_prefix_layout(distinct) is None
