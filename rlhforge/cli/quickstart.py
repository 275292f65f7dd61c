"""``rlhforge quickstart``: the README's main job on the embedded default.

Builds a tiny model and tokenizer, measures held-out accuracy on the test split of a built-in task
(default ``larger``: "Which is larger: (12,7)?" -> "12"), warm-starts it with SFT on the task's training
prompts whose completions show the answer format and never the answer (``--sft_labels format``: one of the
question's two numbers at random, so SFT alone stays near chance), then trains it with GRPO
through the RL trainer (``rlhforge rl``: group_norm advantages, PPO clip, the task's exact-answer
reward) on CPU. Accuracy is measured after each stage, greedy and as sampled pass@1 (temperature 1,
mean over ``eval_samples`` samples per problem), and written to a report (``report.md``,
``curves.png`` with train reward / held-out pass@1 / KL / entropy / length / group reward std per RL
step, ``sft_loss.png``, ``summary.json``) in the run directory. The change from "SFT only" to
"SFT + GRPO" on the same eval set is RL alone. Numbers: ``benchmarks/results/quickstart.json``
(written by ``python benchmarks/bench_quickstart.py``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal


@dataclass(frozen=True)
class QuickstartArgs:
    """Tiny model + built-in task: SFT warm start, then GRPO, end to end on CPU in minutes."""

    out: str = "runs/quickstart"
    """Run directory (models, metrics, report)."""
    task: str = "larger"
    """Built-in task (see docs/data.md); an image task (``shape_colour``) runs the VLM quick start
    (``rlhforge.cli.quickstart_vlm``, its own flags: ``rlhforge quickstart --task shape_colour --help``)."""
    task_params: str = "max=49"
    """Task parameters (``&``-separated, see docs/data.md), e.g. ``max=49`` for numbers 0..49."""
    seed: int = 0
    """Seed of the model, data order and sampling."""
    hidden_size: int = 128
    """Tiny model width (head_dim stays 32: heads = hidden_size / 32)."""
    layers: int = 2
    """Tiny model depth."""
    sft_labels: Literal["format", "answer"] = "format"
    """What the SFT warm start's completions are: ``format`` (default): the answer format only, never the
    answer: for ``larger`` one of the question's two numbers picked at random, for other tasks the answer of
    another, random problem; SFT alone cannot learn the task from them, so the change SFT only -> SFT + GRPO is
    RL's. ``answer``: the true answers (supervised learning of the task itself)."""
    sft_steps: int = 400
    """Optimizer steps of the SFT warm start (it teaches the answer format; RL does the rest)."""
    sft_batch_size: int = 32
    """Samples per SFT step."""
    sft_lr: float = 2e-3
    """Peak SFT learning rate."""
    rl_steps: int = 150
    """GRPO steps (one rollout each)."""
    rl_prompts: int = 16
    """Prompts per GRPO step (rollout.batch_size)."""
    group_size: int = 8
    """Samples per prompt (rollout.n_samples_per_prompt)."""
    updates_per_rollout: int = 2
    """Optimizer steps per rollout (train.batch_size = rollout samples / this)."""
    rl_lr: float = 1e-3
    """Peak GRPO learning rate."""
    kl_coef: float = 0.0
    """KL coefficient to the SFT model (0: no reference model, the usual GRPO-on-verifiable-rewards choice)."""
    max_new_tokens: int = 6
    """Response length limit (answers are one or two tokens plus end-of-turn)."""
    eval_every: int = 25
    """Held-out evaluation (sampled pass@1) every N GRPO steps."""
    eval_samples: int = 4
    """Samples per held-out problem for sampled pass@1 (temperature 1)."""
    eval_size: int = 0
    """Held-out problems to evaluate (0: every distinct problem of the test split)."""
    threads: int = 1
    """torch CPU threads (1 is fastest for tiny models, and leaves the other cores free)."""
    train_records: int = 20000
    """Records drawn (with repetition, shuffled) from the task's train pool for SFT and for the RL prompt stream."""


