"""Pure tensor maths for RL and preference optimisation (no I/O, no config, no distributed state)."""
