"""Padded/packed collation and micro-batching."""

from __future__ import annotations

import random

import pytest
import torch

from rlhforge.data.packing import collate_packed, collate_padded, split_into_micro_batches, token_budget_batches
from rlhforge.data.sft import SFTSample

SAMPLES = [
    SFTSample([5, 6, 7], [0, 1, 1]),
    {"input_ids": [8, 9], "loss_mask": [0, 1]},
    SFTSample([1, 2, 3, 4], [0, 0, 1, 1]),
]


def test_collate_padded_layout():
    b = collate_padded(SAMPLES, pad_id=0)
    assert b["input_ids"].tolist() == [[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0], [0, 1, 0, 0], [0, 1, 2, 3]]
    assert b["loss_mask"].tolist() == [[0, 1, 1, 0], [0, 1, 0, 0], [0, 0, 1, 1]]
    assert b["input_ids"].dtype == b["attention_mask"].dtype == b["position_ids"].dtype == torch.long
    assert b["loss_mask"].dtype == torch.float32


def test_collate_packed_layout():
    b = collate_packed(SAMPLES)
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert b["loss_mask"].tolist() == [[0, 1, 1, 0, 1, 0, 0, 1, 1]]
    assert b["cu_seqlens"].tolist() == [0, 3, 5, 9] and b["cu_seqlens"].dtype == torch.int32
    assert b["seq_lens"] == [3, 2, 4] and b["max_seqlen"] == 4
    assert "attention_mask" not in b


def test_collate_rejects_bad_samples():
    with pytest.raises(ValueError, match="sample 0: input_ids has 2 tokens but loss_mask has 1"):
        collate_packed([{"input_ids": [1, 2], "loss_mask": [0]}])
    with pytest.raises(ValueError, match="empty list"):
        collate_padded([], pad_id=0)


def test_token_budget_batches_respects_budget_and_keeps_every_index_once():
    rng = random.Random(0)
    for trial in range(50):
        lengths = [rng.randint(1, 120) for _ in range(rng.randint(1, 60))]
        budget = rng.randint(20, 300)
        batches = token_budget_batches(lengths, budget)
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        for b in batches:
            assert sum(lengths[i] for i in b) <= budget or len(b) == 1
            assert b == sorted(b)
        assert batches == token_budget_batches(lengths, budget)  # deterministic
        # first-fit decreasing never needs more than ~11/9 OPT + 1 bins; check a loose lower bound
        assert len(batches) >= -(-sum(min(n, budget) for n in lengths) // budget)


def test_token_budget_batches_examples():
    assert token_budget_batches([5, 3, 4, 2], 7) == [[0, 3], [1, 2]]
    assert token_budget_batches([10, 1, 1], 4) == [[0], [1, 2]]  # oversized sample alone
    assert token_budget_batches([], 4) == []
    with pytest.raises(ValueError):
        token_budget_batches([1], 0)


def test_split_into_micro_batches():
    assert split_into_micro_batches(range(7), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert split_into_micro_batches([], 2) == []
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1"):
        split_into_micro_batches([1], 0)
