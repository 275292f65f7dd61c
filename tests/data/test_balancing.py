"""Token-budget micro-batch planning (rlhforge.data.balancing): counts, balance, every index once."""

import itertools

import pytest

from rlhforge.data.balancing import (
    balanced_partition,
    count_micro_batches,
    micro_batch_groups,
    padding_stats,
    plan_micro_batches,
)


def _flat(groups):
    return sorted(i for g in groups for i in g)


def test_first_fit_count_by_hand():
    # FFD under 40: 30+10 | 20+20 | 5+5+5+5 -> 3 (a sum bound alone, ceil(100/40) = 3, agrees)
    assert count_micro_batches([30, 5, 5, 5, 20, 20, 10, 5], 40) == 3
    # a sample over the budget gets a micro-batch of its own: 50 | 45 | 10+10+10
    assert count_micro_batches([10, 50, 10, 45, 10], 40) == 3
    assert count_micro_batches([7] * 6, 14) == 3 and count_micro_batches([7] * 6, 13) == 6
    assert count_micro_batches([], 10) == 0


def test_balanced_partition_by_hand():
    # 100 tokens in 3 groups: Karmarkar-Karp gives 35 | 35 | 30
    groups = balanced_partition([30, 5, 5, 5, 20, 20, 10, 5], 3)
    assert groups == [[1, 3, 4, 7], [2, 5, 6], [0]]
    assert [sum([30, 5, 5, 5, 20, 20, 10, 5][i] for i in g) for g in groups] == [35, 35, 30]
    # largest differencing on 8 7 6 5 4 (k = 2): {8,7}->1, {6,5}->1, then 4 vs 1 -> 3, then 3 vs 1 -> 16 | 14
    assert balanced_partition([8, 7, 6, 5, 4], 2) == [[1, 3, 4], [0, 2]]
    # k = n: one sample each, heaviest first; k = 1: everything
    assert balanced_partition([3, 9, 1], 3) == [[1], [0], [2]]
    assert balanced_partition([3, 9, 1], 1) == [[0, 1, 2]]


@pytest.mark.parametrize("seed", range(20))
def test_partition_uses_every_index_once_and_is_balanced(seed):
    import random

    rng = random.Random(seed)
    lengths = [rng.randint(1, 200) for _ in range(rng.randint(1, 40))]
    for k in {1, 2, 3, len(lengths)} & set(range(1, len(lengths) + 1)):
        groups = balanced_partition(lengths, k)
        assert len(groups) == k and all(groups) and _flat(groups) == list(range(len(lengths)))
        assert all(g == sorted(g) for g in groups)
        sums = [sum(lengths[i] for i in g) for g in groups]
        assert sums == sorted(sums, reverse=True)
        # largest differencing is never worse than the longest sample above the mean
        assert max(sums) - sum(lengths) / k <= max(lengths)
        assert balanced_partition(lengths, k) == groups  # deterministic


def test_partition_is_optimal_on_small_cases():
    """Exhaustive check on 6 items, k = 2: KK reaches the best split on these (by hand: 15 | 15)."""
    lengths = [9, 7, 5, 4, 3, 2]  # total 30
    best = min(abs(2 * sum(c) - 30) for r in range(7) for c in itertools.combinations(lengths, r))
    groups = balanced_partition(lengths, 2)
    sums = [sum(lengths[i] for i in g) for g in groups]
    assert best == 0 and sums == [15, 15]


def test_plan_and_groups():
    lengths = [30, 5, 5, 5, 20, 20, 10, 5]
    assert plan_micro_batches(lengths, 40) == balanced_partition(lengths, 3)
    assert plan_micro_batches(lengths, 40, num_micro_batches=4) == balanced_partition(lengths, 4)  # agreed over ranks
    assert micro_batch_groups(lengths, 3, None) == [[0, 1, 2], [3, 4, 5], [6, 7]]  # fixed: consecutive chunks
    assert micro_batch_groups(lengths, 3, 40) == balanced_partition(lengths, 3)
    assert micro_batch_groups(lengths, 3, 40, agree=lambda k: k + 2) == balanced_partition(lengths, 5)
    with pytest.raises(ValueError, match="cannot split 2 samples into 3"):
        balanced_partition([4, 5], 3)
    with pytest.raises(ValueError, match="lengths must be >= 1"):
        balanced_partition([4, 0], 1)


def test_padding_stats_by_hand():
    lengths = [10, 2, 2, 10]
    # fixed pairs [10,2] [2,10]: each pads to 10 -> 40 computed for 24 real (padding 0.4)
    fixed = padding_stats([[0, 1], [2, 3]], lengths)
    assert fixed == {"passes": 2.0, "real_tokens": 24.0, "padded_tokens": 40.0, "padding_fraction": 0.4}
    # one packed pass of 24 tokens in a padded layout would still pad to 10 per row
    assert padding_stats([[0, 1, 2, 3]], lengths)["padded_tokens"] == 40.0
    assert padding_stats([[0, 3], [1, 2]], lengths)["padding_fraction"] == 0.0
