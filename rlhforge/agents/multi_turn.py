"""Moved to :mod:`rlhforge.agents.openrlhf.multi_turn` (issue 45's layout); this old path is the same module (kept for documented imports)."""

import sys

from rlhforge.agents.openrlhf.multi_turn import *  # noqa: F401,F403 (what linters see; the module below is the real one)
import rlhforge.agents.openrlhf.multi_turn as _moved

sys.modules[__name__] = _moved
