"""The same SFT run under DeepSpeed ZeRO-2 and ZeRO-3 with 2 CPU processes matches one process."""

import os
import sys
from pathlib import Path

import pytest

from rlhforge.cli.train_sft import main as sft_main
from tests.trainers.sft_helpers import losses, sft_args, write_sft_data
from tests.torchrun import run_torchrun

ROOT = Path(__file__).parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("stage, offload", [(2, False), (3, True)], ids=["zero2", "zero3-adam-offload"])
def test_zero_two_processes_match_single_process(tiny_model_dir, tmp_path, stage, offload):
    data = write_sft_data(tmp_path / "train.jsonl", n=24)
    single = tmp_path / "single"
    assert sft_main(sft_args(tiny_model_dir, data, single, "--ds.attn_implementation", "eager")) == 0
    dist = tmp_path / f"zero{stage}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(29600 + stage + os.getpid() % 500), "-m", "rlhforge.cli.train_sft",
           *sft_args(tiny_model_dir, data, dist, "--ds.attn_implementation", "eager", "--ds.strategy", "deepspeed",
                     "--ds.zero_stage", stage, "--train.micro_batch_size", "2", "--ckpt.save_steps", "2",
                     *(["--ds.adam_offload"] if offload else []))]
    proc = run_torchrun(cmd, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    a, b = losses(single), losses(dist)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:  # same data, same global normalisation: the curve matches to float tolerance
        assert b[step] == pytest.approx(a[step], rel=1e-4), step
    assert (dist / "model.safetensors").is_file() and (dist / "ckpts" / "step_2" / "deepspeed").is_dir()
