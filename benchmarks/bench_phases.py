"""Where an rlhforge GRPO step's time goes, phase by phase, beside the arithmetic limit (issue 42).

``bench_vs_trl.py`` calls these on the rlhforge sides' ``metrics.jsonl``:

- :func:`step_phases`: per step, seconds in generation (sampling, the reward call taken out), reward,
  old log-probs, reference, values (critic), advantage (the rest of the experience: shaping, advantages,
  metrics), training (the optimizer step: forward, backward, update), sync (weights into the engine and
  the post-sync probe) and untimed (between the end of one step and the next: logging, checkpoints). They
  sum to the wall-clock step (the interval between two step ends).
- :func:`flop_limit`: the FLOP of the step's arithmetic, ``2 x params x tokens`` for a forward (generation:
  every prompt and response token once; old log-probs and reference: a forward over the samples) and
  ``6 x params x tokens`` for training, and the seconds they take at this machine's measured matmul rate
  (:func:`matmul_gflops`, one fp32 GEMM of the model's width on the run's threads): a floor that no
  implementation goes below, attention and the optimizer left out.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

PHASES = ("generation", "reward", "old_logprobs", "reference", "values", "advantage", "training", "sync", "untimed")


def step_phases(records: list[dict]) -> list[dict]:
    """One dict of phase seconds per step record (from the second record on: ``untimed`` needs the previous
    step's end), plus ``step`` (the wall-clock interval) and the step's token counts."""
    out = []
    for prev, r in zip(records, records[1:]):
        t = {k[len("timing/"):]: v for k, v in r.items() if k.startswith("timing/")}
        if "step_total" not in t:
            continue
        reward = t.get("reward", 0.0)
        inner = sum(t.get(k, 0.0) for k in ("old_logprobs", "reference", "values"))
        step = r["time"] - prev["time"]
        phases = {"generation": t["generation"] - reward, "reward": reward,
                  "old_logprobs": t.get("old_logprobs", 0.0), "reference": t.get("reference", 0.0),
                  "values": t.get("values", 0.0), "advantage": max(t["make_experience"] - inner, 0.0),
                  "training": t["ppo_train"], "sync": t["broadcast"], "untimed": step - t["step_total"]}
        samples = r.get("rollout/samples", 0.0)
        response = r.get("rollout/response_length", 0.0) * samples
        tokens = r.get("perf/tokens_per_s", 0.0) * t["step_total"]  # prompt + response tokens trained on
        out.append({**phases, "step": step, "tokens": tokens, "response_tokens": response})
    return out


def median_phases(per_step: list[dict], skip: int) -> dict:
    """The median of every field over the steps after the first ``skip`` (the warm-up)."""
    rows = per_step[skip:] or per_step
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]} if rows else {}


def flop_params(model_dir: str) -> int:
    """Parameters a token's forward multiplies by: every weight but the input embedding, plus the output
    head (counted once more when it is tied to the embedding)."""
    from safetensors import safe_open

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    total, embed = 0, 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                n = 1
                for d in st.get_slice(name).get_shape():
                    n *= d
                total += n
                if name.endswith("embed_tokens.weight"):
                    embed = n
    return total - embed + (embed if cfg.get("tie_word_embeddings") else 0)


def matmul_gflops(hidden: int, threads: int, seconds: float = 0.5) -> float:
    """GFLOP/s of an fp32 ``[512, hidden] x [hidden, 4 hidden]`` matmul on ``threads`` threads (best of a
    half-second loop each, by PyTorch's BLAS and by oneDNN, rlhforge/models/cpu_linear.py, the faster kept): the
    rate the limit is taken at."""
    import torch

    from rlhforge.models.cpu_linear import onednn_linear

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(512, hidden), torch.randn(hidden, 4 * hidden)
        bt = b.t().contiguous()
        best = float("inf")
        for product in (lambda: a @ b, lambda: onednn_linear(a, bt, None)):
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                t = time.perf_counter()
                product()
                best = min(best, time.perf_counter() - t)
        return 2 * 512 * hidden * 4 * hidden / best / 1e9
    finally:
        torch.set_num_threads(before)


def flop_limit(phases: dict, params: int, gflops: float, old_pass: bool = False, reference: bool = False) -> dict:
    """FLOP of a step's arithmetic and its seconds at ``gflops``: generation (a forward over every prompt and
    response token: ``tokens`` counts the prompts once per sample, as the engine prefills a group's prompt
    once, so this is a little high), the no-grad passes that ran and training."""
    tokens, response = phases.get("tokens", 0.0), phases.get("response_tokens", 0.0)
    flop = {"generation": 2 * params * tokens, "training": 6 * params * tokens}
    if old_pass:
        flop["old_logprobs"] = 2 * params * tokens
    if reference:
        flop["reference"] = 2 * params * tokens
    out = {f"{k}_gflop": v / 1e9 for k, v in flop.items()}
    out.update({f"{k}_limit_s": v / 1e9 / gflops for k, v in flop.items()})
    out["step_limit_s"] = sum(flop.values()) / 1e9 / gflops
    out.update({"params": params, "matmul_gflops": gflops, "tokens": tokens, "response_tokens": response})
    return out


def print_phases(results: dict) -> None:
    """The GRPO points' split: rlhforge's phases (median seconds per step), TRL's step beside them, and the
    arithmetic floor."""
    for entry in results["points"]:
        if entry["work"] != "grpo":
            continue
        trl = entry["sides"].get("trl", {}).get("seconds_per_step")
        for side, r in entry["sides"].items():
            ph, lim = r.get("phases_s"), r.get("flop_limit")
            if not ph:
                continue
            shape = f"{entry['point']['prompts']}x{entry['point']['samples']}x{entry['point']['new_tokens']}"
            parts = " ".join(f"{k} {ph[k]:.3f}" for k in PHASES if ph.get(k, 0.0) >= 0.0005 or k == "untimed")
            print(f"grpo {shape} {side}: step {ph['step']:.3f} s = {parts}"
                  + (f" | TRL step {trl:.3f} s" if trl else ""))
            if lim:
                print(f"    arithmetic floor at {lim['matmul_gflops']:.0f} GFLOP/s ({lim['params'] / 1e6:.1f}M params, "
                      f"{lim['tokens']:.0f} tokens, {lim['response_tokens']:.0f} generated): generation "
                      f"{lim['generation_limit_s']:.3f} s, training {lim['training_limit_s']:.3f} s, step "
                      f"{lim['step_limit_s']:.3f} s")
