"""Weight-sync time against model size on CPU: fixed-size buckets vs one transfer per parameter (issue 39, point 3).

    python benchmarks/bench_weight_sync.py [--sizes 1M,10M,50M,150M,350M] [--buckets-mb 1,16,128] [--no-vllm]

**What is measured.** (a) The gloo channel that carries every CPU sync and, with NCCL instead of gloo, every
GPU sync that is not CUDA IPC: actor rank 0's sender (:class:`rlhforge.backend.collective.SyncGroup`, in a
spawned process, as the actor's Ray worker is) broadcasting a Llama-shaped state dict (random fp32 weights,
transformers config on the meta device, ~1M to ~350M parameters) to the driver's
:class:`rlhforge.workers.weight_sync.DriverReceiver` in this process, over a two-member gloo group on
loopback. One sync = ``send`` on the sender + a barrier after the receiver has unpacked every tensor; the
time is the sender's (median of the repeats). Modes: buckets of 1, 16 and 128 MiB (128 = the
``--vllm.sync_bucket_mb`` default) and ``per_param`` (a 1-byte bucket: each tensor is its own bucket, what
OpenRLHF 0.11 does with one broadcast per parameter). (b) Unless ``--no-vllm``: a vLLM CPU engine in another
process (``in_process=False``) loading the same kind of state dict through its RPC path (safetensors bytes of
each bucket in one ``collective_rpc``, then one reload), for one ~25M-parameter model, per-param vs bucketed.

**Transfers per sync, per path** (audited in the code of this commit; B = the buckets that
:func:`rlhforge.backend.collective.plan_buckets` plans for the state dict and the bucket size, P = the tensors):

- gloo / NCCL group (``broadcast_state`` / ``receive_state``; the driver's channel and the engine actors'
  group): 3 broadcasts per bucket on every member (the header's length, an int64; the header: names,
  dtypes, shapes; the payload), i.e. 3B; plus, with engine actors, one Ray call per engine per sync
  (``receive_weights``) and one ``collective_rpc`` into its workers. Never per parameter.
- CUDA IPC (``ipc_sync.stream_ipc``, colocated engines): per bucket one ``all_gather_object`` of the
  handles over the training group (world > 1), one Ray call ``load_ipc`` per engine (one ``collective_rpc``
  inside it; the last bucket's call also ends the sync), one barrier: B calls per engine.
- vLLM RPC path (``VLLMEngine.update_weights``, an engine in another process): B ``rlhforge_stage_bucket``
  RPCs + one ``rlhforge_load_staged``.
- in-process vLLM engine (the CPU default): one ``rlhforge_load_tensors`` RPC with the tensors themselves
  (no copy, no buckets); HF engine: a ``load_state_dict`` call, no RPC.
- ``--vllm.sync_with_ray``: one object-store put and one Ray call per engine (``load_state``), then the
  engine's own path above.

``tests/distributed/test_sync_bucket_counts.py`` asserts these counts for the gloo and vLLM paths. Writes
``benchmarks/results/weight_sync.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Llama-shaped (q/k/v/o, gate/up/down, two norms per layer; untied head): name -> TinyModelSpec-like sizes
SIZES = {
    "1M": dict(vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2),
    "10M": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
                num_key_value_heads=4),
    "50M": dict(vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4),
    "150M": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4),
    "350M": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                 num_attention_heads=16, num_key_value_heads=8),
}
VLLM_SIZE = dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=4, tie_word_embeddings=True)  # ~23M parameters, with build_tiny_model's tokenizer


def llama_state(spec: dict, seed: int = 0) -> dict:
    """Random fp32 weights with the names and shapes of a transformers Llama of ``spec``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**spec, tie_word_embeddings=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(tuple(v.shape), generator=g) * 0.02 for k, v in model.state_dict().items()}


def modes(buckets_mb: list[float]) -> list[tuple[str, int]]:
    return [("per_param", 1)] + [(f"{mb:g}MiB", int(mb * (1 << 20))) for mb in buckets_mb]


def _sender(port: int, spec: dict, plan: list, results) -> None:
    """Actor rank 0's side (a spawned process): one group, then every (mode, bucket_bytes, repeats) of ``plan``."""
    import torch

    from rlhforge.backend import collective
    from rlhforge.backend.collective import SyncGroup

    torch.set_num_threads(1)
    count = [0]
    real = collective._broadcast

    def counting(pg, tensor, deadline_s=None):
        count[0] += 1
        return real(pg, tensor, deadline_s)

    collective._broadcast = counting
    state = llama_state(spec)
    group = SyncGroup("127.0.0.1", port, 0, 2, "gloo", "cpu", timeout_s=600.0)
    for mode, bucket_bytes, reps in plan:
        for _ in range(reps):
            count[0] = 0
            group.pg.barrier().wait()
            t = time.perf_counter()
            buckets = group.send(state, bucket_bytes)
            group.pg.barrier().wait()  # the receiver has unpacked the last bucket
            results.put((mode, buckets, count[0], time.perf_counter() - t))


