"""Worker groups (in-process and Ray actors), placement and colocation, the engine actors, the local Ray cluster.

Nothing here imports ray at module level: the in-process path runs without it.
"""