def _load() -> float | None:
    """1-minute load average (timings on a shared CPU depend on it)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _spec(args: QuickstartArgs, split: str, n: int) -> str:
    from rlhforge.data.builtin import builtin_spec

    return builtin_spec(args.task, split, n, args.seed, args.task_params)


def format_only_records(args: QuickstartArgs) -> list[dict]:
    """The SFT warm start's records with ``--sft_labels format``: the task's train records, each completion
    replaced by an answer-shaped string that is not the answer's function of the prompt (``larger``: one of
    the question's two numbers, picked with a seeded coin; other tasks: the answer of a random other record)."""
    import random
    import re

    from rlhforge.data.builtin import generate_builtin, parse_builtin_spec

    spec = parse_builtin_spec(_spec(args, "train", args.train_records))
    params = {k: v for k, v in spec.params.items() if k not in ("n", "seed")}
    records = generate_builtin(args.task, "train", n=args.train_records, seed=args.seed, **params)
    rng = random.Random(args.seed * 7919 + 17)
    answers = [r["completion"] for r in records]
    out = []
    for r in records:
        if args.task == "larger":
            completion = rng.choice(re.findall(r"\d+", r["prompt"]))
        else:
            completion = answers[rng.randrange(len(answers))]
        out.append({"prompt": r["prompt"], "completion": completion})
    return out


def held_out_records(args: QuickstartArgs) -> list[dict]:
    """Every distinct problem of the task's test pool, once (the first ``eval_size`` if set)."""
    from rlhforge.data.builtin import generate_builtin
    from rlhforge.data.builtin import parse_builtin_spec

    spec = parse_builtin_spec(_spec(args, "test", 1))
    params = {k: v for k, v in spec.params.items() if k not in ("n", "seed")}
    seen, out = set(), []
    for r in generate_builtin(args.task, "test", n=20000, seed=args.seed, **params):
        if r["prompt"] not in seen:
            seen.add(r["prompt"])
            out.append(r)
    return out[: args.eval_size] if args.eval_size > 0 else out


