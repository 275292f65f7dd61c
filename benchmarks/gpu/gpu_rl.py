"""Stages ``grpo`` and ``trl`` of the GPU check (run in a child process by check_rl_child.py).

``grpo``: GRPO steps through rlhforge's own CLI entry, ``rlhforge.cli.train_ppo_ray.main(flags)`` (HF
engine in the driver, no Ray, no vLLM; ``--ds.strategy torch`` or ``fsdp2``: FSDP2 makes its own process
group of one). Only addition: ``RLTrainer``'s phase methods are wrapped to time them and to record
``torch.cuda.max_memory_allocated`` per phase (reset before each), since the run's metrics carry one peak.

``trl``: TRL's ``GRPOTrainer`` (HF generation, ``use_vllm=False``) on the same model folder, the same
built-in arithmetic prompts, the same reward and the same rollout shape, with benchmarks/bench_vs_trl.py's
settings (beta 0, one iteration, no gradient checkpointing), timed and measured alike. Stage ``trl_vllm``
(issue 44): the same with ``use_vllm=True, vllm_mode="colocate"`` (TRL's vLLM in the trainer's process, its
default ``vllm_gpu_memory_utilization`` 0.3, no sleep); its "generation" phase (``GRPOTrainer._generate``)
includes TRL's weight push into vLLM. Stage ``grpo_vllm`` runs ``grpo`` with the hybrid-engine flags (Ray
workers: the driver's CUDA peaks are not the models', so only times are recorded per phase).
"""

from __future__ import annotations

import functools
import resource
import time
from pathlib import Path

from gpu_metrics import mean, read_metrics, summarize_rl

#: --reward.remote_url file of the RL stages (TRL gets the same function): a deterministic reward that varies
#: with the response, so GRPO's advantages are non-zero on a random model and the weights really move
REWARD_PY = '''
def reward_func(queries, prompts, labels, **kwargs):
    rewards = [(len(r) % 3) / 2.0 for r in kwargs["responses"]]
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
'''


def length_reward(text: str) -> float:
    return (len(text) % 3) / 2.0


class PhaseMeter:
    """Time and CUDA peak of each call of the wrapped methods, appended to ``rows`` (and saved)."""

    def __init__(self, res, cuda: bool):
        import torch

        self.torch, self.cuda, self.res, self.t0 = torch, cuda, res, time.time()
        self.rows: list[dict] = []

    def begin(self) -> float:
        if self.cuda:
            self.torch.cuda.synchronize()
            self.torch.cuda.reset_peak_memory_stats()
        return time.perf_counter()

    def end(self, phase: str, t: float) -> None:
        row = {"phase": phase, "at_s": round(time.time() - self.t0, 2), "s": round(time.perf_counter() - t, 4)}
        if self.cuda:
            self.torch.cuda.synchronize()
            row["peak_gb"] = round(self.torch.cuda.max_memory_allocated() / 2**30, 3)
            row["allocated_gb_after"] = round(self.torch.cuda.memory_allocated() / 2**30, 3)
        self.rows.append(row)
        self.res.save()

    def wrap(self, cls, method: str, phase: str) -> None:
        orig = getattr(cls, method)

        @functools.wraps(orig)
        def timed(obj, *args, **kwargs):
            t = self.begin()
            try:
                return orig(obj, *args, **kwargs)
            finally:
                self.end(phase, t)

        setattr(cls, method, timed)


