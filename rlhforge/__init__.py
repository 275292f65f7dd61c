"""rlhforge: RLHF and RL training for language models, from a CPU laptop to a GPU cluster."""

__version__ = "0.1.0"
