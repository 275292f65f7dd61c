"""Deterministic built-in tasks with verifiable answers, addressable as ``builtin:NAME``.

Nothing can be downloaded here, so the project ships small generated tasks that a tiny model can
learn in minutes on a CPU and that an RL reward can check exactly:

``arithmetic``
    ``"What is 12 + 7?"`` -> ``"19"``; operands ``0..max`` (default ``max=20``), operators ``+`` and
    ``-`` (results may be negative).
``reverse``
    ``"Reverse the letters: abcd"`` -> ``"dcba"``; strings of ``min_len..max_len`` (default 3..5)
    letters from the first ``letters`` (default 6) letters of the alphabet.
``larger``
    ``"Which is larger: (12,7)?"`` -> ``"12"``; two different integers in ``0..max`` (default
    ``max=49``), written without spaces so each number is the same token in prompt and answer.
    Guessing one of the two is right half the time, so sampled groups have mixed rewards from the
    start: the quickstart's RL task.

Every record has the same fields, so one dataset serves SFT (``prompt``/``completion`` or
``messages``), RL (``prompt`` + label ``answer``) and reward routing (``datasource``)::

    {"prompt": "What is 12 + 7?", "completion": "19", "answer": "19", "datasource": "arithmetic",
     "messages": [{"role": "user", "content": "What is 12 + 7?"},
                  {"role": "assistant", "content": "19"}]}

Spec syntax (see :func:`parse_builtin_spec`): ``builtin:NAME``, ``builtin:NAME@test``,
``builtin:NAME?n=2000&seed=3``, ``builtin:NAME?n=100@test`` (query and ``@split`` in either
order). Parameters: ``n`` (records, default 1000), ``seed`` (default 0) and the task's own
(``max`` for arithmetic and larger; ``letters``, ``min_len``, ``max_len`` for reverse).

Train and test are disjoint by construction: every task enumerates its finite pool of distinct
problems, and a problem belongs to the test pool iff ``crc32(problem key) % 10 == 0`` (about 10%).
This does not depend on ``seed``, so any train seed and any test seed never share a problem. The
seed only shuffles the pool. When ``n`` exceeds the pool, the shuffled pool is repeated (each
problem appears ``n // len(pool)`` or one more times), so small pools still give ``n`` records.
Accepted split names: ``train``; ``test`` (aliases ``eval``, ``validation``, ``val``).

:func:`check_answer` is the matching verifier for RL rewards.
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass
from typing import Callable
from urllib.parse import parse_qsl

from rlhforge.data.errors import DataError

__all__ = [
    "BUILTIN_TASKS",
    "BuiltinSpec",
    "builtin_spec",
    "check_answer",
    "verifiable_tasks",
    "generate_builtin",
    "parse_builtin_spec",
]

TRAIN_SPLITS = ("train",)
TEST_SPLITS = ("test", "eval", "validation", "val")
DEFAULT_N = 1000


@dataclass(frozen=True)
class _Task:
    """A task: its problem pool, how to phrase a problem, and how to check an answer."""

    pool: Callable[[dict], list[tuple]]
    """params -> list of problems in a canonical order (tuples; ``repr`` is the split key)."""
    render: Callable[[tuple], tuple[str, str]]
    """problem -> (prompt, answer)."""
    check: Callable[[str, str], float]
    """(completion, answer) -> reward in [0, 1]."""
    defaults: dict


def _arith_pool(p: dict) -> list[tuple]:
    hi = p["max"]
    return [(a, op, b) for a in range(hi + 1) for op in "+-" for b in range(hi + 1)]


def _arith_render(problem: tuple) -> tuple[str, str]:
    a, op, b = problem
    value = a + b if op == "+" else a - b
    return f"What is {a} {op} {b}?", str(value)


_INT = re.compile(r"-?\d+")


def _arith_check(completion: str, answer: str) -> float:
    """1.0 iff the first integer in the completion equals the answer."""
    match = _INT.search(completion)
    if match is None:
        return 0.0
    try:
        return float(int(match.group()) == int(str(answer).strip()))
    except ValueError:
        return 0.0


def _reverse_pool(p: dict) -> list[tuple]:
    alphabet = "abcdefghijklmnopqrstuvwxyz"[: p["letters"]]
    out: list[tuple] = []

    def rec(prefix: str, k: int):
        if k == 0:
            out.append((prefix,))
            return
        for ch in alphabet:
            rec(prefix + ch, k - 1)

    for length in range(p["min_len"], p["max_len"] + 1):
        rec("", length)
    return out


def _reverse_render(problem: tuple) -> tuple[str, str]:
    (word,) = problem
    return f"Reverse the letters: {word}", word[::-1]


_WORD = re.compile(r"[A-Za-z]+")


def _reverse_check(completion: str, answer: str) -> float:
    """1.0 iff the first run of letters in the completion equals the answer."""
    match = _WORD.search(completion)
    return float(match is not None and match.group() == str(answer).strip())


def _larger_pool(p: dict) -> list[tuple]:
    hi = p["max"]
    return [(a, b) for a in range(hi + 1) for b in range(hi + 1) if a != b]


def _larger_render(problem: tuple) -> tuple[str, str]:
    a, b = problem
    return f"Which is larger: ({a},{b})?", str(max(a, b))


def _larger_check(completion: str, answer: str) -> float:
    """1.0 iff the completion holds exactly one integer and it equals the answer (no hedging)."""
    found = _INT.findall(completion)
    try:
        return float(len(found) == 1 and int(found[0]) == int(str(answer).strip()))
    except ValueError:
        return 0.0


BUILTIN_TASKS: dict[str, _Task] = {
    "arithmetic": _Task(_arith_pool, _arith_render, _arith_check, {"max": 20}),
    "reverse": _Task(_reverse_pool, _reverse_render, _reverse_check, {"letters": 6, "min_len": 3, "max_len": 5}),
    "larger": _Task(_larger_pool, _larger_render, _larger_check, {"max": 49}),
}


def _unknown(name: str) -> DataError:
    names = sorted([*BUILTIN_TASKS, *_extra_generators()])
    return DataError(f"unknown built-in dataset {name!r}; available: {', '.join(names)}")


# Generators that other modules register (records of another shape, e.g. preference pairs in
# rlhforge.data.builtin_preference). They share the spec syntax: ``builtin:NAME?n=..&seed=..@split``.


@dataclass(frozen=True)
class ExtraGenerator:
    """``generate(split=, n=, seed=, **params) -> list[dict]`` and its integer parameters' defaults."""

    generate: Callable[..., list[dict]]
    defaults: dict
    check: Callable[[str, str], float] | None = None
    """``(completion, answer) -> reward`` when the records have verifiable answers (``builtin:NAME`` reward)."""


