"""Multi-turn rollout benchmark: episodes/s of the multi-turn executor with concurrent environments.

    python benchmarks/bench_agents.py [--episodes 64] [--threads 1]

Each episode is 3 turns of at most 8 generated tokens on the tiny model; every environment step
waits ``--env-latency`` seconds (a stand-in for a tool call, sandbox run or remote verifier) and
returns a short feedback text. The same episodes (same seeds) run with environment concurrency 1
(one environment call at a time: generation cannot overlap slow environments), 8 and 64; with
concurrency, environment calls overlap and the generation requests of episodes that are ready at
the same time are decoded in one batch. Also measured: the OpenAI-server executor (the same
3-turn conversation driven through the real ``openai`` client over localhost).
Writes ``benchmarks/results/agents.json``.
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

TURNS, TOKENS_PER_TURN = 3, 8


def make_env(latency: float):
    from rlhforge.agents import AgentInstanceBase

    class Env(AgentInstanceBase):
        def __init__(self):
            self.turn = 0

        async def reset(self, states, **kwargs):
            return {"observation": states["observation"], "sampling_params": {"max_tokens": TOKENS_PER_TURN}}

        async def step(self, states, **kwargs):
            self.turn += 1
            await asyncio.sleep(latency)
            done = self.turn >= TURNS
            return {"rewards": 0.0, "environment_feedback": "" if done else f"\n[result {self.turn}]\n", "done": done}

    return Env


async def openai_agent(prompt, label, client):
    messages = [{"role": "user", "content": prompt}]
    for turn in range(TURNS):
        r = await client.chat.completions.create(model="policy", messages=messages, max_tokens=TOKENS_PER_TURN)
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": f"[result {turn + 1}]"}]
        await asyncio.sleep(LATENCY)
    return 0.0


LATENCY = 0.05


def run(executor, engine, tok, episodes: int, concurrency: int, repeats: int) -> dict:
    from rlhforge.agents import AgentSettings
    from rlhforge.agents.single_turn import PromptRequest
    from rlhforge.rollout.engine import SamplingParams

    executor.configure(tokenizer=tok, settings=AgentSettings(env_concurrency=concurrency, step_timeout=60))
    text = tok.apply_chat_template([{"role": "user", "content": "Play the game."}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    reqs = [PromptRequest(ids, "x", None, i, 0, raw_prompt="Play the game.") for i in range(episodes)]
    params = [SamplingParams(max_new_tokens=64, seed=i) for i in range(episodes)]
    times, batches, tokens = [], [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        trajs = asyncio.run(executor.execute_batch(reqs, params, engine))
        times.append(time.perf_counter() - t0)
        batches = executor.last_batch_sizes
        assert all(t.drop_reason is None for t in trajs), [t.error for t in trajs if t.error][:1]
        tokens = sum(t.response_length for t in trajs)
    best = min(times)
    return {"episodes_per_s": episodes / best, "seconds": best, "seconds_all": times,
            "action_tokens_per_s": tokens / best, "engine_calls": len(batches),
            "mean_engine_batch": statistics.mean(batches) if batches else 0.0,
            "turns_per_episode": sum(len(t.action_ranges) for t in trajs) / len(trajs)}


def main() -> int:
    global LATENCY
    ap = argparse.ArgumentParser()
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--env-latency", type=float, default=0.05)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "agents.json"))
    args = ap.parse_args()
    LATENCY = args.env_latency
    os.environ.setdefault("TQDM_DISABLE", "1")
    import torch
    from transformers import AutoTokenizer

    from rlhforge.agents import MultiTurnAgentExecutor, OpenAIServerAgentExecutor
    from rlhforge.models.tiny import build_tiny_model
    from rlhforge.rollout.hf_engine import HFEngine

    torch.set_num_threads(args.threads)
    model_dir = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny", seed=0)
    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = HFEngine.from_pretrained(str(model_dir), tok)
    env = make_env(args.env_latency)
    results: dict = {
        "setup": {"model": "rlhforge tiny Llama (TinyModelSpec defaults)", "episodes": args.episodes,
                  "turns": TURNS, "max_tokens_per_turn": TOKENS_PER_TURN, "env_latency_s": args.env_latency,
                  "torch_threads": args.threads, "device": "cpu", "timing": f"best of {args.repeats}"},
        "multi_turn": {},
    }
    for conc in (1, 8, 64):
        r = run(MultiTurnAgentExecutor(env), engine, tok, args.episodes, conc, args.repeats)
        results["multi_turn"][f"env_concurrency_{conc}"] = r
        print(f"multi-turn, env concurrency {conc:3d}: {r['episodes_per_s']:7.2f} episodes/s "
              f"(mean engine batch {r['mean_engine_batch']:.1f})", file=sys.stderr)
    ex = OpenAIServerAgentExecutor(openai_agent)
    try:
        r = run(ex, engine, tok, args.episodes, 64, args.repeats)
    finally:
        ex.close()
    results["openai_server_env_concurrency_64"] = r
    print(f"OpenAI server, 64 concurrent agents: {r['episodes_per_s']:7.2f} episodes/s", file=sys.stderr)
    mt = results["multi_turn"]
    results["speedup_concurrency_64_vs_1"] = mt["env_concurrency_64"]["episodes_per_s"] / mt["env_concurrency_1"]["episodes_per_s"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k != "setup"}, indent=1)[:1500])
    return 0


if __name__ == "__main__":
    sys.exit(main())
