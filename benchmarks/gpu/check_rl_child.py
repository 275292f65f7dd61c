"""check_rl.py's child sub-commands (run in their own processes by the orchestrator): ``phase`` (one RL run
built as rlhforge.cli.train_ppo_ray.run builds it, plus a greedy probe of its engine) and ``greedy``
(greedy-after-sync comparisons against fresh engines loaded from the export)."""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

GREEDY_PROMPTS = 8  # the first prompts of the run's prompt set


def cmd_phase(a, rl_argv: list[str]) -> int:
    from rlhforge.cli.env import setup_cli_environment

    setup_cli_environment()
    from rlhforge.cli.train_ppo_ray import build_trainer, parse_rl_args
    from rlhforge.distributed.groups import InProcessGroup
    from rlhforge.rollout.engine import SamplingParams

    cfg = parse_rl_args(rl_argv, prog="check_rl.py phase")
    probe: dict = {}
    t = time.perf_counter()
    trainer = build_trainer(cfg)
    probe["build_s"] = round(time.perf_counter() - t, 3)
    engine = trainer.engine
    probe["engine_class"] = type(engine).__name__
    rc = 0
    try:
        initial_fp = trainer.actor.call("weights_fingerprint")[0]  # before training (outside the timings)
        t = time.perf_counter()
        trainer.fit()  # as rlhforge.cli.train_ppo_ray.run: train, then export to --ckpt.output_dir
        probe["fit_s"] = round(time.perf_counter() - t, 3)
        # one more sync (not in the metrics), now with fingerprints: what the engine loaded vs what rank 0 sends
        if not hasattr(engine, "sync_from"):
            final_fp = trainer.actor.call("weights_fingerprint")[0]
            probe["fingerprints"] = {"actor_before_training": initial_fp, "actor": final_fp,
                                     "training_changed_weights": initial_fp != final_fp,
                                     "engines": None, "why": "the engine is not an engine actor (no sync fingerprint)"}
        else:
            engine.fingerprint_syncs = True
            t = time.perf_counter()
            engine.sync_from(trainer.actor)
            fps = list(engine.last_fingerprints)
            actor_fp = trainer.actor.call("weights_fingerprint")[0]
            probe["fingerprints"] = {"engines": fps, "actor": actor_fp, "equal": bool(fps) and all(f == actor_fp for f in fps),
                                     "actor_before_training": initial_fp, "training_changed_weights": initial_fp != actor_fp,
                                     "extra_sync_with_fingerprint_s": round(time.perf_counter() - t, 3)}
        state = trainer.actor.call("engine_state_dict")[0]  # what a sync sends (rank 0), outside the timings
        if state:
            dtypes: dict = {}
            for t in state.values():
                dtypes[str(t.dtype).removeprefix("torch.")] = dtypes.get(str(t.dtype).removeprefix("torch."), 0) + t.numel()
            probe["sent_weights"] = {"bytes": sum(t.numel() * t.element_size() for t in state.values()),
                                     "tensors": len(state), "numel_by_dtype": dtypes,
                                     "what": "actor rank 0's engine_state_dict after the run: the tensors a sync "
                                             "sends, in the training dtype (a tied weight counts once per name)"}
        del state
        tok = trainer.tokenizer
        # the run's own first prompts, at most its response length: they fit the engine's max_model_len
        prompts = [list(p.ids) for p in trainer.prompts[:GREEDY_PROMPTS]]
        max_new = min(a.max_new, trainer.max_new_tokens)
        params = [SamplingParams(max_new_tokens=max_new, temperature=0.0) for _ in prompts]
        engine.wake_up()
        outs = trainer._run(engine.generate(prompts, params))
        engine.sleep()
        probe.update({"what": "greedy tokens of the run's engine after its last weight sync (the exported weights)",
                      "prompts": prompts, "tokens": [list(o.token_ids) for o in outs], "max_new_tokens": max_new,
                      "eos_token_id": tok.eos_token_id})
    except BaseException:
        traceback.print_exc()
        rc = 4 if "WorkerError" in traceback.format_exc() else 1
    finally:  # the clean-up of rlhforge.cli.train_ppo_ray.run
        trainer.logger.close()
        getattr(trainer.executor, "close", lambda: None)()
        getattr(trainer.engine, "close", lambda: None)()
        if not isinstance(trainer.actor, InProcessGroup):
            from rlhforge.distributed.launch import close_groups

            close_groups(trainer.actor, trainer.ref, trainer.critic, getattr(trainer, "reward_group", None))
        Path(a.probe_out).write_text(json.dumps(probe))
    return rc


# --------------------------------------------------------------------------------------------- greedy (child)


def compare(a_name, a_toks, b_name, b_toks, must_equal: bool, note: str = "") -> dict:
    eq = sum(1 for x, y in zip(a_toks, b_toks) if x == y)
    prefixes, first = [], []
    for i, (x, y) in enumerate(zip(a_toks, b_toks)):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefixes.append(k)
        if x != y and len(first) < 3:
            first.append({"prompt": i, "at": k, "a": x[k:k + 5], "b": y[k:k + 5]})
    return {"a": a_name, "b": b_name, "equal": eq, "of": len(a_toks), "must_equal": must_equal,
            "mean_common_prefix_tokens": sum(prefixes) / max(len(prefixes), 1),
            "mean_len_a": sum(map(len, a_toks)) / max(len(a_toks), 1), "first_mismatches": first, "note": note}


def cut_at_eos(ids: list[int], eos: int | None) -> list[int]:
    if eos is not None and eos in ids:
        return ids[: ids.index(eos) + 1]
    return ids


