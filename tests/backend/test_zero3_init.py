"""Issue 30, bug 10: under ZeRO-3 every rank loaded the whole fp32 model before ``prepare`` sharded it.
Inside ``strategy.model_init()`` transformers builds it in ``deepspeed.zero.Init``: each of 2 ranks holds
half the parameters from the start, and the prepared weights are the checkpoint's, bit for bit."""

import json
from pathlib import Path

from tests.torchrun import run_worker

WORKER = Path(__file__).with_name("zero3_init_worker.py")


def test_zero3_loads_partitioned_and_exactly(tiny_model_dir, tmp_path):
    out = tmp_path / "out.json"
    proc = run_worker(WORKER, 2, tiny_model_dir, out)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r0, r1 = json.loads(out.read_text())
    for r in (r0, r1):
        assert r["inside"] and not r["after"]  # zero.Init while loading, whole models again afterwards
        assert r["local_numel"] == 0  # placeholders only: nothing whole on any rank
        assert r["full_numel"] == r["whole_numel"] > 0
        assert r["shard_numel"] * 2 >= r["full_numel"] and r["shard_numel"] < 0.6 * r["full_numel"]  # about half
        assert r["ckpt_equal"] and r["fingerprint"] == r["whole_fingerprint"]
