"""Agent executors: turn a prompt into a token trajectory (single-turn now; multi-turn later)."""
