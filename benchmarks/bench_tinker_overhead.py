"""Overhead of ``rlhforge serve-tinker`` per ``forward_backward``: the same cross-entropy step through the real
``tinker`` SDK over localhost (protobuf + zstd request, future, long-poll, protobuf reply) vs the server's own
training code called directly in this process (:class:`rlhforge.tinker_server.training.TrainedModel`).

    python benchmarks/bench_tinker_overhead.py [--steps 20] [--batch 8] [--seq-len 64] [--threads 1]

Both paths run the identical computation on the tiny model (LoRA rank 8) with the same datums; the difference
of the medians is the server's overhead. Also reported: optim_step round trips. Writes
``benchmarks/results/tinker_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

KEY = "tml-bench-key-0000"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "tinker_overhead.json"))
    args = ap.parse_args()

    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    from rlhforge.config.serve_tinker import ServeTinkerConfig
    from rlhforge.models.tiny import build_tiny_model
    from rlhforge.net.server import start_server_thread
    from rlhforge.tinker_server.app import create_app
    from rlhforge.tinker_server.codec import Datum
    from rlhforge.tinker_server.training import LoraSpec, TrainedModel

    tmp = Path(tempfile.mkdtemp(prefix="bench_tinker_"))
    model_dir = build_tiny_model(tmp / "model", seed=0)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(5, 1000, args.seq_len + 1).tolist() for _ in range(args.batch)]

    # direct: the server's training code, no HTTP
    direct = TrainedModel(str(model_dir), LoraSpec(rank=8, seed=0), device="cpu")
    data = [Datum(tokens=np.array(s[:-1]), inputs={"target_tokens": np.array(s[1:]),
                                                   "weights": np.ones(args.seq_len, np.float32)}) for s in seqs]
    direct_t = []
    for i in range(args.steps + 2):
        t0 = time.perf_counter()
        direct.forward_backward(data, "cross_entropy", {}, False)
        if i >= 2:
            direct_t.append(time.perf_counter() - t0)
        direct.module.zero_grad(set_to_none=True)

    # through the SDK and the server
    cfg = ServeTinkerConfig(checkpoint_dir=str(tmp / "ckpt"), device="cpu", model_map=(f"tiny={model_dir}",))
    server = start_server_thread(create_app(cfg, (KEY,)), route="/api/v1/healthz", name="tinker server")
    os.environ.update(TINKER_BASE_URL=server.base_url, TINKER_API_KEY=KEY)
    import tinker
    from tinker import types

    client = tinker.ServiceClient()
    tc = client.create_lora_training_client(base_model="tiny", rank=8, seed=0).result()
    sdk_data = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                            loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * args.seq_len}) for s in seqs]
    served_t, optim_t = [], []
    for i in range(args.steps + 2):
        t0 = time.perf_counter()
        tc.forward_backward(sdk_data, "cross_entropy").result()
        t1 = time.perf_counter()
        tc.optim_step(types.AdamParams(learning_rate=0.0)).result()  # lr 0: the weights stay those of `direct`
        if i >= 2:
            served_t.append(t1 - t0)
            optim_t.append(time.perf_counter() - t1)
    client.close("success").result(timeout=30)
    server.stop()

    med = statistics.median
    result = {
        "what": "median seconds per forward_backward (cross_entropy), tiny model, LoRA rank 8",
        "batch": args.batch, "seq_len": args.seq_len, "steps": args.steps, "threads": args.threads,
        "direct_s": round(med(direct_t), 5), "served_s": round(med(served_t), 5),
        "overhead_s": round(med(served_t) - med(direct_t), 5),
        "overhead_ratio": round(med(served_t) / med(direct_t), 3),
        "optim_step_roundtrip_s": round(med(optim_t), 5),
        "served_p90_s": round(sorted(served_t)[int(0.9 * (len(served_t) - 1))], 5),
        "tinker_sdk": tinker.__version__ if hasattr(tinker, "__version__") else "0.38.0",
        "python": sys.version.split()[0], "torch": torch.__version__,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