def run_grpo(spec: dict, res) -> None:
    import torch

    from rlhforge.cli import train_ppo_ray
    from rlhforge.trainers.rl import RLTrainer

    cuda = spec["device"] == "cuda"
    if spec.get("needs_vllm") and (why := _no_vllm()):
        if not cuda:
            res["not_applicable"] = why
            return
        raise RuntimeError(why + ": carry it with benchmarks/gpu/carry_kit.py (benchmarks/gpu/README.md)")
    driver_cuda = cuda and spec.get("driver_cuda", True)  # False: the models live in Ray workers
    meter = PhaseMeter(res, driver_cuda)
    res["phases"] = meter.rows
    for method, phase in (("rollout", "generation"), ("make_experience", "experience"), ("train", "training"),
                          ("sync_weights", "sync")):
        meter.wrap(RLTrainer, method, phase)
    if spec.get("needs_vllm"):  # which channel carried the weights into the engines (CUDA IPC when colocated)
        from rlhforge.distributed.engine_actors import EngineActors

        sync_from = EngineActors.sync_from

        def recorded(group, actor):
            res["weight_sync"] = ("cuda_ipc" if group.ipc else "ray_object_store" if group.sync_with_ray
                                  else f"collective ({group.backend})")
            return sync_from(group, actor)

        EngineActors.sync_from = recorded
    run_dir = Path(spec["run_dir"])
    res["run_dir"] = str(run_dir)
    flags = spec["flags"]
    if "--ds.strategy" in flags and flags[flags.index("--ds.strategy") + 1] == "deepspeed":
        import deepspeed  # on the GPU machine: the carried wheel (fetch_wheels.sh, DS_BUILD_OPS=0) in /tmp/site

        res["deepspeed"] = {"version": deepspeed.__version__, "path": str(Path(deepspeed.__file__).parent)}
    res.save()
    t = time.time()
    try:
        rc = train_ppo_ray.main(flags)
    except SystemExit as err:  # user_errors() turns a bad flag / failed run into an exit status
        rc = err.code if isinstance(err.code, int) else 1
    res["rc"], res["run_s"] = rc, round(time.time() - t, 2)
    res["startup_s"] = meter.rows[0]["at_s"] if meter.rows else None
    res["summary"] = summarize_rl(read_metrics(run_dir), meter.rows)
    if driver_cuda:
        res["peak_memory_gb_whole_run"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    else:
        res["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)
    steps = res["summary"]["steps"]
    res["ok"] = rc == 0 and steps == spec["steps"]
    if rc == 0 and steps != spec["steps"]:
        res.fail(f"metrics.jsonl has {steps} step rows, expected {spec['steps']}")
    elif res["ok"] and spec.get("needs_vllm"):  # issue 44: the weights reached the engine and are in effect
        if res["summary"]["sync_probe_logprob_diff_max"] is None:
            res.fail("metrics.jsonl has no post-sync probe (sync/probe_logprob_diff_max)")
        elif cuda and res.get("weight_sync") != "cuda_ipc":
            res.fail(f"the colocated engine was synced by {res.get('weight_sync')}, not CUDA IPC")


def _no_vllm() -> str | None:
    from rlhforge.rollout.vllm_engine import vllm_available

    return None if vllm_available() else "vLLM does not import here"


def run_trl(spec: dict, res) -> None:
    import torch

    use_vllm = bool(spec.get("use_vllm"))
    if use_vllm and spec["device"] != "cuda":
        res["not_applicable"] = ("TRL's vLLM colocation needs a GPU: on vLLM's CPU build its load_weights stops at the "
                                 "first repacked linear layer (docs/vllm.md)")
        return

    try:
        import datasets
        import trl
    except Exception as err:  # noqa: BLE001
        why = f"trl/datasets do not import ({type(err).__name__}: {str(err)[:300]})"
        if spec.get("trl_optional"):
            res["not_applicable"] = why + ": carry .whl/ with benchmarks/gpu/fetch_wheels.sh's wheels to run it"
            res["ok"] = False
            return
        raise
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from rlhforge.data.builtin import generate_builtin

    res["trl_version"], res["datasets_version"] = trl.__version__, datasets.__version__
    cuda = spec["device"] == "cuda"
    meter = PhaseMeter(res, cuda)
    res["phases"] = meter.rows
    meter.wrap(trl.GRPOTrainer, "_generate", "generation")
    marks: list[float] = []
    train_peaks: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            marks.append(time.time())
            if cuda:  # the peak since generation ended: scoring, log-probs, forward/backward, optimizer step
                train_peaks.append(round(torch.cuda.max_memory_allocated() / 2**30, 3))

    sh = spec["shape"]
    n = sh["prompts"] * sh["samples"]
    t = time.time()
    tok = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, attn_implementation="sdpa")
    records = generate_builtin("arithmetic", "train", n=sh["num_prompts"], seed=0, max=99)
    ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                                     for r in records])

    def reward(completions, **kwargs):
        return [length_reward(c[0]["content"]) for c in completions]

    args = trl.GRPOConfig(
        output_dir=spec["run_dir"], per_device_train_batch_size=n, gradient_accumulation_steps=1,
        generation_batch_size=n, num_generations=sh["samples"], max_completion_length=sh["new_tokens"],
        num_iterations=1, beta=0.0, temperature=1.0, learning_rate=1e-5, max_steps=spec["steps"],
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=not cuda, bf16=spec["dtype"] == "bf16",
        seed=0, disable_tqdm=True, dataloader_num_workers=0, gradient_checkpointing=False, use_vllm=use_vllm,
        **({"vllm_mode": "colocate", "vllm_gpu_memory_utilization": spec["vllm_gpu_memory_utilization"],
            "vllm_max_model_length": sh["max_len"]} if use_vllm else {}))
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok,
                              callbacks=[Clock()])
    res["setup_s"] = round(time.time() - t, 2)
    res.save()
    t_train = time.time()
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    gen = [r for r in meter.rows if r["phase"] == "generation"]
    step_s = [b - a for a, b in zip([t_train] + marks[:-1], marks)]
    per = []
    for i, s in enumerate(step_s):
        d = {"step": i + 1, "step_s": round(s, 3)}
        if i < len(gen):
            d["generation_s"] = gen[i]["s"]
            d["generation_peak_gb"] = gen[i].get("peak_gb")
        if i < len(lengths):
            d["generated_tokens"] = round(lengths[i] * n)
            if d.get("generation_s"):
                d["generation_tokens_per_s"] = round(d["generated_tokens"] / d["generation_s"], 1)
        if i < len(train_peaks):
            d["after_generation_peak_gb"] = train_peaks[i]
        per.append(d)
    steady = per[1:] if len(per) > 1 else per
    res["summary"] = {
        "steps": len(per), "per_step": per,
        "generation_tokens_per_s_steady": mean([r.get("generation_tokens_per_s") for r in steady]),
        "step_s_steady": mean([r.get("step_s") for r in steady]),
        "step_s_first": per[0]["step_s"] if per else None,
        "peak_memory_gb_by_phase": {
            "generation": max((r["generation_peak_gb"] for r in per if r.get("generation_peak_gb")), default=None),
            "after_generation": max(train_peaks, default=None)} if cuda else {},
        "notes": ("step_s: between TRL's on_step_end callbacks (the first from train() start); generation = "
                  "GRPOTrainer._generate; after_generation = the CUDA peak from the end of generation to the end "
                  "of the step (scoring, log-probs, forward/backward, optimizer); tokens = completions/mean_length "
                  "x completions"),
    }
    if cuda:
        res["peak_memory_gb_whole_run"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    else:
        res["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)
    res["ok"] = len(per) == spec["steps"]
