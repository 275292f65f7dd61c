"""Every module of the package imports (CI installs every optional dependency: vLLM's CPU build,
Ray, DeepSpeed), and each module's ``__all__`` names only what it defines: a stale name or a
module that no test imports fails here, not in a user's run."""

import importlib
import pkgutil

import pytest

import rlhforge

MODULES = sorted(m.name for m in pkgutil.walk_packages(rlhforge.__path__, "rlhforge.")
                 if not m.name.endswith("__main__"))


def test_the_walk_finds_the_layers():
    layers = {name.split(".")[1] for name in MODULES}
    assert {"agents", "algorithms", "backend", "cli", "config", "data", "distributed", "models", "rewards",
            "rollout", "tracking", "trainers"} <= layers
    assert len(MODULES) > 150


@pytest.mark.parametrize("name", MODULES)
def test_module_imports_and_exports_what_it_defines(name):
    module = importlib.import_module(name)
    missing = [n for n in getattr(module, "__all__", []) if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names {missing}, which it does not define"
