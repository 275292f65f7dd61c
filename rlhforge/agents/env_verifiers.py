"""Moved to :mod:`rlhforge.agents.envs.verifiers` (issue 45's layout); this old path is the same module, and
``python -m rlhforge.agents.env_verifiers`` (the older documented command) runs its ``main``."""

import sys

import rlhforge.agents.envs.verifiers as _moved

if __name__ == "__main__":
    sys.exit(_moved.main())
sys.modules[__name__] = _moved