def accuracy(model_dir: str | Path, task: str, records: list[dict], samples: int = 4, seed: int = 0,
             max_new_tokens: int = 6) -> dict:
    """Held-out accuracy of the model in ``model_dir`` on built-in ``records``: greedy, and sampled
    pass@1 (temperature 1, mean over ``samples`` seeded samples per problem)."""
    import asyncio

    from transformers import AutoTokenizer

    from rlhforge.data.builtin import check_answer
    from rlhforge.rollout.engine import SamplingParams
    from rlhforge.rollout.hf_engine import HFEngine

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = HFEngine.from_pretrained(str(model_dir), tok, batch_size=128)
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for r in records]
    greedy = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    outs = asyncio.run(engine.generate(prompts, [greedy] * len(prompts)))
    texts = [tok.decode(o.token_ids, skip_special_tokens=True) for o in outs]
    scores = [check_answer(task, t, r["answer"]) for t, r in zip(texts, records)]
    result = {"accuracy": sum(scores) / len(scores),
              "samples": [{"prompt": r["prompt"], "completion": t, "answer": r["answer"]}
                          for r, t in zip(records[:6], texts)]}
    if samples > 0:
        params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, seed=seed * 1_000_003 + i * 131 + j)
                  for i in range(len(prompts)) for j in range(samples)]
        outs = asyncio.run(engine.generate([p for p in prompts for _ in range(samples)], params))
        hits = [check_answer(task, tok.decode(o.token_ids, skip_special_tokens=True), records[k // samples]["answer"])
                for k, o in enumerate(outs)]
        result["pass1_sampled"] = sum(hits) / len(hits)
    return result


def write_report(run_dir: Path, args: QuickstartArgs, acc: dict, seconds: dict, n_eval: int) -> None:
    from rlhforge.tracking.metrics import read_metrics
    from rlhforge.tracking.report import plot_curves

    metrics = read_metrics(run_dir / "rl")
    kl_key = "actor/kl_ref" if args.kl_coef > 0 else "actor/approx_kl"
    keys = ["rollout/reward_mean", "eval/pass1", kl_key, "actor/entropy", "rollout/response_length",
            "rollout/group_reward_std"]
    plot = plot_curves(metrics, keys, run_dir / "curves.png")
    sft_plot = plot_curves(read_metrics(run_dir / "sft"), ["train/loss"], run_dir / "sft_loss.png")
    taught = "the answer format only" if args.sft_labels == "format" else "the true answers"
    stages = [("before", "tiny model, untrained"),
              ("sft", f"after SFT warm start ({args.sft_steps} steps, {taught}) = SFT only"),
              ("rl", f"after SFT + GRPO ({args.rl_steps} steps)")]
    g = {k: acc[k]["accuracy"] for k, _ in stages}
    p = {k: acc[k].get("pass1_sampled", float("nan")) for k, _ in stages}
    lines = [
        f"# rlhforge quickstart: {args.task} ({args.task_params}), seed {args.seed}",
        "",
        f"Held-out accuracy on {n_eval} test problems (never seen in training): greedy decoding, and sampled "
        f"pass@1 (temperature 1, mean over {args.eval_samples} samples per problem).",
        "",
        "| stage | greedy accuracy | sampled pass@1 |",
        "|---|---|---|",
    ]
    for k, name in stages:
        bold = "**" if k == "rl" else ""
        lines.append(f"| {name} | {bold}{g[k]:.3f}{bold} | {bold}{p[k]:.3f}{bold} |")
    lines += [
        "",
        f"RL alone (SFT only -> SFT + GRPO, same eval set): greedy **{g['sft']:.3f} -> {g['rl']:.3f}** "
        f"({g['rl'] - g['sft']:+.3f}), sampled pass@1 **{p['sft']:.3f} -> {p['rl']:.3f}** ({p['rl'] - p['sft']:+.3f}).",
        "",
        f"- model: tiny Llama, hidden {args.hidden_size}, {args.layers} layers, {args.hidden_size // 32} heads",
        f"- SFT: {args.sft_steps} steps x {args.sft_batch_size} samples, lr {args.sft_lr}, completions: "
        + ("one of the question's two numbers at random (the format, never which one: SFT alone stays near chance, "
           "so the gain after it is RL's)" if args.sft_labels == "format" and args.task == "larger" else
           "answers of other, random problems (the format only)" if args.sft_labels == "format" else "the true answers"),
        f"- GRPO: {args.rl_steps} steps x {args.rl_prompts} prompts x {args.group_size} samples, "
        f"{args.updates_per_rollout} optimizer steps per rollout, lr {args.rl_lr}, KL coef {args.kl_coef}, "
        f"temperature 1, max {args.max_new_tokens} new tokens, seed {args.seed}",
        f"- wall time: SFT {seconds['sft']:.0f} s, GRPO {seconds['rl']:.0f} s, evals {seconds['eval']:.0f} s, "
        f"total {seconds['total']:.0f} s ({args.threads} torch thread(s); 1-min load average "
        f"{seconds.get('load_start') or float('nan'):.1f} at start, "
        f"{seconds.get('load_end') or float('nan'):.1f} at end)",
        "",
    ]
    if plot:
        lines += ["GRPO curves per step: train reward, held-out sampled pass@1, "
                  f"KL ({kl_key}), entropy, response length, within-group reward std:", "",
                  f"![GRPO curves]({plot.name})", ""]
    if sft_plot:
        lines += [f"![SFT loss]({sft_plot.name})", ""]
    lines += ["Greedy samples after GRPO:", "", "| prompt | completion | answer |", "|---|---|---|"]
    lines += [f"| {x['prompt']} | {x['completion']!r} | {x['answer']} |" for x in acc["rl"]["samples"]]
    (run_dir / "report.md").write_text("\n".join(lines) + "\n")
    summary = {"task": args.task, "task_params": args.task_params, "seed": args.seed, "n_eval": n_eval,
               "eval_samples": args.eval_samples,
               "accuracy_before": g["before"], "accuracy_after_sft": g["sft"], "accuracy_after_rl": g["rl"],
               "rl_gain": g["rl"] - g["sft"],
               "pass1_sampled_before": p["before"], "pass1_sampled_after_sft": p["sft"],
               "pass1_sampled_after_rl": p["rl"], "rl_gain_pass1_sampled": p["rl"] - p["sft"],
               "args": {k: getattr(args, k) for k in args.__dataclass_fields__},
               "seconds": {k: v for k, v in seconds.items() if not k.startswith("load_")},
               "load_avg_1min": {"start": seconds.get("load_start"), "end": seconds.get("load_end")},
               "plots": [x.name for x in (plot, sft_plot) if x]}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))


