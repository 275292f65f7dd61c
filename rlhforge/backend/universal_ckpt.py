"""DeepSpeed universal checkpoints (``--ds.use_universal_ckpt``): resume a ZeRO run on a different
number of ranks.

A resume checkpoint is saved as always (``<step_N>/deepspeed/``: one optimizer shard per rank).
When the flag is on and the run that loads it has a different data-parallel world size than the
one that saved it, rank 0 converts the shards once with DeepSpeed's own converter
(``deepspeed.checkpoint.ds_to_universal``) into ``<step_N>/deepspeed_universal/`` (written under a
temporary name and renamed when complete, so an interrupted conversion leaves nothing half-made),
and every rank loads that folder with DeepSpeed's ``load_universal`` path, which re-partitions the
fp32 master weights and the Adam moments for the new world size. A later resume reuses the folder.

OpenRLHF only *loads* universal checkpoints (``checkpoint.load_universal`` in its DeepSpeed config);
its users run ``ds_to_universal.py`` by hand first. Here the conversion is automatic and only done
when the world size changed; with an unchanged world size the native shards are loaded as before.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shutil
from pathlib import Path

NATIVE_TAG = "deepspeed"
UNIVERSAL_TAG = "deepspeed_universal"
_OPTIM_SHARD = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


def saved_dp_world_size(tag_dir: str | Path) -> int | None:
    """How many data-parallel ranks wrote the ZeRO shards in ``tag_dir`` (None: no ZeRO shards,
    i.e. ZeRO-0, whose single optimizer state loads on any world size)."""
    ranks = {int(m.group(1)) for f in os.listdir(tag_dir) if (m := _OPTIM_SHARD.match(f))}
    return max(ranks) + 1 if ranks else None


def needs_universal(step_dir: str | Path, world_size: int) -> bool:
    """Whether loading ``step_dir`` on ``world_size`` ranks needs the universal format."""
    saved = saved_dp_world_size(Path(step_dir) / NATIVE_TAG)
    return saved is not None and saved != world_size


def convert_to_universal(step_dir: str | Path) -> Path:
    """Convert ``<step_dir>/deepspeed`` into ``<step_dir>/deepspeed_universal`` (once; rank 0 only;
    atomic: a temporary folder renamed when complete). Returns the universal folder. The converter's
    console output is kept in ``convert.log`` inside it."""
    step_dir = Path(step_dir)
    final = step_dir / UNIVERSAL_TAG
    if final.is_dir():
        return final
    from deepspeed.checkpoint import ds_to_universal

    tmp = step_dir / f"{UNIVERSAL_TAG}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    args = argparse.Namespace(input_folder=str(step_dir / NATIVE_TAG), output_folder=str(tmp),
                              num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False,
                              strict=True, inject_missing_state=True)
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            ds_to_universal.main(args)
        (tmp / "convert.log").write_text(log.getvalue())
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        # the converter names its output in <step_dir>/latest_universal; we always pass the tag
        (step_dir / "latest_universal").unlink(missing_ok=True)
    return final


def load_tag(step_dir: str | Path, world_size: int, is_rank0: bool, barrier) -> str:
    """The DeepSpeed tag to load from ``step_dir`` on ``world_size`` ranks: the native one, or
    (converted first by rank 0 while the others wait at ``barrier()``) the universal one."""
    if not needs_universal(step_dir, world_size):
        return NATIVE_TAG
    failure = None
    if is_rank0:
        try:
            convert_to_universal(step_dir)
        except Exception as err:  # the other ranks must not wait for ever: they find no folder and raise
            failure = err
    barrier()
    if failure is not None:
        raise failure
    if not (Path(step_dir) / UNIVERSAL_TAG).is_dir():
        raise FileNotFoundError(f"{step_dir}/{UNIVERSAL_TAG}: the universal conversion did not complete on rank 0")
    return UNIVERSAL_TAG
