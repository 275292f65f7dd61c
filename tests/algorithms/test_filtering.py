"""DAPO dynamic filtering of prompt groups."""

import math

import pytest
import torch

from rlhforge.algorithms.filtering import dynamic_filter, expand_group_mask


def test_dynamic_filter_by_hand():
    scores = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    # group means [0, 1, 0.5, 0.5]; open interval (0, 1) drops all-wrong and all-right groups
    keep = dynamic_filter(scores, 2)
    assert keep.tolist() == [False, False, True, True]
    assert expand_group_mask(keep, 2).tolist() == [False, False, False, False, True, True, True, True]
    # interval (0.2, 0.5) is open at 0.5 too
    assert dynamic_filter(scores, 2, low=0.2, high=0.5).tolist() == [False, False, False, False]
    assert dynamic_filter(scores, 2, low=-0.1, high=0.6).tolist() == [True, False, True, True]
    # already grouped [P, n] input works; a NaN mean is dropped
    assert dynamic_filter(torch.tensor([[0.0, 1.0], [math.nan, 1.0]]), 2).tolist() == [True, False]


def test_dynamic_filter_validation():
    with pytest.raises(ValueError, match="do not split into groups of 2"):
        dynamic_filter(torch.zeros(3), 2)
    with pytest.raises(ValueError, match=">= 1"):
        dynamic_filter(torch.zeros(3), 0)
    with pytest.raises(ValueError, match="low < high"):
        dynamic_filter(torch.zeros(4), 2, low=1.0, high=1.0)
    # n = 1: each sample is its own group, kept iff its score is strictly inside the interval
    assert dynamic_filter(torch.tensor([0.0, 0.3, 1.0]), 1).tolist() == [False, True, False]