_EXTRA_GENERATORS: dict[str, ExtraGenerator] = {}
#: modules imported on first lookup; each calls :func:`register_builtin` for its generators
_PLUGIN_MODULES = ("rlhforge.data.builtin_preference", "rlhforge.data.builtin_vlm")
_plugins_loaded = False


def register_builtin(name: str, generate: Callable[..., list[dict]], defaults: dict | None = None,
                     check: Callable[[str, str], float] | None = None) -> None:
    """Make ``builtin:NAME`` produce ``generate(split=..., n=..., seed=..., **params)`` (and, with
    ``check``, the reward ``builtin:NAME``)."""
    if name in BUILTIN_TASKS:
        raise ValueError(f"built-in dataset {name!r} already exists")
    _EXTRA_GENERATORS[name] = ExtraGenerator(generate, dict(defaults or {}), check)


def verifiable_tasks() -> list[str]:
    """Names with an answer check (``check_answer`` / the ``builtin:NAME`` reward)."""
    return sorted([*BUILTIN_TASKS, *(k for k, g in _extra_generators().items() if g.check is not None)])


def _extra_generators() -> dict[str, ExtraGenerator]:
    global _plugins_loaded
    if not _plugins_loaded:
        _plugins_loaded = True
        import importlib

        for module in _PLUGIN_MODULES:
            importlib.import_module(module)
    return _EXTRA_GENERATORS


@dataclass(frozen=True)
class BuiltinSpec:
    name: str
    split: str | None
    params: dict


_SPEC = re.compile(r"^builtin:(?P<name>[A-Za-z0-9_\-]+)(?P<rest>.*)$")


def builtin_spec(name: str, split: str, n: int, seed: int = 0, params: str = "") -> str:
    """``builtin:NAME?n=N&seed=S[&PARAMS]@SPLIT``: the spec :func:`parse_builtin_spec` reads (``params``:
    ``&``-separated ``k=v`` pairs)."""
    return f"builtin:{name}?n={n}&seed={seed}{'&' + params if params else ''}@{split}"


