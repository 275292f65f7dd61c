"""builtin:shape_colour: deterministic images, disjoint splits, the answer check, the format-only warm start,
and its reward through the built-in reward source."""

import asyncio

import pytest

from rlhforge.data.builtin import check_answer, generate_builtin, verifiable_tasks
from rlhforge.data.builtin_vlm import PALETTE
from rlhforge.data.errors import DataError


def _key(r):
    return (r["answer"], r["images"][0].size, r["images"][0].tobytes())


def test_records_are_deterministic_and_the_splits_disjoint():
    a = generate_builtin("shape_colour", "train", n=200, seed=1)
    b = generate_builtin("shape_colour", "train", n=200, seed=1)
    assert [_key(r) for r in a] == [_key(r) for r in b]
    test = generate_builtin("shape_colour", "test", n=100, seed=1)
    assert not {_key(r) for r in a} & {_key(r) for r in test}
    assert {r["answer"] for r in a} == set(list(PALETTE)[:4])
    r = a[0]
    assert r["prompt"].startswith("<image>") and r["completion"] == r["answer"]
    # the shape's colour is in the image: its most common non-grey pixel is the palette colour
    pixels = [p for p in r["images"][0].convert("RGB").get_flattened_data() if p not in ((128, 128, 128), (90, 90, 90))]
    assert max(set(pixels), key=pixels.count) == PALETTE[r["answer"]]


def test_format_only_records_have_no_image_and_random_answers():
    recs = generate_builtin("shape_colour", "train", n=400, seed=0, colours=3, format_only=1)
    assert all(r["images"] == [] and "<image>" not in r["prompt"] for r in recs)
    counts = {c: sum(r["answer"] == c for r in recs) for c in ("red", "green", "blue")}
    assert all(100 < n < 170 for n in counts.values()), counts


@pytest.mark.parametrize("completion, score", [("red", 1.0), (" Red<|im_end|>", 1.0), ("red or blue", 1.0),
                                               ("blue red", 0.0), ("", 0.0), ("reddish", 0.0)])
def test_answer_check(completion, score):
    assert check_answer("shape_colour", completion, "red") == score


def test_bad_parameters_and_the_builtin_reward():
    with pytest.raises(DataError, match="colours must be 2..6"):
        generate_builtin("shape_colour", "train", n=2, colours=9)
    assert "shape_colour" in verifiable_tasks()
    from rlhforge.rewards.base import RewardBatch
    from rlhforge.rewards.sources import BuiltinReward

    batch = RewardBatch(queries=["q"] * 3, prompts=["p"] * 3, responses=["green", "blue", "x"],
                        labels=["green", "green", "green"], datasources=["shape_colour"] * 3)
    out = asyncio.run(BuiltinReward("shape_colour")(batch))
    assert list(out.rewards) == [1.0, 0.0, 0.0]
