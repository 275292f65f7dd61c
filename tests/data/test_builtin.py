"""Built-in tasks: deterministic, disjoint splits, verifiable answers."""

from __future__ import annotations

import pytest

from rlhforge.data.builtin import check_answer, generate_builtin, parse_builtin_spec
from rlhforge.data.errors import DataError


def test_arithmetic_records():
    records = generate_builtin("arithmetic", n=200, seed=0)
    assert records == generate_builtin("arithmetic", n=200, seed=0)
    assert records != generate_builtin("arithmetic", n=200, seed=1)
    for r in records:
        a, op, b = r["prompt"].removeprefix("What is ").removesuffix("?").split()
        assert op in "+-" and 0 <= int(a) <= 20 and 0 <= int(b) <= 20
        assert r["answer"] == r["completion"] == str(int(a) + int(b) if op == "+" else int(a) - int(b))
        assert r["datasource"] == "arithmetic"
        assert r["messages"] == [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["answer"]}]
    assert len({r["prompt"] for r in records}) == 200  # no repeats while the pool lasts


@pytest.mark.parametrize("name", ["arithmetic", "reverse"])
def test_train_and_test_are_disjoint(name):
    train = {r["prompt"] for r in generate_builtin(name, "train", n=3000, seed=5)}
    test = {r["prompt"] for r in generate_builtin(name, "test", n=300, seed=5)}
    assert test and not train & test


def test_small_pool_repeats_evenly():
    records = generate_builtin("arithmetic", "test", n=500, max=3)  # tiny pool
    prompts = [r["prompt"] for r in records]
    counts = {p: prompts.count(p) for p in set(prompts)}
    assert max(counts.values()) - min(counts.values()) <= 1


def test_reverse_and_check_answer():
    r = generate_builtin("reverse", n=1, seed=0)[0]
    word = r["prompt"].split(": ")[1]
    assert r["answer"] == word[::-1] and 3 <= len(word) <= 5
    assert check_answer("reverse", f" {word[::-1]}<|im_end|>", r["answer"]) == 1.0
    assert check_answer("reverse", word + "x", r["answer"]) == 0.0
    assert check_answer("arithmetic", "19", "19") == 1.0
    assert check_answer("arithmetic", " -3<|im_end|>", "-3") == 1.0
    assert check_answer("arithmetic", "18 or 19", "19") == 0.0
    assert check_answer("arithmetic", "no idea", "19") == 0.0
    with pytest.raises(DataError, match=r"unknown built-in dataset .sudoku.; available: .*arithmetic.*reverse"):
        check_answer("sudoku", "1", "1")


def test_parse_spec():
    s = parse_builtin_spec("builtin:arithmetic?n=100&seed=3@test")
    assert (s.name, s.split, s.params) == ("arithmetic", "test", {"n": 100, "seed": 3})
    assert parse_builtin_spec("builtin:reverse@eval?n=7").params == {"n": 7}
    with pytest.raises(DataError, match="unknown parameter 'x'"):
        parse_builtin_spec("builtin:arithmetic?x=1")
    with pytest.raises(DataError, match="must be an integer"):
        parse_builtin_spec("builtin:arithmetic?n=lots")
    with pytest.raises(DataError, match="unknown split 'dev'"):
        generate_builtin("arithmetic", "dev")
