"""``rlhforge quickstart``: the README's main job on the embedded default.

Builds a tiny model and tokenizer, measures greedy accuracy on the held-out split of a built-in
task, fine-tunes it (SFT) on the task's training split on CPU, measures again and writes a report
(``report.md`` + ``curves.png``) into the run directory.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class QuickstartArgs:
    """Tiny model + built-in task, end to end on CPU in minutes."""

    out: str = "runs/quickstart"
    """Run directory (model, metrics, report)."""
    task: str = "arithmetic"
    """Built-in task (see docs/data.md)."""
    seed: int = 0
    """Seed of the model, data order and sampling."""
    sft_steps: int = 300
    """Optimizer steps of supervised fine-tuning."""
    batch_size: int = 32
    """Samples per optimizer step."""
    lr: float = 2e-3
    """Peak learning rate."""
    n_eval: int = 200
    """Held-out problems for accuracy."""


def accuracy(model_dir: str | Path, task: str, records: list[dict]) -> dict:
    """Greedy exact-answer accuracy of the model in ``model_dir`` on built-in ``records``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhforge.data.builtin import check_answer
    from rlhforge.rollout.hf_generate import generate_ids

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for r in records]
    outs = generate_ids(model, prompts, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                        max_new_tokens=8)
    texts = [tok.decode(o, skip_special_tokens=True) for o in outs]
    scores = [check_answer(task, t, r["answer"]) for t, r in zip(texts, records)]
    samples = [{"prompt": r["prompt"], "completion": t, "answer": r["answer"]} for r, t in zip(records[:5], texts)]
    return {"accuracy": sum(scores) / len(scores), "samples": samples}


def write_report(run_dir: Path, args: QuickstartArgs, before: dict, after: dict, seconds: float) -> None:
    from rlhforge.tracking.metrics import read_metrics
    from rlhforge.tracking.report import plot_curves

    metrics = read_metrics(run_dir / "sft")
    plot = plot_curves(metrics, ["train/loss", "eval/loss"], run_dir / "curves.png")
    lines = [
        f"# rlhforge quickstart: {args.task}",
        "",
        f"- held-out greedy accuracy: **{before['accuracy']:.3f} -> {after['accuracy']:.3f}** "
        f"({args.n_eval} problems never seen in training)",
        f"- SFT: {args.sft_steps} steps x {args.batch_size} samples, lr {args.lr}, seed {args.seed}",
        f"- wall time: {seconds:.0f} s",
        "",
    ]
    if plot:
        lines += [f"![curves]({plot.name})", ""]
    lines += ["| prompt | completion | answer |", "|---|---|---|"]
    lines += [f"| {s['prompt']} | {s['completion']!r} | {s['answer']} |" for s in after["samples"]]
    (run_dir / "report.md").write_text("\n".join(lines) + "\n")
    summary = {"task": args.task, "seed": args.seed, "accuracy_before": before["accuracy"],
               "accuracy_after": after["accuracy"], "seconds": seconds}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))


def main(argv: list[str] | None = None, prog: str = "rlhforge quickstart") -> int:
    import tyro

    from rlhforge.cli.train_sft import run as run_sft
    from rlhforge.config.components import CkptConfig, DataConfig, EvalConfig, LoggerConfig, ModelConfig, OptimConfig
    from rlhforge.config.components import AdamConfig, TrainConfig
    from rlhforge.config.sft import SFTConfig, SFTDataConfig
    from rlhforge.data.builtin import generate_builtin
    from rlhforge.models.tiny import build_tiny_model

    args = tyro.cli(QuickstartArgs, args=argv, prog=prog, use_underscores=True)
    start = time.time()
    run_dir = Path(args.out)
    base = build_tiny_model(run_dir / "base", seed=args.seed)
    eval_records = generate_builtin(args.task, "test", n=args.n_eval, seed=args.seed)
    before = accuracy(base, args.task, eval_records)
    print(f"[rlhforge] quickstart: held-out accuracy before training {before['accuracy']:.3f}")
    cfg = SFTConfig(
        model=ModelConfig(model_name_or_path=str(base)),
        data=SFTDataConfig(dataset=f"builtin:{args.task}?n=20000&seed={args.seed}", input_key="prompt",
                           output_key="completion", apply_chat_template=True, max_len=64),
        train=TrainConfig(batch_size=args.batch_size, micro_batch_size=args.batch_size, max_epochs=1,
                          max_steps=args.sft_steps, seed=args.seed),
        optim=OptimConfig(adam=AdamConfig(lr=args.lr), lr_warmup_ratio=0.05),
        eval=EvalConfig(dataset=f"builtin:{args.task}?n={args.n_eval}&seed={args.seed}@test",
                        steps=max(1, args.sft_steps // 5)),
        ckpt=CkptConfig(output_dir=str(run_dir / "sft"), path=str(run_dir / "sft" / "checkpoints")),
        logger=LoggerConfig(logging_steps=10),
    )
    cfg.validate()
    run_sft(cfg)
    after = accuracy(run_dir / "sft", args.task, eval_records)
    seconds = time.time() - start
    write_report(run_dir, args, before, after, seconds)
    print(f"[rlhforge] quickstart: held-out accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f} "
          f"in {seconds:.0f} s; report: {run_dir / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