def bench_gloo(name: str, spec: dict, buckets_mb: list[float], reps: int) -> dict:
    import multiprocessing as mp

    from rlhforge.backend.collective import free_port, plan_buckets
    from rlhforge.workers.weight_sync import DriverReceiver

    state = llama_state(spec)  # shapes only matter here (the receiver checks them)
    layout = [(k, v.dtype, tuple(v.shape)) for k, v in state.items()]
    n_bytes = sum(v.numel() * v.element_size() for v in state.values())
    n_params = sum(v.numel() for v in state.values())
    del state
    plan = [(m, b, reps) for m, b in modes(buckets_mb)]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    proc = ctx.Process(target=_sender, args=(port, spec, plan, results), daemon=True)
    proc.start()
    receiver = DriverReceiver("127.0.0.1", port)
    receiver.connect()
    out: dict = {"params": n_params, "bytes": n_bytes, "tensors": len(layout), "modes": {}}
    for mode, bucket_bytes, n in plan:
        times, counts = [], []
        for _ in range(n):
            receiver.group.pg.barrier().wait()
            got = receiver.receive()
            receiver.group.pg.barrier().wait()
            assert len(got) == len(layout) and all(tuple(got[k].shape) == s for k, _, s in layout)
            del got
            m, buckets, collectives, dt = results.get(timeout=600)
            assert m == mode
            times.append(dt)
            counts.append((buckets, collectives))
        planned = len(plan_buckets(layout, bucket_bytes))
        buckets, collectives = counts[0]
        assert buckets == planned, (mode, buckets, planned)
        med = statistics.median(times)
        out["modes"][mode] = {"bucket_bytes": bucket_bytes, "buckets": buckets, "collectives_per_sync": collectives,
                              "sync_s_median": round(med, 4), "sync_s_all": [round(t, 4) for t in times],
                              "gb_per_s": round(n_bytes / med / 1e9, 3)}
        print(f"  gloo {name:>5} {mode:>9}: {buckets:4d} buckets, {collectives:4d} collectives, "
              f"{med:7.3f} s ({n_bytes / med / 1e9:.2f} GB/s)", flush=True)
    proc.join(timeout=60)
    return out


def bench_vllm(buckets_mb: list[float], reps: int) -> dict:
    """A vLLM CPU engine in another process: its RPC path (safetensors buckets), per-param vs bucketed."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from rlhforge.backend.collective import plan_buckets
    from rlhforge.models.tiny import TinyModelSpec, build_tiny_model
    from rlhforge.rollout.vllm_engine import VLLMEngine

    tmp = Path(tempfile.mkdtemp(prefix="bench_weight_sync_"))
    path = build_tiny_model(tmp / "model", TinyModelSpec(**VLLM_SIZE), seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    base = load_file(str(path / "model.safetensors"))
    layout = [(k, v.dtype, tuple(v.shape)) for k, v in base.items()]
    n_bytes = sum(v.numel() * v.element_size() for v in base.values())
    t = time.perf_counter()
    engine = VLLMEngine.from_tokenizer(str(path), tok, max_model_len=256, in_process=False)
    out: dict = {"spec": VLLM_SIZE, "params": sum(v.numel() for v in base.values()), "bytes": n_bytes,
                 "tensors": len(layout), "engine_start_s": round(time.perf_counter() - t, 1), "modes": {}}
    before = engine.checksum()
    calls: list[str] = []
    rpc = engine.llm.collective_rpc
    engine.llm.collective_rpc = lambda method, *a, **k: calls.append(method) or rpc(method, *a, **k)
    try:
        for mode, bucket_bytes in modes(buckets_mb):
            engine.bucket_bytes = bucket_bytes
            times = []
            for r in range(reps):
                state = {k: v * (1.0 + 0.01 * (r + 1)) for k, v in base.items()}
                calls.clear()
                t = time.perf_counter()
                engine.update_weights(state)
                times.append(time.perf_counter() - t)
            staged = calls.count("rlhforge_stage_bucket")
            assert staged == len(plan_buckets(layout, bucket_bytes)), (mode, staged)
            med = statistics.median(times)
            out["modes"][mode] = {"bucket_bytes": bucket_bytes, "rpcs_per_sync": len(calls), "buckets": staged,
                                  "sync_s_median": round(med, 4), "sync_s_all": [round(x, 4) for x in times]}
            print(f"  vLLM {mode:>9}: {staged:4d} buckets, {len(calls):4d} RPCs, {med:7.3f} s", flush=True)
        out["weights_changed"] = engine.checksum() != before  # the engine's parameter sum: the syncs took effect
    finally:
        engine.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument("--buckets-mb", default="1,16,128", help="bucket sizes in MiB besides per_param")
    ap.add_argument("--reps", type=int, default=3, help="syncs per mode (models over 100M: at most 2)")
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--budget-s", type=float, default=300.0, help="skip the remaining models past this")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "weight_sync.json"))
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    buckets_mb = [float(x) for x in args.buckets_mb.split(",")]
    t0 = time.perf_counter()
    result: dict = {"benchmark": "weight_sync", "command": " ".join(["python", *sys.argv]),
                    "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
                    "dtype": "float32", "transport": "gloo over loopback, sender in a spawned process",
                    "gloo": {}, "skipped": []}
    for name in args.sizes.split(","):
        if time.perf_counter() - t0 > args.budget_s:
            result["skipped"].append(name)
            continue
        result["gloo"][name] = bench_gloo(name, SIZES[name], buckets_mb, args.reps if SIZES[name]["hidden_size"] < 768
                                          else min(2, args.reps))
    if not args.no_vllm:
        try:
            result["vllm_rpc"] = bench_vllm(buckets_mb, 2)
        except ImportError as err:
            result["vllm_rpc"] = {"skipped": f"no vLLM here: {err}"}
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} in {result['wall_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
