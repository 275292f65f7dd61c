"""The rollout/train log-prob gap of an MoE model with and without routing replay.

A tiny Qwen3-MoE (random weights: near-uniform routers, the worst case for flipped experts) samples
responses with the HF engine; the trainer then computes the log-probs of the same tokens with and
without replaying the engine's recorded experts, and the gap to the engine's log-probs is measured
(mean and max |log p_engine - log p_train| over response tokens, and the share of tokens whose expert
set differs in any layer). Two rollout precisions:

- ``fp32``: the engine runs the trainer's own fp32 weights (the gap is rounding only);
- ``bf16``: the engine runs a bf16 copy, as a GPU rollout engine does, while the trainer stays fp32;
  routers then flip experts on near-ties and replay removes that part of the gap.

``python benchmarks/bench_routing_replay.py [--quick]`` writes ``benchmarks/results/routing_replay.json``.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import time
from pathlib import Path

import torch

from rlhforge.workers.experience import ExperienceSample, collate_experience
from rlhforge.models.forward import token_logprobs
from rlhforge.models.routing import record_routing, replay_routing, routing_for_rows
from rlhforge.models.tiny import TinyModelSpec, build_tiny_model
from rlhforge.rollout.engine import SamplingParams
from rlhforge.rollout.hf_engine import HFEngine

RESULTS = Path(__file__).parent / "results" / "routing_replay.json"


def _gap(model, samples, engine_lps, replay: bool) -> dict:
    batch = collate_experience(samples, 0, packed=False, fields=(), routing=replay)
    forced = routing_for_rows(batch["routed_experts"]) if replay else None
    # the recorder sits after the (outer) replay hooks, so it sees the experts the forward really used
    with torch.no_grad(), replay_routing(model, forced), record_routing(model) as rec:
        lp = token_logprobs(model, batch)
    used = rec.last().view(len(samples), batch["input_ids"].shape[1], *rec.last().shape[1:])
    mask = batch["loss_mask"].bool()
    diff = (lp - engine_lps)[mask].abs()
    flipped, counted = 0, 0
    for i, s in enumerate(samples):  # tokens whose experts differ from the engine's in any layer
        n = len(s) - 1  # the last token has no record
        a = torch.sort(used[i, :n].long(), -1).values
        b = torch.sort(s.routing[:n].long(), -1).values
        flipped += int((a != b).any(-1).any(-1).sum())
        counted += n
    return {"mean_abs_logprob_gap": float(diff.mean()), "max_abs_logprob_gap": float(diff.max()),
            "tokens_with_other_experts": flipped / max(counted, 1)}


def run(precision: str, n_prompts: int, new_tokens: int, model_dir: Path) -> dict:
    from transformers import AutoModelForCausalLM

    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engine_model = copy.deepcopy(trainer)
    if precision == "bf16":
        engine_model = engine_model.to(torch.bfloat16)
    engine = HFEngine(engine_model, pad_token_id=0, eos_token_id=-1, record_routing=True, batch_size=n_prompts)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (int(torch.randint(4, 12, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n_prompts)]
    t0 = time.perf_counter()
    outs = engine.generate_sync(prompts, [SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=i)
                                          for i in range(n_prompts)])
    gen_s = time.perf_counter() - t0
    samples, rows = [], []
    for p, o in zip(prompts, outs):
        s = ExperienceSample(p + o.token_ids, [0] * len(p) + [1] * len(o.token_ids), 0.0, 0.0)
        s.routing = o.extra["routed_experts"]
        samples.append(s)
        rows.append(torch.tensor([0.0] * len(p) + list(o.logprobs)))
    width = max(len(s) for s in samples)
    engine_lps = torch.zeros(len(samples), width)
    for i, r in enumerate(rows):
        engine_lps[i, : len(r)] = r
    return {"precision": precision, "prompts": n_prompts, "new_tokens": new_tokens, "generation_s": gen_s,
            "without_replay": _gap(trainer, samples, engine_lps, replay=False),
            "with_replay": _gap(trainer, samples, engine_lps, replay=True)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 prompts x 16 tokens (seconds)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    n, t = (8, 16) if args.quick else (32, 48)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        spec = TinyModelSpec(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2)
        model_dir = build_tiny_model(Path(tmp) / "moe", spec, seed=0, arch="qwen3_moe")
        results = [run(p, n, t, model_dir) for p in ("fp32", "bf16")]
    report = {"benchmark": "routing_replay", "model": "tiny qwen3_moe (4 layers, 8 experts, top-2, random init)",
              "quick": args.quick, "torch": torch.__version__, "machine": platform.machine(), "runs": results,
              "command": "python benchmarks/bench_routing_replay.py" + (" --quick" if args.quick else "")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'rollout':8} {'replay':7} {'mean |gap|':>11} {'max |gap|':>10} {'other experts':>14}")
    for r in results:
        for key in ("without_replay", "with_replay"):
            g = r[key]
            print(f"{r['precision']:8} {'yes' if key == 'with_replay' else 'no':7} {g['mean_abs_logprob_gap']:11.2e} "
                  f"{g['max_abs_logprob_gap']:10.2e} {g['tokens_with_other_experts']:14.1%}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