def parse_builtin_spec(spec: str) -> BuiltinSpec:
    """``builtin:NAME[?k=v&...][@split]`` (query and split in either order) -> :class:`BuiltinSpec`.

    ``split`` is ``None`` when the spec has no ``@split``. Parameter values must be integers.
    """
    m = _SPEC.match(spec.strip())
    if not m:
        raise DataError(f"cannot parse built-in dataset spec {spec!r}; expected builtin:NAME[?n=1000&seed=0][@split]")
    name, rest = m.group("name"), m.group("rest")
    if name not in BUILTIN_TASKS and name not in _extra_generators():
        raise _unknown(name)
    split = None
    query = ""
    for part in re.findall(r"[?@][^?@]*", rest):
        if part.startswith("@"):
            split = part[1:]
        else:
            query = part[1:]
    if re.sub(r"[?@][^?@]*", "", rest):
        raise DataError(f"cannot parse built-in dataset spec {spec!r}; expected builtin:NAME[?n=1000&seed=0][@split]")
    params = {}
    defaults = BUILTIN_TASKS[name].defaults if name in BUILTIN_TASKS else _extra_generators()[name].defaults
    allowed = {"n", "seed", *defaults}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key not in allowed:
            raise DataError(
                f"{spec}: unknown parameter {key!r} for builtin:{name}; allowed: {', '.join(sorted(allowed))}"
            )
        try:
            params[key] = int(value)
        except ValueError:
            raise DataError(f"{spec}: parameter {key}={value!r} must be an integer") from None
    return BuiltinSpec(name, split, params)


def _in_test_pool(problem: tuple) -> bool:
    return zlib.crc32(repr(problem).encode()) % 10 == 0


def generate_builtin(name: str, split: str = "train", n: int | None = None, seed: int = 0, **params) -> list[dict]:
    """Records of built-in task ``name`` for ``split`` (``train`` or ``test``); deterministic."""
    if name not in BUILTIN_TASKS:
        extra = _extra_generators().get(name)
        if extra is None:
            raise _unknown(name)
        unknown = set(params) - set(extra.defaults)
        if unknown:
            raise DataError(
                f"builtin:{name}: unknown parameter(s) {sorted(unknown)}; allowed: n, seed, {', '.join(sorted(extra.defaults))}"
            )
        return extra.generate(split=split, n=DEFAULT_N if n is None else n, seed=seed, **{**extra.defaults, **params})
    task = BUILTIN_TASKS[name]
    unknown = set(params) - set(task.defaults)
    if unknown:
        raise DataError(
            f"builtin:{name}: unknown parameter(s) {sorted(unknown)}; "
            f"allowed: n, seed, {', '.join(sorted(task.defaults))}"
        )
    p = {**task.defaults, **params}
    n = DEFAULT_N if n is None else n
    if n < 1:
        raise DataError(f"builtin:{name}: n must be >= 1 (got {n})")
    if split in TRAIN_SPLITS:
        want_test, offset = False, 0
    elif split in TEST_SPLITS:
        want_test, offset = True, 1_000_003
    else:
        raise DataError(
            f"builtin:{name}: unknown split {split!r}; use 'train' or 'test' (aliases: eval, validation, val)"
        )
    try:
        pool = [q for q in task.pool(p) if _in_test_pool(q) == want_test]
    except (ValueError, TypeError) as err:
        raise DataError(f"builtin:{name}: bad parameters {p}: {err}") from None
    if not pool:
        raise DataError(f"builtin:{name}: parameters {p} leave no problems in the {split!r} split")
    rng = random.Random(seed + offset)
    problems: list[tuple] = []
    while len(problems) < n:
        order = pool[:]
        rng.shuffle(order)
        problems.extend(order[: n - len(problems)])
    records = []
    for problem in problems:
        prompt, answer = task.render(problem)
        records.append(
            {
                "prompt": prompt,
                "completion": answer,
                "answer": answer,
                "datasource": name,
                "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}],
            }
        )
    return records


def check_answer(task: str, completion: str, answer: str) -> float:
    """Reward in ``[0, 1]`` for a model ``completion`` of built-in ``task`` against ``answer``.

    ``arithmetic``: 1.0 iff the first integer in the completion equals the answer
    (``"19"``, ``" 19<|im_end|>"`` and ``"19 is it"`` score 1; ``"18 or 19"`` scores 0).
    ``reverse``: 1.0 iff the first run of letters equals the answer.
    ``larger``: 1.0 iff the completion holds exactly one integer, the answer (``"12"`` and
    ``" 12<|im_end|>"`` score 1; ``"12 or 7"`` scores 0).
    """
    if task not in BUILTIN_TASKS:
        extra = _extra_generators().get(task)
        if extra is None or extra.check is None:
            raise _unknown(task)
        return extra.check(str(completion), str(answer))
    return BUILTIN_TASKS[task].check(str(completion), str(answer))
