"""Overlong penalty, stop-properly penalty, RunningMeanStd."""

import math

import pytest
import torch

from rlhforge.algorithms.shaping import RunningMeanStd, overlong_penalty, stop_properly_penalty


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([5, 6, 7, 10, 12])
    # max_len 10, buffer 4: penalty starts after 6 tokens; excess [0, 0, 1, 4, 6] / 4 capped at 1, times 2
    torch.testing.assert_close(overlong_penalty(lengths, max_len=10, buffer_len=4, penalty_factor=2.0), torch.tensor([0.0, 0.0, -0.5, -2.0, -2.0]))
    torch.testing.assert_close(overlong_penalty(torch.tensor([0]), 10, 4), torch.tensor([0.0]))  # zero-length response
    with pytest.raises(ValueError, match="0 < buffer_len <= max_len"):
        overlong_penalty(lengths, max_len=10, buffer_len=0)
    with pytest.raises(ValueError, match="0 < buffer_len <= max_len"):
        overlong_penalty(lengths, max_len=10, buffer_len=11)


def test_stop_properly_penalty():
    rewards = torch.tensor([1.0, 2.0, -1.0])
    truncated = torch.tensor([False, True, True])
    torch.testing.assert_close(stop_properly_penalty(rewards, truncated, 0.5), torch.tensor([1.0, 1.0, -0.5]))  # scale
    torch.testing.assert_close(stop_properly_penalty(rewards, truncated, 0.0), torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(stop_properly_penalty(rewards, truncated, -1.0), torch.tensor([1.0, -1.0, -1.0]))  # fixed
    with pytest.raises(ValueError, match="must be <= 1"):
        stop_properly_penalty(rewards, truncated, 1.5)


def test_running_mean_std_by_hand():
    rms = RunningMeanStd()
    torch.testing.assert_close(rms.normalize(torch.tensor([3.0])), torch.tensor([3.0]), atol=1e-7, rtol=0)  # identity
    rms.update(torch.tensor([1.0, 2.0, 3.0]))
    rms.update(torch.tensor([]))  # no-op
    rms.update(torch.tensor([4.0, 5.0]))
    # all of 1..5: mean 3, population var (4 + 1 + 0 + 1 + 4) / 5 = 2
    assert rms.count == 5
    assert rms.mean.item() == pytest.approx(3.0)
    assert rms.var.item() == pytest.approx(2.0)
    # (5 - 3) / sqrt(2) = 1.414214 ; without centring 5 / sqrt(2) = 3.535534 ; clip to 1
    assert rms.normalize(torch.tensor([5.0])).item() == pytest.approx(math.sqrt(2), rel=1e-6)
    assert rms.normalize(torch.tensor([5.0]), center=False).item() == pytest.approx(5 / math.sqrt(2), rel=1e-6)
    assert rms.normalize(torch.tensor([5.0]), clip=1.0).item() == 1.0


def test_running_mean_std_matches_full_statistics_and_resumes():
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(k, 2, generator=g, dtype=torch.float64) * 3 + 1 for k in (1, 7, 3, 12)]
    rms = RunningMeanStd(shape=(2,))
    for c in chunks[:2]:
        rms.update(c)
    resumed = RunningMeanStd(shape=(2,))
    resumed.load_state_dict(rms.state_dict())
    for c in chunks[2:]:
        rms.update(c)
        resumed.update(c)
    full = torch.cat(chunks)
    torch.testing.assert_close(rms.mean, full.mean(0))
    torch.testing.assert_close(rms.var, full.var(0, correction=0))
    torch.testing.assert_close(resumed.mean, rms.mean)
    torch.testing.assert_close(resumed.var, rms.var)
    assert resumed.count == 23
    with pytest.raises(ValueError, match="state has shape"):
        RunningMeanStd().load_state_dict(rms.state_dict())
