"""Sharding, placement and the worker-group seam, without Ray."""

import pytest

from rlhforge.config.parsing import ConfigError
from rlhforge.distributed.groups import InProcessGroup, balanced_shards, pad_shards, zero_weight_copy
from rlhforge.distributed.placement import check_resources, plan_placement
from rlhforge.workers.experience import ExperienceSample


def test_balanced_shards_by_hand():
    # lengths 9 8 7 6 5 4 dealt longest first in snake order over 2 ranks: r0 gets 9, 6, 5; r1 gets 8, 7, 4
    lengths = [5, 9, 4, 7, 8, 6]
    shards = balanced_shards(lengths, 2)
    assert shards == [[0, 1, 5], [2, 3, 4]]
    assert [sum(lengths[i] for i in s) for s in shards] == [20, 19]
    assert balanced_shards(lengths, 1) == [[0, 1, 2, 3, 4, 5]]
    # 7 items over 3 ranks: sizes 3, 2, 2; every index exactly once
    shards = balanced_shards(list(range(7)), 3)
    assert sorted(len(s) for s in shards) == [2, 2, 3]
    assert sorted(i for s in shards for i in s) == list(range(7))


def test_padding_copies_carry_no_loss():
    items = [ExperienceSample([1, 2, 3], [0, 1, 1], 1.0, 1.0), ExperienceSample([4, 5], [0, 1], 0.0, 0.0),
             ExperienceSample([6], [1], 0.5, 0.5)]
    chunks, real = pad_shards(items, balanced_shards([len(x) for x in items], 2), zero_weight_copy)
    # longest first, snake order: rank 0 gets item 0 (3 tokens), rank 1 items 1 and 2 (2 + 1 tokens)
    assert real == [1, 2] and [len(c) for c in chunks] == [2, 2]
    pad = chunks[0][1]
    assert pad.input_ids == [1, 2, 3] and pad.loss_mask == [0, 0, 0]
    assert items[0].loss_mask == [0, 1, 1]  # the original is untouched


def test_in_process_group_calls():
    class W:
        def double(self, xs, k=2):
            return [x * k for x in xs]

        def name(self):
            return "w"

    g = InProcessGroup(W(), "w")
    assert g.map_gather("double", [1, 2, 3], k=3) == [3, 6, 9]
    assert g.map_train("double", [1]) == [[2]]
    assert g.call("name") == ["w"]


def test_placement_plans():
    p = plan_placement({"actor": 2, "ref": 2, "critic": 2}, device="cpu")
    assert p.bundles == {"actor": 2, "ref": 2, "critic": 2} and p.total_bundles == 6
    p = plan_placement({"actor": 2, "ref": 2, "critic": 2}, device="cuda", colocate_all=True)
    assert p.bundles == {"all": 2} and p.groups["critic"].share == pytest.approx(1 / 3)
    assert p.bundle() == {"GPU": 1.0, "CPU": 1.0}
    p = plan_placement({"actor": 4, "ref": 4, "critic": 2}, device="cpu", colocate_actor_ref=True)
    assert p.bundles == {"actor": 4, "critic": 2} and p.groups["ref"].pg == "actor" and p.groups["ref"].share == 0.5
    with pytest.raises(ConfigError, match=r"colocate_actor_ref needs as many ref workers as actor workers \(actor 4, ref 2\)"):
        plan_placement({"actor": 4, "ref": 2}, device="cpu", colocate_actor_ref=True)


def test_resources_are_checked_before_anything_starts():
    p = plan_placement({"actor": 2, "critic": 2}, device="cpu")
    with pytest.raises(ConfigError, match=r"need 4 CPU bundle\(s\): actor 2 \+ critic 2 without colocation = 4; .* has 2 free CPU\(s\): add --train.colocate_all"):
        check_resources(p, {"CPU": 2.0})
    check_resources(plan_placement({"actor": 2, "critic": 2}, device="cpu", colocate_all=True), {"CPU": 2.0})
    with pytest.raises(ConfigError, match=r"need 2 GPU bundle\(s\)"):
        check_resources(plan_placement({"actor": 2}, device="cuda"), {"CPU": 16.0, "GPU": 1.0})
