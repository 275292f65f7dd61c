"""OpenRLHF's flag tables (../shared/reference/openrlhf-cli.md) for the compatibility tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlhforge.config.parsing import ConfigError

REFERENCE = Path(__file__).parents[2] / "shared" / "reference" / "openrlhf-cli.md"


def openrlhf_flag_rows(command: str) -> list[list[str]]:
    """(flag, type/action, default, choices, nargs) rows of one command's table in the 0.11.2 reference."""
    if not REFERENCE.is_file():
        pytest.skip("shared/reference is not beside this checkout")
    text = REFERENCE.read_text().split(f"### {command} (")[1].split("\n### ")[0]
    return [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines() if line.startswith("| --")]


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
