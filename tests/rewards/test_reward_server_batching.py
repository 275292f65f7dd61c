"""serve-rm's forward passes are cut by a padded-token budget (issue 46, item 10): one long query no longer pads a
whole batch of short ones to its length."""

from rlhforge.rewards.server import length_chunks


def test_chunks_hand_worked():
    lengths = [10, 2000, 12, 11, 300, 9]
    # sorted: 9 (5), 10 (0), 11 (3), 12 (2), 300 (4), 2000 (1); budget 1000 tokens, at most 4 rows
    assert length_chunks(lengths, 4, 1000) == [[5, 0, 3, 2], [4], [1]]
    # 300 joins no row of 4 (5 x 300 > 1000 and the row is full); 2000 is over the budget: alone
    assert length_chunks(lengths, 8, 1000) == [[5, 0, 3, 2], [4], [1]]
    assert length_chunks(lengths, 8, 10**6) == [[5, 0, 3, 2, 4, 1]]


def test_one_long_query_among_many_short_ones_runs_alone():
    lengths = [20] * 31 + [2048]
    chunks = length_chunks(lengths, 32, 16384)
    assert chunks[-1] == [31] and sum(len(c) for c in chunks) == 32
    assert max(len(c) * max(lengths[i] for i in c) for c in chunks) == 2048  # was 32 x 2048 = 65536 padded tokens
