"""Writes that fail for real, run in a child process started under ``ulimit -f`` (the largest file
it may write, enforced for root too: a write past it fails with EFBIG, "File too large"; Python
ignores SIGXFSZ). Prints ``RESULT {json}``.

- ``ckpt ROOT``: ``save_checkpoint`` of step 2 with a strategy that writes its state with
  ``torch.save(obj, path)`` as DeepSpeed does (torch then raises its errno-less "unexpected pos").
- ``yaml PATH``: ``save_yaml`` of a default SFT config over an existing ``PATH``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


class PathSavingStrategy:
    rank, world_size, is_rank0 = 0, 1, True

    def barrier(self):
        pass

    def save_state(self, directory: Path) -> None:
        torch.save({"w": torch.zeros(1 << 18)}, Path(directory) / "model_states.pt")  # 1 MiB


def main() -> None:
    mode, target = sys.argv[1], Path(sys.argv[2])
    try:
        if mode == "ckpt":
            from rlhforge.backend.checkpoint import save_checkpoint

            save_checkpoint(PathSavingStrategy(), target, 2, {"global_step": 2})
        else:
            from rlhforge.config.parsing import save_yaml
            from rlhforge.config.sft import SFTConfig

            save_yaml(SFTConfig(), target)
        result = {"error": None}
    except OSError as err:
        result = {"error": type(err).__name__, "errno": err.errno, "message": str(err)}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
