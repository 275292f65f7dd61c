"""``rlhforge quickstart``: the README's main job on the embedded default.

Builds a tiny model and tokenizer, measures greedy accuracy on the held-out split of a built-in
task, warm-starts it with a *brief* SFT on the task's training split (enough to learn the answer
format, not the task), then trains it with GRPO (``rlhforge rl``: group_norm advantages, PPO clip,
the task's exact-answer reward) on CPU, measures again after each stage and writes a report
(``report.md``, ``curves.png`` with reward / KL / entropy / length / held-out accuracy per RL step,
``summary.json``) into the run directory. The rise from "after SFT" to "after RL" is RL alone.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class QuickstartArgs:
    """Tiny model + built-in task: SFT warm start, then GRPO, end to end on CPU in minutes."""

    out: str = "runs/quickstart"
    """Run directory (models, metrics, report)."""
    task: str = "arithmetic"
    """Built-in task (see docs/data.md)."""
    task_params: str = "max=14"
    """Task parameters (``&``-separated, see docs/data.md), e.g. ``max=14`` for operands 0..14."""
    seed: int = 0
    """Seed of the model, data order and sampling."""
    sft_steps: int = 150
    """Optimizer steps of the SFT warm start (brief on purpose: RL does the rest)."""
    sft_batch_size: int = 32
    """Samples per SFT step."""
    sft_lr: float = 2e-3
    """Peak SFT learning rate."""
    rl_steps: int = 150
    """GRPO steps."""
    rl_prompts: int = 16
    """Prompts per GRPO step (rollout.batch_size)."""
    group_size: int = 8
    """Samples per prompt (rollout.n_samples_per_prompt)."""
    rl_lr: float = 2e-4
    """Peak GRPO learning rate."""
    kl_coef: float = 0.0
    """KL coefficient to the SFT model (0: no reference model, the usual GRPO-on-verifiable-rewards choice)."""
    eval_every: int = 25
    """Held-out evaluation every N GRPO steps."""
    threads: int = 1
    """torch CPU threads (1 is fastest for tiny models on a busy machine)."""


def _spec(args: QuickstartArgs, split: str, n: int) -> str:
    params = f"&{args.task_params}" if args.task_params else ""
    return f"builtin:{args.task}?n={n}&seed={args.seed}{params}@{split}"


def held_out_records(args: QuickstartArgs) -> list[dict]:
    """Every distinct problem of the task's test pool, once."""
    from rlhforge.data.builtin import generate_builtin
    from rlhforge.data.builtin import parse_builtin_spec

    spec = parse_builtin_spec(_spec(args, "test", 1))
    params = {k: v for k, v in spec.params.items() if k not in ("n", "seed")}
    seen, out = set(), []
    for r in generate_builtin(args.task, "test", n=20000, seed=args.seed, **params):
        if r["prompt"] not in seen:
            seen.add(r["prompt"])
            out.append(r)
    return out


def accuracy(model_dir: str | Path, task: str, records: list[dict]) -> dict:
    """Greedy exact-answer accuracy of the model in ``model_dir`` on built-in ``records``."""
    import asyncio

    from transformers import AutoTokenizer

    from rlhforge.data.builtin import check_answer
    from rlhforge.rollout.engine import SamplingParams
    from rlhforge.rollout.hf_engine import HFEngine

    tok = AutoTokenizer.from_pretrained(model_dir)
    engine = HFEngine.from_pretrained(str(model_dir), tok, batch_size=64)
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for r in records]
    outs = asyncio.run(engine.generate(prompts, [SamplingParams(max_new_tokens=8, temperature=0.0)] * len(prompts)))
    texts = [tok.decode(o.token_ids, skip_special_tokens=True) for o in outs]
    scores = [check_answer(task, t, r["answer"]) for t, r in zip(texts, records)]
    samples = [{"prompt": r["prompt"], "completion": t, "answer": r["answer"]} for r, t in zip(records[:6], texts)]
    return {"accuracy": sum(scores) / len(scores), "samples": samples}


def write_report(run_dir: Path, args: QuickstartArgs, acc: dict, seconds: dict, n_eval: int) -> None:
    from rlhforge.tracking.metrics import read_metrics
    from rlhforge.tracking.report import plot_curves

    metrics = read_metrics(run_dir / "rl")
    keys = ["rollout/reward_mean", "eval/pass1", "actor/kl_ref", "actor/approx_kl", "actor/entropy",
            "rollout/response_length"]
    plot = plot_curves(metrics, keys, run_dir / "curves.png")
    sft_plot = plot_curves(read_metrics(run_dir / "sft"), ["train/loss"], run_dir / "sft_loss.png")
    b, s, r = acc["before"]["accuracy"], acc["sft"]["accuracy"], acc["rl"]["accuracy"]
    lines = [
        f"# rlhforge quickstart: {args.task} ({args.task_params})",
        "",
        f"Held-out greedy accuracy on all {n_eval} test problems (never seen in training):",
        "",
        "| stage | accuracy |",
        "|---|---|",
        f"| tiny model, untrained | {b:.3f} |",
        f"| after SFT warm start ({args.sft_steps} steps) | {s:.3f} |",
        f"| after GRPO ({args.rl_steps} steps) | **{r:.3f}** |",
        "",
        f"RL alone: **{s:.3f} -> {r:.3f}** ({r - s:+.3f}).",
        "",
        f"- SFT: {args.sft_steps} steps x {args.sft_batch_size} samples, lr {args.sft_lr}",
        f"- GRPO: {args.rl_steps} steps x {args.rl_prompts} prompts x {args.group_size} samples, lr {args.rl_lr}, "
        f"KL coef {args.kl_coef}, seed {args.seed}",
        f"- wall time: SFT {seconds['sft']:.0f} s, GRPO {seconds['rl']:.0f} s, total {seconds['total']:.0f} s",
        "",
    ]
    if plot:
        lines += [f"![GRPO curves]({plot.name})", ""]
    if sft_plot:
        lines += [f"![SFT loss]({sft_plot.name})", ""]
    lines += ["Samples after GRPO:", "", "| prompt | completion | answer |", "|---|---|---|"]
    lines += [f"| {x['prompt']} | {x['completion']!r} | {x['answer']} |" for x in acc["rl"]["samples"]]
    (run_dir / "report.md").write_text("\n".join(lines) + "\n")
    summary = {"task": args.task, "task_params": args.task_params, "seed": args.seed, "n_eval": n_eval,
               "accuracy_before": b, "accuracy_after_sft": s, "accuracy_after_rl": r, "rl_gain": r - s,
               "seconds": seconds}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))


