"""Modules that moved in issue 45's layout keep their documented old paths: each old path is the very module of
its new home (so attributes, monkeypatching and ``isinstance`` all agree), and the documented
``python -m rlhforge.agents.env_verifiers`` still runs the command."""

import importlib
import subprocess
import sys

import pytest

MOVED = {
    "rlhforge.agents.multi_turn": "rlhforge.agents.openrlhf.multi_turn",
    "rlhforge.agents.openai_server": "rlhforge.agents.serving.chat",
    "rlhforge.agents.builtin_envs": "rlhforge.agents.registry.builtin",
    "rlhforge.agents.env_verifiers": "rlhforge.agents.envs.verifiers",
    "rlhforge.rewards.endpoints": "rlhforge.net.endpoints",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_the_old_path_is_the_new_module(old):
    new = importlib.import_module(MOVED[old])
    moved = importlib.import_module(old)
    if old == "rlhforge.rewards.endpoints":  # a re-export module: the same objects
        assert all(getattr(moved, n) is getattr(new, n) for n in ("EndpointsFile", "EndpointSelector"))
    else:
        assert moved is new


def test_the_documented_public_names_are_the_same_objects():
    from rlhforge import agents
    from rlhforge.agents.multi_turn import AgentInstanceBase, MultiTurnAgentExecutor
    from rlhforge.agents.openai_server import ChatServer
    from rlhforge.agents.serving.chat import ChatServer as moved_chat
    from rlhforge.agents.builtin_envs import configure_sandbox
    from rlhforge.agents.registry.builtin import configure_sandbox as moved_configure

    assert agents.AgentInstanceBase is AgentInstanceBase and agents.MultiTurnAgentExecutor is MultiTurnAgentExecutor
    assert ChatServer is moved_chat and configure_sandbox is moved_configure
    assert agents.chat_feedback is importlib.import_module("rlhforge.data.templates").chat_feedback


def test_python_m_env_verifiers_still_runs(tmp_path):
    """The older documented command writes the same prompt records as the module's new path."""
    from pathlib import Path

    taskset = Path(__file__).resolve().parents[1] / "examples" / "agents" / "vf_digits_taskset.py"
    for module, out in (("rlhforge.agents.env_verifiers", "old.jsonl"), ("rlhforge.agents.envs.verifiers", "new.jsonl")):
        proc = subprocess.run([sys.executable, "-m", module, str(taskset), str(tmp_path / out)], capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
    old, new = (tmp_path / "old.jsonl").read_text(), (tmp_path / "new.jsonl").read_text()
    assert old == new and old.count("\n") > 0
