"""Every shipped example config parses and validates with the command its header names."""

import importlib
import re
from pathlib import Path

import pytest

from rlhforge.cli.main import COMMANDS
from rlhforge.config.parsing import load_yaml

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").rglob("*.yaml"))
HEADER = re.compile(r"(?:rlhforge\s+([\w-]+)|-m\s+rlhforge\.cli\.(\w+)|--module\s+rlhforge\.cli\.(\w+))")


def _config_class(text: str):
    match = HEADER.search(text.splitlines()[0])
    assert match, "the first line must be the launch command (rlhforge CMD ... or -m rlhforge.cli.MODULE ...)"
    command, module = match.group(1), match.group(2) or match.group(3)
    name = COMMANDS[command][0] if command else f"rlhforge.cli.{module}"
    return importlib.import_module(name).CONFIG_CLASS


def test_there_are_examples():
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_parses_and_validates(path, monkeypatch):
    procs = re.search(r"--nproc_per_node\s+(\d+)", path.read_text().splitlines()[0])
    if procs:  # validated as launched: checks that depend on the number of ranks see it
        monkeypatch.setenv("WORLD_SIZE", procs.group(1))
    cls = _config_class(path.read_text())
    cfg = load_yaml(cls, path)
    cfg.validate()