def cmd_greedy(a) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    spec = json.loads(Path(a.spec).read_text())
    device = spec["device"] if torch.cuda.is_available() or spec["device"] == "cpu" else "cpu"
    result: dict = {"comparisons": [], "skipped": [], "device": device}
    rc = 0

    def save():
        Path(a.out).write_text(json.dumps(result, indent=1))

    for item in spec["items"]:
        probe = json.loads(Path(item["probe"]).read_text())
        prompts, engine_toks, eos, n = probe["prompts"], probe["tokens"], probe.get("eos_token_id"), probe["max_new_tokens"]
        who = f"{item['phase']}: {probe.get('engine_class')} after its last sync"
        fresh = None
        if item["engine"] == "vllm":
            if time.time() + 60 > spec["deadline"]:
                result["skipped"].append(f"{item['phase']}: fresh vLLM engine (no time left)")
            else:
                try:
                    from rlhforge.rollout.engine import SamplingParams
                    from rlhforge.rollout.vllm_engine import VLLMEngine

                    t = time.perf_counter()
                    # a fresh engine from the export, in its own engine-core process (closed after), same dtype
                    eng = VLLMEngine(item["export"], eos_token_id=eos, dtype=item.get("dtype", "bfloat16"),
                                     max_model_len=512,
                                     gpu_memory_utilization=0.25, enforce_eager=spec.get("eager", True), in_process=False)
                    outs = eng.generate_sync(prompts, [SamplingParams(max_new_tokens=n, temperature=0.0)] * len(prompts))
                    fresh = [list(o.token_ids) for o in outs]
                    eng.close()
                    del eng
                    result.setdefault("fresh_vllm_s", {})[item["phase"]] = round(time.perf_counter() - t, 2)
                    result["comparisons"].append(compare(
                        who, engine_toks, f"{item['phase']}: fresh vLLM engine loaded from the export", fresh, True,
                        f"same weights, same vLLM kernels and dtype ({item.get('dtype')}), same batch of prompts: must be equal"))
                except Exception:  # noqa: BLE001
                    rc = 1
                    result.setdefault("errors", []).append(f"{item['phase']}: fresh vLLM: {traceback.format_exc()[-800:]}")
            save()
        if time.time() + 20 > spec["deadline"]:
            result["skipped"].append(f"{item['phase']}: HF comparison (no time left)")
            continue
        try:
            t = time.perf_counter()
            dtype = torch.bfloat16 if device == "cuda" else torch.float32
            model = AutoModelForCausalLM.from_pretrained(item["export"], dtype=dtype).to(device).eval()
            hf = []
            tf_agree = tf_total = 0
            margins = []
            with torch.no_grad():
                for p, e_toks in zip(prompts, engine_toks):
                    x = torch.tensor([p], device=device)
                    y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                       eos_token_id=eos, pad_token_id=eos)
                    hf.append(cut_at_eos(y[0, len(p):].tolist(), eos))
                    if e_toks:  # teacher forcing: is each engine token the HF argmax at its position?
                        full = torch.tensor([p + e_toks], device=device)
                        logits = model(full).logits[0, len(p) - 1: len(p) - 1 + len(e_toks)].float()
                        top = logits.argmax(-1)
                        chosen = torch.tensor(e_toks, device=device)
                        tf_agree += int((top == chosen).sum())
                        tf_total += len(e_toks)
                        gap = logits.max(-1).values - logits.gather(1, chosen[:, None])[:, 0]
                        margins += [float(g) for g in gap[top != chosen]]
            if item.get("initial"):  # the same greedy decoding on the model before training
                init = AutoModelForCausalLM.from_pretrained(item["initial"], dtype=dtype).to(device).eval()
                with torch.no_grad():
                    before = []
                    for p in prompts:
                        x = torch.tensor([p], device=device)
                        y = init.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                                          eos_token_id=eos, pad_token_id=eos)
                        before.append(cut_at_eos(y[0, len(p):].tolist(), eos))
                del init
                changed = sum(1 for x, y in zip(before, hf) if x != y)
                result.setdefault("training_changed_greedy", {})[item["phase"]] = {
                    "what": "transformers greedy on the initial model vs on the export: prompts whose tokens differ "
                            "(0: the equality checks above could not tell a synced engine from a stale one)",
                    "differ": changed, "of": len(hf)}
            result.setdefault("hf_s", {})[item["phase"]] = round(time.perf_counter() - t, 2)
            kind = "bf16 on the GPU" if dtype == torch.bfloat16 else "fp32 on CPU"
            exact = item["engine"] == "hf" and device == "cpu"
            result["comparisons"].append(compare(
                who, engine_toks, f"{item['phase']}: transformers generate (greedy) on the export, {kind}", hf, exact,
                "same engine family and fp32: must be equal" if exact else
                f"different kernels ({kind}): a near-tie may flip a token, after which the sequences diverge; "
                "see teacher_forced"))
            if fresh is not None:
                result["comparisons"].append(compare(f"{item['phase']}: fresh vLLM engine", fresh,
                                                     f"{item['phase']}: transformers generate", hf, False))
            result.setdefault("teacher_forced", {})[item["phase"]] = {
                "what": "the engine's greedy tokens fed to the HF model from the export: share that are its argmax",
                "agree": tf_agree, "of": tf_total, "share": tf_agree / tf_total if tf_total else None,
                "max_logit_gap_where_not_argmax": max(margins) if margins else 0.0}
            del model
            if device == "cuda":
                torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001
            rc = 1
            result.setdefault("errors", []).append(f"{item['phase']}: HF: {traceback.format_exc()[-800:]}")
        save()
    save()
    return rc
