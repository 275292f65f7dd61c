"""Worker groups (in-process and Ray actors), placement, colocation and the async rollout queue.

Nothing here imports ray at module level: the in-process path runs without it.
"""
