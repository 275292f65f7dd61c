"""Moved to :mod:`rlhforge.agents.registry.builtin` (issue 45's layout); this old path is the same module (kept for documented imports)."""

import sys

from rlhforge.agents.registry.builtin import *  # noqa: F401,F403 (what linters see; the module below is the real one)
import rlhforge.agents.registry.builtin as _moved

sys.modules[__name__] = _moved
