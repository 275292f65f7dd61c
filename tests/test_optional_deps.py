"""The optional-dependency rule of tests/conftest.py: a broken vLLM skips locally and fails in CI.

Runs pytest in a subprocess on the real tests/rl/test_vllm_engine.py (collection plus its first
test) with a deliberately broken ``vllm`` package first on the path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pytest(tmp_path, env_extra: dict[str, str], target: str) -> subprocess.CompletedProcess:
    broken = tmp_path / "broken"
    (broken / "vllm").mkdir(parents=True, exist_ok=True)
    (broken / "vllm" / "__init__.py").write_text("raise ImportError('deliberately broken vllm for this test')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "RLHFORGE_WITH_VLLM", "PYTEST_ADDOPTS")}
    env.update(env_extra)
    env["PYTHONPATH"] = os.pathsep.join([str(broken), str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", target],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


TARGET = "tests/rl/test_vllm_engine.py::test_stop_tokens_and_finish_reasons"


@pytest.mark.parametrize("env, outcome", [
    ({}, "1 skipped"),
    ({"CI": "false"}, "1 skipped"),
    ({"CI": "true"}, "1 error"),
    ({"RLHFORGE_WITH_VLLM": "1"}, "1 error"),
])
def test_broken_vllm_skips_locally_and_fails_in_ci(tmp_path, env, outcome):
    res = _pytest(tmp_path, env, TARGET)
    out = res.stdout + res.stderr
    assert outcome in out, out[-3000:]
    assert "deliberately broken vllm" in out
    assert (res.returncode == 0) == (outcome == "1 skipped"), out[-3000:]
    if outcome == "1 error":
        assert "so this test must run, not skip" in out