def _image_task(argv: list[str]) -> bool:
    """Whether ``--task`` names a built-in image task (``rlhforge quickstart --task shape_colour``)."""
    from rlhforge.cli.quickstart_vlm import VLM_TASKS

    for i, a in enumerate(argv):
        value = a.split("=", 1)[1] if a.startswith("--task=") else argv[i + 1] if a == "--task" and i + 1 < len(argv) else None
        if value is not None:
            return value in VLM_TASKS
    return False


def main(argv: list[str] | None = None, prog: str = "rlhforge quickstart") -> int:
    import tyro
    import torch

    from rlhforge.cli.env import setup_cli_environment

    setup_cli_environment()
    if _image_task(sys.argv[1:] if argv is None else argv):  # a VLM task: its own quick start (docs/vlm.md)
        from rlhforge.cli.quickstart_vlm import main as vlm_main

        return vlm_main(argv, prog=prog)
    args = tyro.cli(QuickstartArgs, args=argv, prog=prog, use_underscores=True)
    torch.set_num_threads(max(1, args.threads))

    from rlhforge.cli.train_ppo_ray import run as run_rl
    from rlhforge.cli.train_sft import run as run_sft
    from rlhforge.config.components import AdamConfig, CkptConfig, LoggerConfig
    from rlhforge.config.components import OptimConfig, TrainConfig
    from rlhforge.config.rl import (ActorConfig, AlgoConfig, AdvantageConfig, KLConfig, RLCkptConfig, RLConfig,
                                    RLDataConfig, RLEvalConfig, RLTrainConfig, RewardConfig, RolloutConfig)
    from rlhforge.config.sft import SFTConfig, SFTDataConfig, SFTModelConfig
    from rlhforge.models.tiny import TinyModelSpec, build_tiny_model

    start = time.time()
    load_start = _load()
    run_dir = Path(args.out)
    spec = TinyModelSpec(hidden_size=args.hidden_size, intermediate_size=3 * args.hidden_size,
                         num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden_size // 32),
                         num_key_value_heads=max(1, args.hidden_size // 64))
    base = build_tiny_model(run_dir / "base", spec, seed=args.seed)
    eval_records = held_out_records(args)
    eval_seconds = 0.0

    def measure(model_dir) -> dict:
        nonlocal eval_seconds
        t0 = time.time()
        out = accuracy(model_dir, args.task, eval_records, args.eval_samples, args.seed, args.max_new_tokens)
        eval_seconds += time.time() - t0
        return out

    def show(stage: str, a: dict) -> str:
        return f"greedy {a['accuracy']:.3f}, sampled pass@1 {a.get('pass1_sampled', float('nan')):.3f} ({stage})"

    acc = {"before": measure(base)}
    print(f"[rlhforge] quickstart: held-out accuracy {show('untrained', acc['before'])}", flush=True)

    t = time.time()
    if args.sft_labels == "format":
        sft_data = run_dir / "sft_format_only.jsonl"
        with open(sft_data, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in format_only_records(args))
        sft_dataset = str(sft_data)
    else:
        sft_dataset = _spec(args, "train", args.train_records)
    sft = SFTConfig(
        model=SFTModelConfig(model_name_or_path=str(base)),
        data=SFTDataConfig(dataset=sft_dataset, input_key="prompt",
                           output_key="completion", apply_chat_template=True, max_len=64),
        train=TrainConfig(batch_size=args.sft_batch_size, micro_batch_size=args.sft_batch_size, max_epochs=1,
                          max_steps=args.sft_steps, seed=args.seed),
        optim=OptimConfig(adam=AdamConfig(lr=args.sft_lr), lr_warmup_ratio=0.05),
        ckpt=CkptConfig(output_dir=str(run_dir / "sft"), path=str(run_dir / "sft" / "checkpoints"),
                        overwrite=True),  # a quick start run again starts over in its folder
        logger=LoggerConfig(logging_steps=max(1, min(10, args.sft_steps // 4))),
    )
    sft.validate()
    run_sft(sft)
    sft_seconds = time.time() - t
    acc["sft"] = measure(run_dir / "sft")
    print(f"[rlhforge] quickstart: held-out accuracy {show('SFT only', acc['sft'])}; now GRPO for {args.rl_steps} "
          f"steps", flush=True)

    t = time.time()
    n_samples = args.rl_prompts * args.group_size
    if n_samples % args.updates_per_rollout:
        raise SystemExit(f"{prog}: error: rl_prompts x group_size = {args.rl_prompts} x {args.group_size} = "
                         f"{n_samples} is not divisible by updates_per_rollout {args.updates_per_rollout}")
    train_bs = n_samples // args.updates_per_rollout
    rl = RLConfig(
        actor=ActorConfig(model_name_or_path=str(run_dir / "sft"), adam=AdamConfig(lr=args.rl_lr),
                          lr_scheduler="constant_with_warmup", lr_warmup_ratio=0.05),
        reward=RewardConfig(remote_url=f"builtin:{args.task}"),
        rollout=RolloutConfig(batch_size=args.rl_prompts, n_samples_per_prompt=args.group_size,
                              max_new_tokens=args.max_new_tokens, temperature=1.0, micro_batch_size=n_samples),
        train=RLTrainConfig(batch_size=train_bs, micro_batch_size=train_bs, max_epochs=1,
                            max_steps=args.rl_steps, num_episodes=1000, seed=args.seed),
        algo=AlgoConfig(advantage=AdvantageConfig(estimator="group_norm"), kl=KLConfig(init_coef=args.kl_coef)),
        data=RLDataConfig(prompt_dataset=_spec(args, "train", args.train_records), input_key="prompt",
                          label_key="answer", apply_chat_template=True, max_len=64),
        eval=RLEvalConfig(dataset=_spec(args, "test", len(eval_records)), steps=args.eval_every, temperature=1.0,
                          n_samples_per_prompt=max(1, args.eval_samples)),
        ckpt=RLCkptConfig(output_dir=str(run_dir / "rl"), path=str(run_dir / "rl" / "checkpoints"),
                          overwrite=True),
        logger=LoggerConfig(logging_steps=1),
    )
    rl.validate()
    run_rl(rl)
    rl_seconds = time.time() - t
    acc["rl"] = measure(run_dir / "rl")
    seconds = {"sft": sft_seconds, "rl": rl_seconds, "eval": eval_seconds, "total": time.time() - start}
    load = {"load_start": load_start, "load_end": _load()}
    write_report(run_dir, args, acc, {**seconds, **load}, len(eval_records))
    print(f"[rlhforge] quickstart: held-out accuracy {show('SFT only', acc['sft'])} -> {show('SFT + GRPO', acc['rl'])} "
          f"in {seconds['total']:.0f} s; report: {run_dir / 'report.md'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
