"""RL tests: tiny models, single-threaded torch (much faster than 2 threads on a shared 2-core box)."""

import torch

torch.set_num_threads(1)
