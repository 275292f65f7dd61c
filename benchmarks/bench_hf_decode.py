"""The HF engine's decode loops side by side: ``--rollout.hf_decode eager`` (the dynamic loop) against
``graphs`` (rlhforge.rollout.graph_decode: static KV buffers, bucketed shapes; CUDA graphs on a GPU, the same
static step run eagerly on CPU), same weights, same prompts.

    python benchmarks/bench_hf_decode.py                       # CPU: tiny Qwen3, 16 rows x 32 tokens (~1 min)
    python benchmarks/bench_hf_decode.py --device cuda --rows 64 --new 128 --dtype bf16 --size check
    python benchmarks/bench_hf_decode.py --device cuda --rows 64 --new 128 --dtype bf16 --model FOLDER

``--size check`` builds the GPU check's 0.38B Qwen3 shape (hidden 1024, 24 layers, 16 heads / 8 KV heads,
MLP 4096, 1k vocabulary; random weights) instead of the tiny default.

Two passes per mode: greedy (the two modes' tokens compared row by row, and the largest log-prob gap over
rows with equal tokens), then timed rounds of seeded sampling (temperature 1, one seed per request; the eos
id is out of the vocabulary so every row decodes ``--new`` tokens), the modes interleaved, the first round
of each a warm-up (graph capture, allocator): generated tokens/s, best and median of the other rounds.
Writes ``--out`` (default ``benchmarks/results/hf_decode_{cpu,cuda}.json``). A GPU check stage
(benchmarks/gpu/check_rl.py, ``hf_decode``) calls :func:`compare` on its own model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _prompts(rows: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (int(torch.randint(16, 49, (1,), generator=g)),), generator=g).tolist()
            for _ in range(rows)]


def compare(model, pad_token_id: int, vocab: int, rows: int, new: int, rounds: int) -> dict:
    """Greedy agreement and sampled tokens/s of the eager and the graphs decode loops on ``model``."""
    import torch

    from rlhforge.rollout.engine import SamplingParams
    from rlhforge.rollout.hf_engine import HFEngine

    cuda = next(model.parameters()).device.type == "cuda"
    eos = [vocab + 7]  # never sampled: every row decodes `new` tokens
    engines = {m: HFEngine(model, pad_token_id=pad_token_id, eos_token_id=eos, batch_size=max(rows, 1), hf_decode=m)
               for m in ("eager", "graphs")}
    prompts = _prompts(rows, vocab)
    greedy = {m: asyncio.run(e.generate(prompts, SamplingParams(max_new_tokens=new, temperature=0.0)))
              for m, e in engines.items()}
    same = [a.token_ids == b.token_ids for a, b in zip(greedy["eager"], greedy["graphs"])]
    gaps = [max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0)
            for a, b, s in zip(greedy["eager"], greedy["graphs"], same) if s]
    times: dict[str, list[float]] = {m: [] for m in engines}
    tokens = 0
    for r in range(rounds + 1):
        for m in (("eager", "graphs") if r % 2 == 0 else ("graphs", "eager")):
            params = [SamplingParams(max_new_tokens=new, temperature=1.0, seed=1000 * r + i) for i in range(rows)]
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            outs = asyncio.run(engines[m].generate(prompts, params))
            if cuda:
                torch.cuda.synchronize()
            if r > 0:  # round 0: warm-up (capture, allocator)
                times[m].append(time.perf_counter() - t)
            tokens = sum(len(o.token_ids) for o in outs)
    result = {"rows": rows, "new_tokens": new, "rounds": rounds, "generated_tokens_per_round": tokens,
              "greedy_rows_equal": sum(same), "greedy_rows": rows,
              "greedy_max_logprob_gap_equal_rows": max(gaps, default=None),
              "graphs_buckets": [list(k) for k in engines["graphs"].graphs.steps],
              "graphs_captured": bool(engines["graphs"].graphs.graphs)}
    for m, ts in times.items():
        result[m] = {"tokens_per_s_best": round(tokens / min(ts), 1),
                     "tokens_per_s_median": round(tokens / statistics.median(ts), 1),
                     "seconds": [round(x, 4) for x in ts]}
    result["graphs_speedup_median"] = round(result["graphs"]["tokens_per_s_median"]
                                            / result["eager"]["tokens_per_s_median"], 3)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_hf_decode.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--model", default=None, help="a model folder (default: a tiny Qwen3 built here)")
    p.add_argument("--size", default="tiny", choices=("tiny", "check"), help="the model built without --model")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhforge.models.tiny import TinyModelSpec, build_tiny_model

    torch.set_num_threads(a.threads)
    spec = None
    if a.model is None:
        spec = TinyModelSpec(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                             num_key_value_heads=4) if a.size == "tiny" else \
            TinyModelSpec(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                          num_key_value_heads=8)
        a.model = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="bench_hf_decode_")) / "model", spec, seed=0,
                                       arch="qwen3"))
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype).to(a.device).eval()
    tok = AutoTokenizer.from_pretrained(a.model)
    t = time.time()
    res = compare(model, tok.pad_token_id, len(tok), a.rows, a.new, a.rounds)
    res.update(device=a.device, dtype=a.dtype, threads=a.threads, model=a.model if spec is None else vars(spec),
               params=sum(x.numel() for x in model.parameters()), wall_s=round(time.time() - t, 1),
               load_avg=os.getloadavg(), torch=torch.__version__,
               gpu=torch.cuda.get_device_name() if a.device.startswith("cuda") else None,
               command="python benchmarks/bench_hf_decode.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    out = Path(a.out or REPO / "benchmarks" / "results" / f"hf_decode_{a.device.split(':')[0]}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: res[k] for k in ("greedy_rows_equal", "greedy_rows", "greedy_max_logprob_gap_equal_rows",
                                          "graphs_speedup_median", "wall_s")}))
    print(f"eager {res['eager']['tokens_per_s_median']} tok/s, graphs {res['graphs']['tokens_per_s_median']} tok/s "
          f"(median of {a.rounds}); written {out}")
    return 0 if res["greedy_rows_equal"] == res["greedy_rows"] or a.dtype == "bf16" else 1


if __name__ == "__main__":
    sys.exit(main())
