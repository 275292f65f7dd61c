"""Critic values of a packed micro-batch (run in bounded rows) equal the padded batch's, token by token,
and so do their gradients."""

import torch

from rlhforge.data.packing import collate_packed, collate_padded
from rlhforge.workers.actor import token_values
from tests.model_helpers import tiny_reward_model


def test_packed_values_equal_padded(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model(tiny_model_dir, tmp_path / "rm"),
                                                               attn_implementation="sdpa").eval()
    lengths = [9, 23, 5, 17, 12, 30]  # several bounded rows (a row is at most the longest sample)
    seqs = [{"input_ids": torch.randint(3, 200, (n,)).tolist(), "loss_mask": [1] * n} for n in lengths]
    padded, packed = collate_padded(seqs, 0), collate_packed(seqs)
    from rlhforge.models.forward import packed_rows

    assert packed_rows(packed) is not None and packed_rows(packed).input_ids.shape[0] > 1
    vp = token_values(model, padded)
    vk = token_values(model, packed)
    flat = torch.cat([vp[i, :n] for i, n in enumerate(lengths)])
    assert vk.shape == (1, sum(lengths))
    starts = torch.tensor([0, *lengths]).cumsum(0)[:-1]
    keep = torch.ones(sum(lengths), dtype=torch.bool)
    keep[starts] = False  # V(before the first token) is 0 padded; packed it reads the previous sample (masked out)
    torch.testing.assert_close(vk[0][keep], flat[keep], rtol=1e-5, atol=1e-5)
    sum(vp[i, 1:n].sum() for i, n in enumerate(lengths)).backward()  # the same loss on both layouts
    g_padded = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    vk[0][keep].sum().backward()
    for a, b in zip(g_padded, (p.grad for p in model.parameters())):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-4)  # fp32, other summation order
