"""Let OpenRLHF users' agent and reward files import ``openrlhf`` names while rlhforge loads them.

An OpenRLHF agent file starts with ``from openrlhf.utils.agent import AgentInstanceBase,
MultiTurnAgentExecutor`` and its math reward file with ``from openrlhf.utils import
extract_boxed_answer, grade_answer``. While rlhforge imports such a file
(``--train.agent_func_path``, ``--reward.remote_url file.py``), :func:`openrlhf_alias` answers
these imports with rlhforge's objects:

==============================  =================================================================
``openrlhf.utils.agent``        ``AgentExecutorBase``, ``AgentInstanceBase``,
                                ``MultiTurnAgentExecutor`` (:mod:`rlhforge.agents.openrlhf.multi_turn`)
``openrlhf.utils``              ``extract_boxed_answer(text)``, ``grade_answer(given, truth)``
                                (:mod:`rlhforge.rewards.math`, needs math-verify)
==============================  =================================================================

The alias is a meta-path finder that exists only during that import, and only when no real
``openrlhf`` package can be found (an installed OpenRLHF is never shadowed: its own classes are
then imported, and the loader says so if they are not rlhforge's). The ``openrlhf*`` modules it
created are removed from ``sys.modules`` afterwards, so imports of ``openrlhf`` names must happen
at the top of the file (at import time), as they do in OpenRLHF's examples.

This module sits outside the layers: it imports nothing from rlhforge until a user file asks for
one of the names above.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
import types
from typing import Iterator

__all__ = ["openrlhf_alias", "alias_hint", "ALIASED"]

# module name -> {attribute: "module:object"}: a name table (like entry points), resolved only when a
# user file imports the alias module, so this module depends on no layer
ALIASED: dict[str, dict[str, str]] = {
    "openrlhf": {},
    "openrlhf.utils": {
        "extract_boxed_answer": "rlhforge.rewards.math:extract_boxed_answer",
        "grade_answer": "rlhforge.rewards.math:grade_answer",
    },
    "openrlhf.utils.agent": {
        "AgentExecutorBase": "rlhforge.agents.openrlhf.multi_turn:AgentExecutorBase",
        "AgentInstanceBase": "rlhforge.agents.openrlhf.multi_turn:AgentInstanceBase",
        "MultiTurnAgentExecutor": "rlhforge.agents.openrlhf.multi_turn:MultiTurnAgentExecutor",
    },
}
_PACKAGES = {"openrlhf", "openrlhf.utils"}
_LOCK = threading.RLock()


def alias_hint(err: BaseException) -> str:
    """For an ImportError raised inside the alias: which ``openrlhf`` names rlhforge provides."""
    name = getattr(err, "name", None) or ""
    if not isinstance(err, ImportError) or not (name == "openrlhf" or name.startswith("openrlhf.")):
        return ""
    if _real_openrlhf_installed():
        return ""
    offered = "; ".join(f"{m}: {', '.join(sorted(a))}" for m, a in ALIASED.items() if a)
    return (f" (no openrlhf is installed; while loading this file rlhforge provides only {offered}; "
            "see docs/agents.md, 'OpenRLHF files')")


class _AliasLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        name = module.__name__
        for attr, target in ALIASED[name].items():
            mod, obj = target.split(":")
            setattr(module, attr, getattr(importlib.import_module(mod), obj))
        module.__doc__ = f"rlhforge's stand-in for {name} (rlhforge/openrlhf_alias.py)"


class _AliasFinder(importlib.abc.MetaPathFinder):
    loader = _AliasLoader()

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in ALIASED:
            return None
        spec = importlib.machinery.ModuleSpec(fullname, self.loader, is_package=fullname in _PACKAGES)
        if fullname in _PACKAGES:
            spec.submodule_search_locations = []
        return spec


def _real_openrlhf_installed() -> bool:
    """``importlib.util.find_spec("openrlhf")`` ignoring this alias."""
    mod = sys.modules.get("openrlhf")
    if mod is not None:
        return not isinstance(getattr(getattr(mod, "__spec__", None), "loader", None), _AliasLoader)
    return any(not isinstance(f, _AliasFinder) and getattr(f, "find_spec", None) and f.find_spec("openrlhf", None)
               for f in sys.meta_path)


@contextlib.contextmanager
def openrlhf_alias() -> Iterator[bool]:
    """While active, ``import openrlhf.utils.agent`` (etc.) gives rlhforge's objects, unless a real
    ``openrlhf`` is installed. Yields whether the alias is active. Re-entrant."""
    with _LOCK:
        if _real_openrlhf_installed() or any(isinstance(f, _AliasFinder) for f in sys.meta_path):
            yield not _real_openrlhf_installed()
            return
        before = {name for name in sys.modules if name == "openrlhf" or name.startswith("openrlhf.")}
        finder = _AliasFinder()
        sys.meta_path.append(finder)
        try:
            yield True
        finally:
            sys.meta_path.remove(finder)
            for name in [n for n in sys.modules if (n == "openrlhf" or n.startswith("openrlhf.")) and n not in before]:
                del sys.modules[name]
