"""Moved to :mod:`rlhforge.agents.serving.chat` (issue 45's layout); this old path is the same module (kept for documented imports)."""

import sys

from rlhforge.agents.serving.chat import *  # noqa: F401,F403 (what linters see; the module below is the real one)
import rlhforge.agents.serving.chat as _moved

sys.modules[__name__] = _moved
