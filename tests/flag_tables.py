"""OpenRLHF's flag tables for the compatibility tests: tests/reference/openrlhf_0_11_2_flags.json, the
repository's own copy of OpenRLHF 0.11.2's flags (written by tests/reference/extract.py)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from rlhforge.config.parsing import ConfigError

OPENRLHF_FLAGS = Path(__file__).parent / "reference" / "openrlhf_0_11_2_flags.json"


@functools.cache
def _flag_tables() -> dict[str, list[list[str]]]:
    data = json.loads(OPENRLHF_FLAGS.read_text())
    assert data["columns"] == ["flag", "type", "default", "choices", "nargs"] and data["openrlhf_version"] == "0.11.2"
    return data["commands"]


def openrlhf_flag_rows(command: str) -> list[list[str]]:
    """(flag, type/action, default, choices, nargs) rows of one command's table in OpenRLHF 0.11.2."""
    return [list(row) for row in _flag_tables()[command]]


def openrlhf_flags(command: str) -> list[tuple[str, str, str]]:
    """(flag, type/action, choices) of one command."""
    return [(r[0], r[1], r[3]) for r in openrlhf_flag_rows(command)]


def check_every_flag(cls, command: str, count: int, base: list[str], values: dict) -> None:
    """All flags of ``command`` go through the real command-line parser together; then each one alone
    (as a config key) either validates or fails with a message naming it. (One tyro parse: building
    the parser costs ~0.2 s, too slow to repeat per flag on a 2-core machine.)"""
    import tyro
    import yaml

    from rlhforge.config.parsing import from_dict, rewrite_aliases

    rows = [r for r in openrlhf_flags(command) if r[0] not in base]
    assert len(rows) + len(base) // 2 == count
    argv, single = list(base), []
    for flag, kind, choices in rows:
        if flag in values:
            vals = values[flag]
        elif choices:
            vals = [choices.strip("[]").split(",")[0].strip().strip("'")]
        elif kind in ("store_true", "store_false"):
            vals = []
        else:
            vals = {"int": ["2"], "float": ["0.25"], "str": ["x"]}[kind]
        argv += [flag, *vals]
        (name,) = rewrite_aliases([flag], warn=lambda _msg: None)
        key = name[2:]
        if kind in ("store_true", "store_false"):
            leaf = key.rsplit(".", 1)[-1]
            value = kind == "store_true"
            if leaf.startswith("no_"):  # --muon.no_nesterov -> nesterov: false
                key, value = key.replace(leaf, leaf[3:]), False
        else:
            parsed = [yaml.safe_load(v) for v in vals]
            value = parsed if len(parsed) > 1 else parsed[0]
        single.append((flag, key, value))
    try:
        tyro.cli(cls, args=rewrite_aliases(argv, warn=lambda _msg: None), default=cls(), use_underscores=True)
    except SystemExit as err:
        raise AssertionError(f"the parser rejected one of the {command} flags: {argv}") from err
    base_keys = {base[i][2:]: base[i + 1] for i in range(0, len(base), 2)}
    for flag, key, value in single:
        try:
            from_dict(cls, {**base_keys, key: value}).validate()
        except ConfigError as err:  # a validation message naming the flag (e.g. "not supported yet")
            assert flag.split(".")[-1].lstrip("-") in str(err), (flag, err)


# --------------------------------------------------------------------------------------------- from the dataclasses


def dataclass_flags(cls, prefix: str = "") -> dict[str, tuple[object, object]]:
    """Every accepted dotted flag of config class ``cls`` (as tyro derives them): ``{"--a.b": (type, default)}``."""
    import dataclasses
    import typing

    out: dict[str, tuple[object, object]] = {}
    hints = typing.get_type_hints(cls)
    default = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        sub = [a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)]
        if sub:
            out.update(dataclass_flags(sub[0], f"{prefix}{f.name}."))
        else:
            out[f"--{prefix}{f.name}"] = (tp, getattr(default, f.name))
    return out


def non_default_value(tp, default) -> tuple[list[str], object] | None:
    """A value different from ``default`` that fits ``tp``: (argv tokens after the flag, Python value);
    None when the type has no other value (a one-choice Literal)."""
    import math
    import typing

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is not None and type(None) in args and origin is not typing.Literal:
        tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is bool:
        return ([] if not default else None), not default  # [] = the switch alone; None = "--no_" form
    if origin is typing.Literal:
        other = [c for c in args if c != default]
        return ([str(other[0])], other[0]) if other else None
    if tp is int:
        value = default * 2 if isinstance(default, int) and default > 0 else 2
        return [str(value)], value
    if tp is float:
        value = 0.25 if not default else (10.0 if not math.isfinite(default) else default * 0.5)
        return [repr(value)], value
    if tp is str:
        return ["x"], "x"
    if origin is tuple:
        if args == (str, Ellipsis):
            return ["q_proj"], ("q_proj",)
        if args == (float, Ellipsis):
            return ["0.3"], (0.3,)
        return ["0.1", "0.2"], (0.1, 0.2)
    raise AssertionError(f"no value rule for {tp}")


def flag_argv(flag: str, tokens: list[str] | None) -> list[str]:
    """``--a.b`` + value tokens; ``None`` tokens: a default-True switch turned off (``--a.no_b``)."""
    if tokens is None:
        section, _, leaf = flag.rpartition(".")
        return [f"{section}.no_{leaf}" if section else f"--no_{leaf[2:]}"]
    return [flag, *tokens]


def refused_line(main, argv, capsys) -> str:
    """Run a command's ``main(argv)``; assert exit 2 with exactly one error line and no traceback; return it."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, (exc.value.code, err)
    lines = [x for x in err.splitlines() if ": error:" in x]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "model folder not found" not in err, err
    return lines[0]
