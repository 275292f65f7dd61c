"""Learning comparison of policy losses on the quickstart's task: GRPO with PPO's clip vs CISPO vs SAPO vs DPPO
(issue 41), each from the same SFT warm start, same data, seed and flags; only ``--actor.policy_loss_type``
differs (each loss at its defaults). Results: ``benchmarks/results/losses.json``.

    python benchmarks/bench_losses.py                          # seed 0, 100 RL steps per loss, then OPD vs GRPO (~8 min)
    python benchmarks/bench_losses.py --seeds 0 1 --rl_steps 150
    python benchmarks/bench_losses.py --losses ppo cispo --sft_steps 5 --rl_steps 3 --eval_size 20 \\
        --runs_dir /tmp/bl --results /tmp/bl.json                                                     # a smoke run
    python benchmarks/bench_losses.py --opd only --seeds 0      # OPD vs GRPO only (3-6 min), merged into the file

OPD vs GRPO (``--opd on``, the default, or ``only``): from the same SFT warm start a teacher is trained with GRPO
(``--teacher_steps``), then plain GRPO, pure on-policy distillation from that teacher (reverse KL, no task
reward) and OPD plus the task reward each run ``--opd_steps`` steps; results in the ``opd_vs_grpo`` section.

Per seed: ``rlhforge quickstart --rl_steps 1`` makes the SFT warm start (the answer format only, so what the
model learns of the task afterwards is RL's) and measures it; then per loss one ``python -m
rlhforge.cli.train_ppo_ray`` process trains GRPO (group_norm advantages, no KL, 2 optimizer steps per rollout,
so the second one is off-policy and the losses differ) with the quickstart's RL flags, and the quickstart's
``accuracy`` measures the result on every held-out problem: greedy accuracy and sampled pass@1 (4 samples per
problem, temperature 1). From each run's metrics.jsonl: the mean train reward over the first and last 10
steps, and the in-training held-out pass@1 curve.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LOSSES = ("ppo", "cispo", "sapo", "dppo")


def _run(cmd: list[str], what: str) -> float:
    print(f"[bench_losses] {what}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    env = {**os.environ, "TQDM_DISABLE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"bench_losses: {what} exited with status {proc.returncode}")
    return time.perf_counter() - t0


def rl_argv(qa, sft_dir: Path, out: Path, loss: str, n_eval: int, estimator: str = "group_norm") -> list[str]:
    """The quickstart's RL configuration (rlhforge/cli/quickstart.py) as train_ppo_ray flags, plus the loss
    (and the advantage estimator: group_norm = GRPO, or on_policy_distill with its --teacher.* flags added)."""
    from rlhforge.cli.quickstart import _spec

    samples = qa.rl_prompts * qa.group_size
    bs = samples // qa.updates_per_rollout
    return [
        "--actor.model_name_or_path", str(sft_dir), "--actor.adam.lr", str(qa.rl_lr),
        "--actor.lr_scheduler", "constant_with_warmup", "--actor.lr_warmup_ratio", "0.05",
        "--actor.policy_loss_type", loss,
        "--reward.remote_url", f"builtin:{qa.task}",
        "--rollout.batch_size", str(qa.rl_prompts), "--rollout.n_samples_per_prompt", str(qa.group_size),
        "--rollout.max_new_tokens", str(qa.max_new_tokens), "--rollout.temperature", "1.0",
        "--rollout.micro_batch_size", str(samples),
        "--train.batch_size", str(bs), "--train.micro_batch_size", str(bs), "--train.max_epochs", "1",
        "--train.max_steps", str(qa.rl_steps), "--train.num_episodes", "1000", "--train.seed", str(qa.seed),
        "--algo.advantage.estimator", estimator, "--algo.kl.init_coef", str(qa.kl_coef),
        "--data.prompt_dataset", _spec(qa, "train", qa.train_records), "--data.input_key", "prompt",
        "--data.label_key", "answer", "--data.apply_chat_template", "--data.max_len", "64",
        "--eval.dataset", _spec(qa, "test", n_eval), "--eval.steps", str(qa.eval_every), "--eval.temperature", "1.0",
        "--eval.n_samples_per_prompt", str(max(1, qa.eval_samples)),
        "--ckpt.output_dir", str(out), "--ckpt.path", str(out / "checkpoints"), "--ckpt.overwrite",
        "--logger.logging_steps", "1", "--logger.progress_bar", "off",
    ]


def curves(run_dir: Path) -> dict:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    reward = [r["rollout/reward_mean"] for r in recs if "rollout/reward_mean" in r]
    k = min(10, len(reward))
    return {"train_reward_first10": round(sum(reward[:k]) / k, 4), "train_reward_last10": round(sum(reward[-k:]) / k, 4),
            "eval_pass1_by_step": {r["step"]: round(r["eval/pass1"], 4) for r in recs if "eval/pass1" in r}}


def run_seed(seed: int, losses, rl_steps: int, eval_size: int, runs: Path, sft_steps: int) -> dict:
    from rlhforge.cli.quickstart import QuickstartArgs, accuracy, held_out_records

    base = runs / f"seed{seed}"
    qa = QuickstartArgs(out=str(base), seed=seed, rl_steps=rl_steps, eval_size=eval_size, sft_steps=sft_steps)
    records = held_out_records(qa)
    sft_only, sft_wall = sft_warm_start(qa, base, seed, eval_size, sft_steps)
    out = {"seed": seed, "sft_only": sft_only, "sft_wall_seconds": round(sft_wall, 1), "losses": {}}
    for loss in losses:
        run_dir = base / f"rl_{loss}"
        wall = _run([sys.executable, "-m", "rlhforge.cli.train_ppo_ray",
                     *rl_argv(qa, base / "sft", run_dir, loss, len(records))], f"seed {seed}: {loss}")
        acc = accuracy(run_dir, qa.task, records, qa.eval_samples, seed, qa.max_new_tokens)
        out["losses"][loss] = {"greedy": round(acc["accuracy"], 4), "sampled_pass1": round(acc["pass1_sampled"], 4),
                               **curves(run_dir), "rl_wall_seconds": round(wall, 1)}
        print(f"[bench_losses] seed {seed} {loss}: greedy {acc['accuracy']:.3f}, sampled pass@1 "
              f"{acc['pass1_sampled']:.3f} (SFT only {out['sft_only']['greedy']:.3f} / "
              f"{out['sft_only']['sampled_pass1']:.3f}), {wall:.0f} s", flush=True)
    return out


def sft_warm_start(qa, base: Path, seed: int, eval_size: int, sft_steps: int) -> tuple[dict, float]:
    """``rlhforge quickstart --rl_steps 1`` in ``base``: the SFT model ``base/sft`` and its held-out scores."""
    wall = _run([sys.executable, "-m", "rlhforge", "quickstart", "--out", str(base), "--seed", str(seed),
                 "--rl_steps", "1", "--eval_size", str(eval_size), "--sft_steps", str(sft_steps)],
                f"seed {seed}: SFT warm start (quickstart)")
    summary = json.loads((base / "summary.json").read_text())
    return {"greedy": round(summary["accuracy_after_sft"], 4),
            "sampled_pass1": round(summary["pass1_sampled_after_sft"], 4)}, wall


#: the arms of the OPD comparison: extra train_ppo_ray flags beside --algo.advantage.estimator on_policy_distill
OPD_ARMS = {"opd": [], "opd_env": ["--algo.distill.env_reward_coef", "1.0"]}


def run_opd_seed(seed: int, teacher_steps: int, opd_steps: int, eval_size: int, runs: Path, sft_steps: int) -> dict:
    """OPD from a stronger teacher vs GRPO, from one SFT warm start: the teacher is GRPO trained ``teacher_steps``
    from it; then ``opd_steps`` of plain GRPO, of pure OPD (reverse KL to the teacher, no task reward) and of OPD
    plus the task reward (env_reward_coef 1) from the same SFT model, same prompts, samples and learning rate."""
    from dataclasses import replace

    from rlhforge.cli.quickstart import QuickstartArgs, accuracy, held_out_records

    base = runs / f"opd_seed{seed}"
    qa = QuickstartArgs(out=str(base), seed=seed, rl_steps=opd_steps, eval_size=eval_size, sft_steps=sft_steps)
    records = held_out_records(qa)
    sft_only, sft_wall = sft_warm_start(qa, base, seed, eval_size, sft_steps)
    out = {"seed": seed, "sft_only": sft_only, "sft_wall_seconds": round(sft_wall, 1), "arms": {}}

    def measure(name: str, run_dir: Path, wall: float) -> dict:
        acc = accuracy(run_dir, qa.task, records, qa.eval_samples, seed, qa.max_new_tokens)
        res = {"greedy": round(acc["accuracy"], 4), "sampled_pass1": round(acc["pass1_sampled"], 4),
               **curves(run_dir), "rl_wall_seconds": round(wall, 1)}
        print(f"[bench_losses] seed {seed} {name}: greedy {res['greedy']:.3f}, sampled pass@1 "
              f"{res['sampled_pass1']:.3f}, {wall:.0f} s", flush=True)
        return res

    teacher = base / "teacher_grpo"
    wall = _run([sys.executable, "-m", "rlhforge.cli.train_ppo_ray",
                 *rl_argv(replace(qa, rl_steps=teacher_steps), base / "sft", teacher, "ppo", len(records))],
                f"seed {seed}: teacher (GRPO, {teacher_steps} steps)")
    out["teacher"] = measure("teacher", teacher, wall)
    run_dir = base / "grpo"
    wall = _run([sys.executable, "-m", "rlhforge.cli.train_ppo_ray",
                 *rl_argv(qa, base / "sft", run_dir, "ppo", len(records))], f"seed {seed}: grpo")
    out["arms"]["grpo"] = measure("grpo", run_dir, wall)
    for arm, extra in OPD_ARMS.items():
        run_dir = base / arm
        argv = [*rl_argv(qa, base / "sft", run_dir, "ppo", len(records), estimator="on_policy_distill"),
                "--teacher.model_name_or_path", str(teacher), *extra]
        wall = _run([sys.executable, "-m", "rlhforge.cli.train_ppo_ray", *argv], f"seed {seed}: {arm}")
        out["arms"][arm] = measure(arm, run_dir, wall)
        recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        kl = [r["distill/reverse_kl"] for r in recs if "distill/reverse_kl" in r]
        out["arms"][arm]["reverse_kl_first_last"] = [round(kl[0], 4), round(kl[-1], 4)] if kl else None
    return out


def run_opd(a, argv) -> dict:
    """The OPD vs GRPO section of the results (``--opd on|only``)."""
    t0, load = time.time(), os.getloadavg()[0]
    seeds = [run_opd_seed(s, a.teacher_steps, a.opd_steps, a.eval_size, Path(a.runs_dir).resolve(), a.sft_steps)
             for s in a.seeds]
    arms = ["grpo", *OPD_ARMS]
    mean = {arm: {k: round(sum(s["arms"][arm][k] for s in seeds) / len(seeds), 4)
                  for k in ("greedy", "sampled_pass1", "train_reward_first10", "train_reward_last10")} for arm in arms}
    mean["teacher"] = {k: round(sum(s["teacher"][k] for s in seeds) / len(seeds), 4) for k in ("greedy", "sampled_pass1")}
    mean["sft_only"] = {k: round(sum(s["sft_only"][k] for s in seeds) / len(seeds), 4) for k in ("greedy", "sampled_pass1")}
    return {
        "what": f"on-policy distillation (--algo.advantage.estimator on_policy_distill, reverse KL, coef 1, discount 0) "
                f"from a teacher trained with GRPO for {a.teacher_steps} steps, vs plain GRPO, both {a.opd_steps} steps "
                "from the teacher's SFT warm start with the quickstart's RL flags (16 prompts x 8 samples, lr 1e-3, "
                "2 optimizer steps per rollout); opd: no task reward; opd_env: + the task reward (group-centred, "
                "env_reward_coef 1); greedy accuracy and sampled pass@1 on every held-out problem",
        "command": "python benchmarks/bench_losses.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "task": "larger", "sft_steps": a.sft_steps, "teacher_steps": a.teacher_steps, "opd_steps": a.opd_steps,
        "eval_size": a.eval_size or "all", "seeds": seeds, "mean_over_seeds": mean,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "load_avg_1min_start": round(load, 2), "load_avg_1min_end": round(os.getloadavg()[0], 2)},
        "elapsed_seconds": round(time.time() - t0, 1),
    }


def summarize(seeds: list[dict], losses) -> dict:
    def mean(xs):
        return round(sum(xs) / len(xs), 4)

    return {loss: {key: mean([s["losses"][loss][key] for s in seeds])
                   for key in ("greedy", "sampled_pass1", "train_reward_first10", "train_reward_last10")}
            for loss in losses}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--losses", nargs="+", default=list(LOSSES))
    p.add_argument("--rl_steps", type=int, default=100)
    p.add_argument("--sft_steps", type=int, default=400, help="the quickstart's SFT warm start")
    p.add_argument("--eval_size", type=int, default=0, help="held-out problems (0: every one of the test pool)")
    p.add_argument("--runs_dir", default="runs/bench_losses")
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "losses.json"))
    p.add_argument("--opd", choices=("on", "off", "only"), default="on",
                   help="also compare on-policy distillation from a GRPO-trained teacher with GRPO (the results' "
                        "opd_vs_grpo section); only: just that, merged into an existing results file")
    p.add_argument("--teacher_steps", type=int, default=60, help="GRPO steps that make the OPD teacher")
    p.add_argument("--opd_steps", type=int, default=30, help="steps of each arm of the OPD comparison")
    a = p.parse_args(argv)
    from rlhforge.config.rl_losses import POLICY_LOSS_TYPES

    bad = [x for x in a.losses if x not in POLICY_LOSS_TYPES]
    if bad:
        p.error(f"--losses: unknown {bad}; valid: {', '.join(POLICY_LOSS_TYPES)}")
    if a.opd == "only":  # the OPD section alone, beside the losses comparison already in the file
        path = Path(a.results)
        result = json.loads(path.read_text()) if path.exists() else {}
        result["opd_vs_grpo"] = run_opd(a, argv)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result["opd_vs_grpo"]["mean_over_seeds"], indent=2))
        print(f"[bench_losses] wrote the opd_vs_grpo section of {a.results}")
        return 0
    t0 = time.time()
    load = os.getloadavg()[0]
    seeds = [run_seed(s, a.losses, a.rl_steps, a.eval_size, Path(a.runs_dir).resolve(), a.sft_steps) for s in a.seeds]
    result = {
        "what": "GRPO (group_norm advantages) on the quickstart task from one SFT warm start per seed; only "
                "--actor.policy_loss_type differs, each loss at its defaults (ppo: clip 0.2; cispo: eps_high 5, no "
                "lower clip; sapo: tau 1.0/1.05; dppo: delta 0.2/0.2), token-mean aggregation for all",
        "command": "python benchmarks/bench_losses.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "task": "larger", "sft_steps": a.sft_steps, "rl_steps": a.rl_steps, "eval_size": a.eval_size or "all", "seeds": seeds,
        "mean_over_seeds": summarize(seeds, a.losses),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(),
                    "load_avg_1min_start": round(load, 2), "load_avg_1min_end": round(os.getloadavg()[0], 2)},
        "elapsed_seconds": round(time.time() - t0, 1),
    }
    if a.opd == "on":
        result["opd_vs_grpo"] = run_opd(a, argv)
    Path(a.results).parent.mkdir(parents=True, exist_ok=True)
    Path(a.results).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["mean_over_seeds"], indent=2))
    print(f"[bench_losses] wrote {a.results} in {result['elapsed_seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
