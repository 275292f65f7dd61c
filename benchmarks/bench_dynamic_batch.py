"""Fixed vs token-budget micro-batches (``--train.dynamic_batch_enable``) on mixed lengths.

A tiny Llama (``rlhforge.models.tiny``) runs one actor optimizer step (PPO, token-mean, plain-torch
strategy, fp32, one thread) and one no-grad log-prob pass over the same mixed-length experience
(mostly short samples, a long tail), three ways:

- ``fixed_padded``: ``--train.micro_batch_size`` samples per micro-batch, right-padded (the default);
- ``fixed_packed``: the same micro-batches, packed (``--ds.packing_samples``);
- ``token_budget``: ``--train.dynamic_batch_enable --ds.packing_samples``: micro-batches of at most
  ``--train.max_tokens_per_gpu`` tokens (first-fit count), length-balanced.

Per mode: forward passes, tokens the model computed (padding included, read from the model's inputs
by a forward pre-hook), the padding fraction (1 - real / computed), wall time and real tokens per
second (best of ``--repeats``), and the step's policy loss (the three must agree). The time numbers are
from a shared 2-core CPU; the counts do not depend on the machine.

    python benchmarks/bench_dynamic_batch.py --quick   # ~20 s: 48 samples, 1 repeat
    python benchmarks/bench_dynamic_batch.py           # 128 samples, 3 repeats

writes ``benchmarks/results/dynamic_batch.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "dynamic_batch.json"

import torch  # noqa: E402


def mixed_lengths(n: int, seed: int, short: tuple[int, int], long: tuple[int, int], long_share: float) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(*long) if rng.random() < long_share else rng.randint(*short) for _ in range(n)]


def experience(lengths: list[int], vocab: int, seed: int):
    from rlhforge.workers.experience import ExperienceSample

    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        prompt = max(2, n // 4)
        mask = [0] * prompt + [1] * (n - prompt)
        s = ExperienceSample(torch.randint(3, vocab, (n,), generator=g).tolist(), mask, reward=0.0, score=0.0)
        m = torch.tensor(mask, dtype=torch.float32)
        s.tensors.update(old_logprobs=(-6.0 + 0.2 * torch.randn(n, generator=g)) * m,
                         advantages=torch.randn(n, generator=g) * m)
        out.append(s)
    return out


class Counter:
    def __init__(self, module):
        self.passes, self.computed = 0, 0
        self.handle = module.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, _module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.passes += 1
        self.computed += ids.numel()


def measure(worker, samples, mode: str, budget: int, micro: int, repeats: int) -> dict:
    from rlhforge.workers.actor import PolicyLossSpec

    worker.packed = mode != "fixed_padded"
    worker.train_tokens = worker.pass_tokens = budget if mode == "token_budget" else None
    module = worker.strategy.module
    start = {k: v.clone() for k, v in module.state_dict().items()}
    spec = PolicyLossSpec(loss_kwargs={"eps_low": 0.2, "eps_high": 0.2})
    real = sum(len(s) for s in samples)
    out: dict = {}
    for name, fn in (("train_step", lambda: worker.train_step(samples, spec)),
                     ("logprob_pass", lambda: worker.logprobs(samples, micro, 1.0))):
        best, result, counts = float("inf"), None, None
        for _ in range(repeats):
            counter = Counter(module)
            t0 = time.perf_counter()
            result = fn()
            best = min(best, time.perf_counter() - t0)
            counter.handle.remove()
            counts = (counter.passes, counter.computed)
            module.load_state_dict(start)
        entry = {"forward_passes": counts[0], "computed_tokens": counts[1], "real_tokens": real,
                 "padding_fraction": round(1 - real / counts[1], 4), "seconds": round(best, 4),
                 "tokens_per_s": round(real / best, 1)}
        if name == "train_step":
            entry["policy_loss"] = result["policy_loss"]
        out[name] = entry
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="48 samples, 1 repeat (under a minute)")
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--micro_batch_size", type=int, default=8)
    p.add_argument("--max_tokens_per_gpu", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", type=Path, default=RESULTS)
    a = p.parse_args(argv)
    if a.quick:
        a.samples, a.repeats, a.max_tokens_per_gpu = 48, 1, 1024
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    from rlhforge.config.parsing import from_dict
    from rlhforge.config.rl import RLConfig
    from rlhforge.data.balancing import count_micro_batches
    from rlhforge.workers.actor import ActorWorker
    from rlhforge.models.tiny import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec()
    short, long = (16, 96), (256, 512) if not a.quick else (192, 320)
    lengths = mixed_lengths(a.samples, a.seed, short, long, long_share=0.15)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", spec, seed=0)
        cfg = from_dict(RLConfig, {
            "actor.model_name_or_path": str(model_dir), "data.prompt_dataset": "builtin:arithmetic",
            "reward.remote_url": "builtin:arithmetic", "rollout.batch_size": a.samples, "train.batch_size": a.samples,
            "train.micro_batch_size": a.micro_batch_size, "ds.param_dtype": "fp32", "train.device": "cpu"})
        worker = ActorWorker(cfg, AutoTokenizer.from_pretrained(model_dir), total_updates=10,
                             grad_accum=max(1, a.samples // a.micro_batch_size))
        samples = experience(lengths, spec.vocab_size, a.seed)
        t0 = time.perf_counter()
        modes = {m: measure(worker, samples, m, a.max_tokens_per_gpu, a.micro_batch_size, a.repeats)
                 for m in ("fixed_padded", "fixed_packed", "token_budget")}
        wall = time.perf_counter() - t0
    fixed, budget = modes["fixed_padded"]["train_step"], modes["token_budget"]["train_step"]
    result = {
        "what": "one actor step + one log-prob pass, fixed micro-batches vs token budget, mixed lengths",
        "command": "python benchmarks/bench_dynamic_batch.py" + (" --quick" if a.quick else ""),
        "model": {"arch": "llama", "hidden_size": spec.hidden_size, "layers": spec.num_hidden_layers,
                  "vocab_size": spec.vocab_size},
        "data": {"samples": a.samples, "tokens": sum(lengths), "min_len": min(lengths), "max_len": max(lengths),
                 "mean_len": round(sum(lengths) / len(lengths), 1), "long_share": 0.15, "short": short, "long": long},
        "flags": {"micro_batch_size": a.micro_batch_size, "max_tokens_per_gpu": a.max_tokens_per_gpu,
                  "first_fit_count": count_micro_batches(lengths, a.max_tokens_per_gpu)},
        "modes": modes,
        "summary": {
            "train_forward_passes": {"fixed": fixed["forward_passes"], "token_budget": budget["forward_passes"]},
            "train_padding_fraction": {"fixed": fixed["padding_fraction"], "token_budget": budget["padding_fraction"]},
            "train_speedup": round(fixed["seconds"] / budget["seconds"], 2),
            "policy_loss_abs_diff": abs(fixed["policy_loss"] - budget["policy_loss"]),
        },
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
                    "load_avg": list(os.getloadavg()), "torch": torch.__version__},
        "repeats": a.repeats, "wall_seconds": round(wall, 1),
    }
    a.results.parent.mkdir(parents=True, exist_ok=True)
    a.results.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
