"""Issue 30, bug 6: with LoRA and a colocated engine (CUDA IPC), every actor rank sends each bucket, so
every rank must stream the same merged weights. The old stream was the merged state dict on rank 0 and
nothing elsewhere: rank 0 sent N buckets, the others one empty bucket, and the sync deadlocked at 2+
ranks. Checked on CPU with 2 ZeRO-3 ranks (gloo): the stream, its buckets and its fingerprint agree
across ranks and with the merged full state dict."""

import json
from pathlib import Path

from tests.torchrun import run_worker

WORKER = Path(__file__).with_name("lora_stream_worker.py")


def test_every_rank_streams_the_same_merged_lora_weights(tiny_model_dir, tmp_path):
    out = tmp_path / "out.json"
    proc = run_worker(WORKER, 2, tiny_model_dir, out)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    res = json.loads(out.read_text())
    r0, r1 = res["ranks"]
    assert r0["layout"] and r0["layout"] == r1["layout"]
    assert len(r0["buckets"]) > 1 and r0["buckets"] == r1["buckets"]  # the same buckets, in the same order
    assert r0["fingerprint"] == r1["fingerprint"] == res["full_fingerprint"]  # = the merged state dict
    names = [n for n, _, _ in r0["layout"]]
    assert sorted(names) == res["full_names"]
    assert not any(".lora_" in n or "base_layer" in n or n.startswith("base_model") for n in names)
