"""``rlhforge quickstart --task shape_colour``: the quick start for vision-language models (docs/vlm.md).

Builds a tiny random Qwen2-VL with its processor (:func:`rlhforge.models.tiny_vlm.build_tiny_vlm`),
measures held-out accuracy on the test split of the built-in image task ``shape_colour`` ("What colour
is the shape?" about a synthetic image, :mod:`rlhforge.data.builtin_vlm`), warm-starts it with a
*brief* SFT (``rlhforge sft`` with images: enough to answer with a colour word, not to read the image
well), then trains it with GRPO (``rlhforge rl``: the HF engine generates from the images, the trainer's
log-probs use the same pixels, reward = the task's exact answer check). Accuracy after each stage
(greedy, and sampled pass@1 at temperature 1), the report (``report.md``, ``summary.json``) and the
metrics go to the run directory; ``python benchmarks/bench_quickstart.py --vlm`` runs it over seeds.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

VLM_TASKS = ("shape_colour",)


@dataclass(frozen=True)
class VLMQuickstartArgs:
    """Tiny VLM + built-in image task: SFT warm start, then GRPO, end to end on CPU in minutes."""

    task: str = "shape_colour"
    """Built-in image task (docs/vlm.md)."""
    out: str = "runs/quickstart_vlm"
    """Run directory (models, metrics, report)."""
    task_params: str = "colours=4"
    """Task parameters (``&``-separated), e.g. ``colours=4``."""
    seed: int = 0
    """Seed of the model, data order and sampling."""
    sft_steps: int = 150
    """Optimizer steps of the SFT warm start, on the questions *without* their images and random colour
    answers (``format_only=1``): it teaches the answer format, never the image; RL does the rest."""
    sft_batch_size: int = 16
    sft_lr: float = 2e-3
    rl_steps: int = 200
    """GRPO steps (one rollout each)."""
    rl_prompts: int = 8
    """Prompts per GRPO step."""
    group_size: int = 8
    """Samples per prompt."""
    rl_lr: float = 5e-4
    max_new_tokens: int = 4
    """Response length limit (the answer is one word plus end-of-turn)."""
    eval_size: int = 64
    """Held-out problems."""
    eval_samples: int = 4
    """Samples per held-out problem for sampled pass@1 (temperature 1)."""
    train_records: int = 4000
    """Problems drawn for SFT and for the RL prompt stream."""
    threads: int = 1
    """torch CPU threads."""


def accuracy(model_dir, task: str, records: list[dict], samples: int, seed: int, max_new_tokens: int) -> dict:
    """Greedy accuracy and sampled pass@1 of the VLM in ``model_dir`` on image ``records``."""
    import asyncio

    from rlhforge.data.builtin import check_answer
    from rlhforge.data.records import record_ref
    from rlhforge.data.vlm_prompts import vlm_prompt
    from rlhforge.models.vlm import load_processor
    from rlhforge.rollout.engine import SamplingParams
    from rlhforge.rollout.hf_engine import HFEngine

    proc = load_processor(str(model_dir))
    engine = HFEngine.from_pretrained(str(model_dir), proc, batch_size=128)
    items = [vlm_prompt(r, proc, record_ref(r, i), input_key="prompt")[1:] for i, r in enumerate(records)]
    ids, vision = [x[0] for x in items], [x[1] for x in items]

    def score(outs, reps: int) -> list[float]:
        return [check_answer(task, proc.decode(o.token_ids, skip_special_tokens=True), records[k // reps]["answer"])
                for k, o in enumerate(outs)]

    greedy = asyncio.run(engine.generate(ids, [SamplingParams(max_new_tokens, temperature=0.0)] * len(ids),
                                         vision=vision))
    result = {"accuracy": sum(score(greedy, 1)) / len(ids),
              "samples": [{"answer": r["answer"], "completion": proc.decode(o.token_ids, skip_special_tokens=True)}
                          for r, o in zip(records[:6], greedy)]}
    if samples > 0:
        params = [SamplingParams(max_new_tokens, temperature=1.0, seed=seed * 1_000_003 + i * 131 + j)
                  for i in range(len(ids)) for j in range(samples)]
        outs = asyncio.run(engine.generate([p for p in ids for _ in range(samples)], params,
                                           vision=[v for v in vision for _ in range(samples)]))
        hits = score(outs, samples)
        result["pass1_sampled"] = sum(hits) / len(hits)
    return result


def _write_report(run_dir: Path, args: VLMQuickstartArgs, acc: dict, seconds: dict) -> None:
    stages = [("before", "tiny VLM, untrained"), ("sft", f"after SFT warm start ({args.sft_steps} steps) = SFT only"),
              ("rl", f"after SFT + GRPO ({args.rl_steps} steps)")]
    g = {k: acc[k]["accuracy"] for k, _ in stages}
    p = {k: acc[k].get("pass1_sampled", float("nan")) for k, _ in stages}
    lines = [f"# rlhforge quickstart (VLM): {args.task} ({args.task_params}), seed {args.seed}", "",
             f"Held-out accuracy on {args.eval_size} test images (never seen in training).", "",
             "| stage | greedy accuracy | sampled pass@1 |", "|---|---|---|"]
    lines += [f"| {name} | {g[k]:.3f} | {p[k]:.3f} |" for k, name in stages]
    lines += ["", f"RL alone: greedy {g['sft']:.3f} -> {g['rl']:.3f}, sampled pass@1 {p['sft']:.3f} -> {p['rl']:.3f}.",
              "", f"- wall time: SFT {seconds['sft']:.0f} s, GRPO {seconds['rl']:.0f} s, total {seconds['total']:.0f} s",
              "", "| answer | greedy completion after GRPO |", "|---|---|"]
    lines += [f"| {x['answer']} | {x['completion']!r} |" for x in acc["rl"]["samples"]]
    (run_dir / "report.md").write_text("\n".join(lines) + "\n")
    summary = {"task": args.task, "task_params": args.task_params, "seed": args.seed, "n_eval": args.eval_size,
               "eval_samples": args.eval_samples, "vlm": True,
               "accuracy_before": g["before"], "accuracy_after_sft": g["sft"], "accuracy_after_rl": g["rl"],
               "rl_gain": g["rl"] - g["sft"], "pass1_sampled_before": p["before"], "pass1_sampled_after_sft": p["sft"],
               "pass1_sampled_after_rl": p["rl"], "rl_gain_pass1_sampled": p["rl"] - p["sft"],
               "args": {k: getattr(args, k) for k in args.__dataclass_fields__}, "seconds": seconds}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))


def main(argv: list[str] | None = None, prog: str = "rlhforge quickstart") -> int:
    import tyro
    import torch

    from rlhforge.cli.env import setup_cli_environment

    setup_cli_environment()
    args = tyro.cli(VLMQuickstartArgs, args=argv, prog=prog, use_underscores=True)
    torch.set_num_threads(max(1, args.threads))

    from rlhforge.cli.train_ppo_ray import run as run_rl
    from rlhforge.cli.train_sft import run as run_sft
    from rlhforge.config.components import AdamConfig, CkptConfig, LoggerConfig, OptimConfig, TrainConfig
    from rlhforge.config.rl import (ActorConfig, AdvantageConfig, AlgoConfig, KLConfig, RLCkptConfig, RLConfig,
                                    RLDataConfig, RLTrainConfig, RewardConfig, RolloutConfig)
    from rlhforge.config.sft import SFTConfig, SFTDataConfig, SFTModelConfig
    from rlhforge.data.builtin import builtin_spec, generate_builtin, parse_builtin_spec
    from rlhforge.models.tiny_vlm import build_tiny_vlm

    if args.task not in VLM_TASKS:
        raise SystemExit(f"{prog}: error: --task {args.task!r} is not an image task ({', '.join(VLM_TASKS)})")
    def spec(split: str, n: int, extra: str = "") -> str:
        return builtin_spec(args.task, split, n, args.seed, "&".join(x for x in (args.task_params, extra) if x))

    start = time.time()
    run_dir = Path(args.out)
    base = build_tiny_vlm(run_dir / "base", arch="qwen2_vl", seed=args.seed)
    params = {k: v for k, v in parse_builtin_spec(spec("test", 1)).params.items() if k not in ("n", "seed")}
    eval_records = generate_builtin(args.task, "test", n=args.eval_size, seed=args.seed, **params)

    def measure(model_dir) -> dict:
        return accuracy(model_dir, args.task, eval_records, args.eval_samples, args.seed, args.max_new_tokens)

    def show(stage: str, a: dict) -> str:
        return f"greedy {a['accuracy']:.3f}, sampled pass@1 {a.get('pass1_sampled', float('nan')):.3f} ({stage})"

    acc = {"before": measure(base)}
    print(f"[rlhforge] quickstart (VLM): held-out accuracy {show('untrained', acc['before'])}", flush=True)
    t = time.time()
    sft = SFTConfig(
        model=SFTModelConfig(model_name_or_path=str(base)),
        data=SFTDataConfig(dataset=spec("train", args.train_records, "format_only=1"),
                           input_key="prompt",
                           output_key="completion", apply_chat_template=True, max_len=128),
        train=TrainConfig(batch_size=args.sft_batch_size, micro_batch_size=args.sft_batch_size, max_epochs=1,
                          max_steps=args.sft_steps, seed=args.seed),
        optim=OptimConfig(adam=AdamConfig(lr=args.sft_lr), lr_warmup_ratio=0.05),
        ckpt=CkptConfig(output_dir=str(run_dir / "sft"), path=str(run_dir / "sft" / "checkpoints"),
                        overwrite=True),  # a quick start run again starts over in its folder
        logger=LoggerConfig(logging_steps=max(1, min(10, args.sft_steps // 4))),
    )
    sft.validate()
    run_sft(sft)
    seconds = {"sft": time.time() - t}
    acc["sft"] = measure(run_dir / "sft")
    print(f"[rlhforge] quickstart (VLM): held-out accuracy {show('SFT only', acc['sft'])}; now GRPO for "
          f"{args.rl_steps} steps", flush=True)
    t = time.time()
    n_samples = args.rl_prompts * args.group_size
    rl = RLConfig(
        actor=ActorConfig(model_name_or_path=str(run_dir / "sft"), adam=AdamConfig(lr=args.rl_lr),
                          lr_scheduler="constant_with_warmup", lr_warmup_ratio=0.05, freeze_visual_encoder=False),
        reward=RewardConfig(remote_url=f"builtin:{args.task}"),
        rollout=RolloutConfig(batch_size=args.rl_prompts, n_samples_per_prompt=args.group_size,
                              max_new_tokens=args.max_new_tokens, temperature=1.0, micro_batch_size=n_samples),
        train=RLTrainConfig(batch_size=n_samples, micro_batch_size=n_samples, max_epochs=1, max_steps=args.rl_steps,
                            num_episodes=1000, seed=args.seed),
        algo=AlgoConfig(advantage=AdvantageConfig(estimator="group_norm"), kl=KLConfig(init_coef=0.0)),
        data=RLDataConfig(prompt_dataset=spec("train", args.train_records), input_key="prompt",
                          label_key="answer", apply_chat_template=True, max_len=128),
        ckpt=RLCkptConfig(output_dir=str(run_dir / "rl"), path=str(run_dir / "rl" / "checkpoints"),
                          overwrite=True),
        logger=LoggerConfig(logging_steps=1),
    )
    rl.validate()
    run_rl(rl)
    seconds["rl"] = time.time() - t
    acc["rl"] = measure(run_dir / "rl")
    seconds["total"] = time.time() - start
    _write_report(run_dir, args, acc, seconds)
    print(f"[rlhforge] quickstart (VLM): held-out accuracy {show('SFT only', acc['sft'])} -> "
          f"{show('SFT + GRPO', acc['rl'])} in {seconds['total']:.0f} s; report: {run_dir / 'report.md'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