def main(argv: list[str] | None = None, prog: str = "rlhforge quickstart") -> int:
    import tyro
    import torch

    from rlhforge.cli.env import setup_cli_environment

    setup_cli_environment()
    args = tyro.cli(QuickstartArgs, args=argv, prog=prog, use_underscores=True)
    torch.set_num_threads(max(1, args.threads))

    from rlhforge.cli.train_ppo_ray import run as run_rl
    from rlhforge.cli.train_sft import run as run_sft
    from rlhforge.config.components import AdamConfig, CkptConfig, EvalConfig, LoggerConfig, ModelConfig
    from rlhforge.config.components import OptimConfig, TrainConfig
    from rlhforge.config.rl import (ActorConfig, AlgoConfig, AdvantageConfig, KLConfig, RLCkptConfig, RLConfig,
                                    RLDataConfig, RLEvalConfig, RLTrainConfig, RewardConfig, RolloutConfig)
    from rlhforge.config.sft import SFTConfig, SFTDataConfig
    from rlhforge.models.tiny import build_tiny_model

    start = time.time()
    run_dir = Path(args.out)
    base = build_tiny_model(run_dir / "base", seed=args.seed)
    eval_records = held_out_records(args)
    acc = {"before": accuracy(base, args.task, eval_records)}
    print(f"[rlhforge] quickstart: held-out accuracy of the untrained model {acc['before']['accuracy']:.3f}")

    t = time.time()
    sft = SFTConfig(
        model=ModelConfig(model_name_or_path=str(base)),
        data=SFTDataConfig(dataset=_spec(args, "train", 20000), input_key="prompt", output_key="completion",
                           apply_chat_template=True, max_len=64),
        train=TrainConfig(batch_size=args.sft_batch_size, micro_batch_size=args.sft_batch_size, max_epochs=1,
                          max_steps=args.sft_steps, seed=args.seed),
        optim=OptimConfig(adam=AdamConfig(lr=args.sft_lr), lr_warmup_ratio=0.05),
        ckpt=CkptConfig(output_dir=str(run_dir / "sft"), path=str(run_dir / "sft" / "checkpoints")),
        logger=LoggerConfig(logging_steps=10),
    )
    sft.validate()
    run_sft(sft)
    sft_seconds = time.time() - t
    acc["sft"] = accuracy(run_dir / "sft", args.task, eval_records)
    print(f"[rlhforge] quickstart: after SFT {acc['sft']['accuracy']:.3f}; now GRPO for {args.rl_steps} steps")

    t = time.time()
    n_samples = args.rl_prompts * args.group_size
    rl = RLConfig(
        actor=ActorConfig(model_name_or_path=str(run_dir / "sft"), adam=AdamConfig(lr=args.rl_lr),
                          lr_scheduler="constant_with_warmup", lr_warmup_ratio=0.02),
        reward=RewardConfig(remote_url=f"builtin:{args.task}"),
        rollout=RolloutConfig(batch_size=args.rl_prompts, n_samples_per_prompt=args.group_size, max_new_tokens=8,
                              temperature=1.0, micro_batch_size=n_samples),
        train=RLTrainConfig(batch_size=n_samples // 2, micro_batch_size=n_samples // 2, max_epochs=1,
                            max_steps=args.rl_steps, num_episodes=1000, seed=args.seed),
        algo=AlgoConfig(advantage=AdvantageConfig(estimator="group_norm"), kl=KLConfig(init_coef=args.kl_coef)),
        data=RLDataConfig(prompt_dataset=_spec(args, "train", 20000), input_key="prompt", label_key="answer",
                          apply_chat_template=True, max_len=64),
        eval=RLEvalConfig(dataset=_spec(args, "test", len(eval_records)), steps=args.eval_every, temperature=0.0,
                          n_samples_per_prompt=1),
        ckpt=RLCkptConfig(output_dir=str(run_dir / "rl"), path=str(run_dir / "rl" / "checkpoints")),
        logger=LoggerConfig(logging_steps=1),
    )
    rl.validate()
    run_rl(rl)
    rl_seconds = time.time() - t
    acc["rl"] = accuracy(run_dir / "rl", args.task, eval_records)
    seconds = {"sft": sft_seconds, "rl": rl_seconds, "total": time.time() - start}
    write_report(run_dir, args, acc, seconds, len(eval_records))
    print(f"[rlhforge] quickstart: held-out accuracy {acc['before']['accuracy']:.3f} (untrained) -> "
          f"{acc['sft']['accuracy']:.3f} (SFT) -> {acc['rl']['accuracy']:.3f} (GRPO) in {seconds['total']:.0f} s; "
          f"report: {run_dir / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
