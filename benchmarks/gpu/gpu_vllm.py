"""Stage ``vllm_engine`` of the GPU check (issue 44, point 3; run in a child process by check_rl_child.py).

rlhforge's own vLLM engine (:class:`rlhforge.rollout.vllm_engine.VLLMEngine`, the class the RL CLI builds) on
the check's model, in the run's precision:

1. start-up (seconds; CUDA graphs captured unless ``enforce_eager``);
2. the GRPO stages' rollout shape (prompts x samples rows, ``new_tokens`` each, temperature 1, one seed per
   row) generated ``rounds`` times after a warm-up: tokens/s (median), the number #42 compares with the HF
   engine's and TRL's generation;
3. the same requests once more, greedy and sampled, as the reference tokens;
4. on a GPU: ``sleep()`` (vLLM sleep level 1: weights to host memory, KV cache dropped), the device memory that
   released (``torch.cuda.mem_get_info``, device-wide: the engine-core process included), ``wake_up()``, the
   memory taken back, then the same requests again: the tokens must be identical (greedy and sampled: every
   request carries its own seed). On CPU vLLM has no sleep mode (the engine refuses ``enable_sleep``): the
   smoke checks that the same requests give the same tokens twice, and records the sleep as not run.
"""

from __future__ import annotations

import statistics
import time


def _prompts(tok, n: int, max_len: int) -> list[list[int]]:
    """The GRPO stages' prompts: the built-in arithmetic task through the model's chat template."""
    from rlhforge.data.builtin import generate_builtin

    records = generate_builtin("arithmetic", "train", n=n, seed=0, max=99)
    out = []
    for r in records:
        ids = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                      tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # transformers 5 returns a BatchEncoding
        out.append([int(t) for t in ids][:max_len])
    return out


def _free_gb(cuda: bool) -> float | None:
    if not cuda:
        return None
    import torch

    return round(torch.cuda.mem_get_info()[0] / 2**30, 3)


def run_vllm_engine(spec: dict, res) -> None:
    from transformers import AutoTokenizer

    from rlhforge.rollout.engine import SamplingParams
    from rlhforge.rollout.vllm_engine import VLLMEngine, vllm_available

    cuda = spec["device"] == "cuda"
    if not vllm_available():
        why = "vLLM does not import here"
        if not cuda:
            res["not_applicable"] = why + " (the CPU smoke runs this stage where vLLM's CPU build is installed)"
            return
        raise RuntimeError(why + ": carry it with benchmarks/gpu/carry_kit.py (benchmarks/gpu/README.md)")
    import vllm

    res["vllm_version"] = vllm.__version__
    tok = AutoTokenizer.from_pretrained(spec["model"])
    n_prompts, samples, new = spec["prompts"], spec["samples"], spec["new_tokens"]
    prompts = [p for p in _prompts(tok, n_prompts, spec["max_len"] - new) for _ in range(samples)]
    sampled = [SamplingParams(max_new_tokens=new, temperature=1.0, seed=1000 + i) for i in range(len(prompts))]
    greedy = [SamplingParams(max_new_tokens=new, temperature=0.0) for _ in prompts]
    settings = {"dtype": "bfloat16" if spec["param_dtype"] == "bf16" else "float32", "max_model_len": spec["max_len"],
                "seed": 0, "enable_sleep": cuda, "enforce_eager": bool(spec.get("enforce_eager")),
                "gpu_memory_utilization": spec["gpu_memory_utilization"]}
    res["engine"] = settings
    free0 = _free_gb(cuda)
    t = time.perf_counter()
    engine = VLLMEngine.from_tokenizer(spec["model"], tok, **settings)
    res["startup_s"] = round(time.perf_counter() - t, 2)
    res["free_gb"] = {"before_start": free0, "after_start": _free_gb(cuda)}
    res.save()
    try:
        engine.generate_sync(prompts, sampled)  # warm-up
        rounds = []
        for _ in range(spec["rounds"]):
            t = time.perf_counter()
            outs = engine.generate_sync(prompts, sampled)
            s = time.perf_counter() - t
            tokens = sum(len(o.token_ids) for o in outs)
            rounds.append({"s": round(s, 4), "tokens": tokens, "tokens_per_s": round(tokens / s, 1)})
        res["rows"], res["new_tokens"], res["rounds"] = len(prompts), new, rounds
        res["tokens_per_s_median"] = statistics.median(r["tokens_per_s"] for r in rounds)
        res.save()
        before = ([o.token_ids for o in engine.generate_sync(prompts, greedy)],
                  [o.token_ids for o in engine.generate_sync(prompts, sampled)])
        if cuda:
            t = time.perf_counter()
            engine.sleep()
            res["sleep_s"] = round(time.perf_counter() - t, 3)
            res["free_gb"]["asleep"] = _free_gb(cuda)
            t = time.perf_counter()
            engine.wake_up()
            res["wake_s"] = round(time.perf_counter() - t, 3)
            res["free_gb"]["awake"] = _free_gb(cuda)
            f = res["free_gb"]
            res["sleep_released_gb"] = round(f["asleep"] - f["after_start"], 3)
            res["wake_took_back_gb"] = round(f["asleep"] - f["awake"], 3)
        else:
            res["sleep"] = "not run: vLLM's CPU build has no sleep mode (VLLMEngine refuses enable_sleep on CPU)"
        after = ([o.token_ids for o in engine.generate_sync(prompts, greedy)],
                 [o.token_ids for o in engine.generate_sync(prompts, sampled)])
    finally:
        engine.close()
    res["greedy_rows_equal"] = sum(a == b for a, b in zip(before[0], after[0]))
    res["sampled_rows_equal"] = sum(a == b for a, b in zip(before[1], after[1]))
    res["tokens_identical"] = before == after
    what = "sleep/wake" if cuda else "a second generation"
    res["headline"] = (f"vLLM {vllm.__version__}: start {res['startup_s']} s, {len(prompts)} rows x {new} tokens "
                       f"{res['tokens_per_s_median']:.0f} tok/s; tokens identical across {what}: "
                       f"{res['tokens_identical']} (greedy {res['greedy_rows_equal']}/{len(prompts)}, sampled "
                       f"{res['sampled_rows_equal']}/{len(prompts)})")
    if cuda:
        res["headline"] += f"; sleep released {res['sleep_released_gb']} GB, wake took back {res['wake_took_back_gb']} GB"
    res["ok"] = res["tokens_identical"] and (not cuda or res["sleep_released_gb"] > 0)
    if not res["tokens_identical"]:
        res.fail(f"tokens differ across {what}: greedy rows equal {res['greedy_rows_equal']}, sampled "
                 f"{res['sampled_rows_equal']} of {len(prompts)}")
    elif cuda and res["sleep_released_gb"] <= 0:
        res.fail(f"sleep released no device memory (free {res['free_gb']})")
