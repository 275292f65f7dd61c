#!/usr/bin/env python3
"""One stage of the GPU check, in its own process: ``check_rl_child.py STAGE --spec SPEC.json --out OUT.json``.

check_rl.py starts one per stage with its own timeout; the result JSON is rewritten as the stage goes,
so a stage killed at its timeout still leaves what it measured. Stages here:

- ``env``         versions, GPU, imports (gpu_env.py)
- ``bug1``        issue 30's bug 1 on a process group of one: a host tensor in an NCCL all-reduce fails;
                  ``all_reduce_tensor(..., device=)`` and the torch / FSDP2 strategies' ``all_reduce`` work
- ``nccl_group``  rlhforge's weight-sync channel (``SyncGroup``) as an NCCL group of one: open + send
- ``ipc_sync``    CUDA-IPC weight sync into a plain-torch receiver process on the same GPU: fingerprints
                  and greedy tokens compared, seconds per GB
- ``grpo``        GRPO steps through ``rlhforge.cli.train_ppo_ray.main`` (gpu_rl.py): the HF engine in the
                  driver, or (stage grpo_vllm) the hybrid engine: Ray, vLLM, ZeRO-3, sleep, CUDA-IPC sync
- ``trl``         TRL's GRPOTrainer on the same model, prompts and reward (gpu_rl.py), HF or vLLM generation
- ``hf_decode``   the HF engine's eager and graphs decode loops on the same model (gpu_decode.py)
- ``vllm_engine`` rlhforge's vLLM engine: tokens/s, sleep, wake, the same tokens again (gpu_vllm.py)

On CPU (``--cpu-smoke``) the same code runs with gloo and CPU shared memory instead of NCCL and CUDA IPC.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gpu_metrics import write_json  # noqa: E402


class Result(dict):
    """The stage's result, saved to ``path`` on every ``save()`` (atomically)."""

    def __init__(self, path: Path):
        super().__init__(ok=False, started=time.time())
        self.path = path

    def save(self) -> None:
        self["elapsed_s"] = round(time.time() - self["started"], 2)
        write_json(self.path, self)

    def fail(self, msg: str) -> None:
        self["ok"] = False
        self.setdefault("errors", []).append(msg)
        self.save()


def _err(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip()[:600]}"


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


# --------------------------------------------------------------------------------------------- bug 1


def run_bug1(spec: dict, res: Result) -> None:
    import dataclasses
    import inspect

    import torch
    import torch.distributed as dist

    from rlhforge.backend.collective import free_port

    device, backend = spec["device"], spec["backend"]
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(0)
    port = free_port()
    t = time.time()
    kw = {"device_id": dev} if device == "cuda" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, **kw)
    res["group"] = {"backend": str(dist.get_backend()), "world_size": dist.get_world_size(),
                    "init_s": round(time.time() - t, 3)}
    res["strict_device_env"] = os.environ.get("RLHFORGE_STRICT_DEVICE")
    res.save()
    # 1. the bug: a host tensor straight into the group's all-reduce
    try:
        x = torch.tensor(1.0)
        dist.all_reduce(x)
        _sync(device)
        res["bug"] = {"call": "dist.all_reduce(torch.tensor(1.0))", "raised": False, "value": x.item()}
    except Exception as err:  # noqa: BLE001 - the error is the finding
        res["bug"] = {"call": "dist.all_reduce(torch.tensor(1.0))", "raised": True, "error": _err(err)}
    res["bug_reproduced"] = bool(res["bug"]["raised"])
    if not res["bug_reproduced"]:
        res["bug"]["note"] = (f"{backend} took a host tensor: bug 1 is NCCL-only (gloo reduces CPU tensors; the "
                              "strict-device test mode makes the CPU suite catch it)")
    res.save()
    # 2. the fix: all_reduce_tensor(tensor, op, world_size, device=None)
    from rlhforge.backend.strategy import all_reduce_tensor

    sig = str(inspect.signature(all_reduce_tensor))
    has_device = "device" in inspect.signature(all_reduce_tensor).parameters
    fixed = res["fixed"] = {"signature": sig, "has_device_parameter": has_device}
    calls = [("world_size=1 (a group of one: returns a copy, no collective)", 1),
             ("world_size=2 (forces the collective path on the group of one)", 2)]
    ok = True
    for label, ws in calls:
        try:
            host = torch.tensor(1.0)
            out = all_reduce_tensor(host, "sum", ws, device=dev) if has_device else all_reduce_tensor(host, "sum", ws)
            _sync(device)
            good = out.device == host.device and abs(out.item() - 1.0) < 1e-6
            fixed[label] = {"ok": good, "value": out.item(), "result_device": str(out.device)}
            ok &= good
        except Exception as err:  # noqa: BLE001
            fixed[label] = {"ok": False, "error": _err(err)}
            ok = False
        res.save()
    if not has_device:
        res.fail("all_reduce_tensor has no `device` parameter (the fix of bug 1 is not in this tree)")
    # 3. through the real strategies (their all_reduce passes the strategy's device)
    from rlhforge.backend.factory import build_strategy
    from rlhforge.config.rl import RLConfig

    cfg = RLConfig()
    res["strategies"] = {}
    for name in ("torch", "fsdp2"):
        rec = res["strategies"][name] = {}
        try:
            strategy = build_strategy(dataclasses.replace(cfg.ds, strategy=name, param_dtype=spec["param_dtype"]),
                                      cfg.actor.optim_config(), dataclasses.replace(cfg.train, device=device), None)
            rec["class"], rec["device"] = type(strategy).__name__, str(strategy.device)
            out = strategy.all_reduce(torch.tensor(3.0), op="sum")
            rec["world_size_1"] = {"value": out.item(), "result_device": str(out.device)}
            strategy.world_size = 2  # force the collective path on the group of one (as above)
            out = strategy.all_reduce(torch.tensor(3.0), op="sum")
            _sync(device)
            rec["forced_collective"] = {"value": out.item(), "result_device": str(out.device)}
            strategy.world_size = 1
            rec["ok"] = out.device.type == "cpu" and abs(out.item() - 3.0) < 1e-6
        except Exception as err:  # noqa: BLE001
            rec.update(ok=False, error=_err(err), trace=traceback.format_exc()[-1500:])
        ok &= bool(rec.get("ok"))
        res.save()
    res["ok"] = ok and has_device
    dist.destroy_process_group()


# --------------------------------------------------------------------------------------------- NCCL group


def run_nccl_group(spec: dict, res: Result) -> None:
    import torch

    from rlhforge.backend.collective import SyncGroup, free_port, state_fingerprint

    device, backend = spec["device"], spec["backend"]
    dev = "cuda:0" if device == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(0)
    port = free_port()
    t = time.time()
    group = SyncGroup("127.0.0.1", port, 0, 1, backend, dev, timeout_s=60.0)
    res["open_s"] = round(time.time() - t, 3)
    res["call"] = f'SyncGroup("127.0.0.1", {port}, 0, 1, "{backend}", "{dev}")'
    res.save()
    gen = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(512, 512, generator=gen).to(dev, torch.bfloat16) for i in range(8)}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    fp = state_fingerprint(state)
    sends = []
    for _ in range(3):  # the first includes NCCL's communicator set-up
        t = time.time()
        buckets = group.send(state, bucket_bytes=1 << 20)
        _sync(device)
        sends.append(round(time.time() - t, 4))
    res.update(bytes=nbytes, buckets=buckets, send_s=sends, fingerprint=fp[:16],
               unchanged_after_send=state_fingerprint(state) == fp,
               note="a group of one: the broadcast has no receiver, but runs the NCCL path (communicator, "
                    "headers, bucket buffers on the device)")
    res["ok"] = buckets >= 1 and res["unchanged_after_send"]
    try:
        group.pg.shutdown()
    except Exception:  # noqa: BLE001 - older torch / gloo: nothing to shut down
        pass


# --------------------------------------------------------------------------------------------- CUDA IPC


def _ipc_model(spec: dict, seed: int):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    m = spec["ipc_model"]
    cfg = Qwen3Config(vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["intermediate"],
                      num_hidden_layers=m["layers"], num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"],
                      head_dim=m["hidden"] // m["heads"], max_position_embeddings=512, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    dev = torch.device("cuda", 0) if spec["device"] == "cuda" else torch.device("cpu")
    torch.manual_seed(seed)
    with torch.device(dev):
        model = Qwen3ForCausalLM(cfg)
    return model.to(getattr(torch, spec["ipc_dtype"])).eval()


def _greedy(model, spec: dict) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(123)
    ids = torch.randint(4, spec["ipc_model"]["vocab"], (16, 8), generator=g).to(model.device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=spec["greedy_tokens"], min_new_tokens=spec["greedy_tokens"], pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


def ipc_receiver(spec: dict, inbox, outbox) -> None:
    """The plain-torch receiver: the same architecture with other random weights, loaded bucket by bucket
    from the sender's shared buffers (CUDA IPC on GPU, shared memory on CPU)."""
    try:
        import torch

        from rlhforge.backend.collective import state_fingerprint, unpack_bucket

        if spec["device"] == "cuda":
            torch.cuda.set_device(0)
        model = _ipc_model(spec, seed=1)
        params = model.state_dict()
        outbox.put(("ready", state_fingerprint(params)))
        loaded = 0
        while True:
            msg = inbox.get(timeout=120)
            if msg[0] == "done":
                break
            _, index, entries, (rebuild, args) = msg
            buf = rebuild(*args)  # the sender's buffer, mapped into this process
            for name, t in unpack_bucket(buf, entries):
                params[name].copy_(t)
                loaded += 1
            del buf
            if spec["device"] == "cuda":
                torch.cuda.synchronize()
            outbox.put(("ack", index))
        outbox.put(("result", state_fingerprint(model.state_dict()), _greedy(model, spec), loaded))
    except BaseException as err:  # noqa: BLE001 - reported to the parent, which records it
        outbox.put(("error", _err(err) + "\n" + traceback.format_exc()[-1500:]))


def run_ipc_sync(spec: dict, res: Result) -> None:
    import torch
    import torch.multiprocessing as tmp
    from torch.multiprocessing.reductions import reduce_tensor

    from rlhforge.backend.collective import state_fingerprint, stream_buckets

    device = spec["device"]
    res["channel"] = "CUDA IPC (reduce_tensor of CUDA buffers)" if device == "cuda" else \
        "CPU shared memory (reduce_tensor of host buffers): the CPU stand-in for CUDA IPC"
    if device == "cuda":
        torch.cuda.set_device(0)
    ctx = tmp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=ipc_receiver, args=(spec, inbox, outbox), daemon=True)
    t = time.time()
    proc.start()
    model = _ipc_model(spec, seed=0)
    named = model.state_dict()
    nbytes = sum(v.numel() * v.element_size() for v in named.values())
    res["model"] = {**spec["ipc_model"], "dtype": spec["ipc_dtype"], "params": sum(v.numel() for v in named.values()),
                    "bytes": nbytes}
    sender_fp = state_fingerprint(named)
    sender_tokens = _greedy(model, spec)
    res.save()

    def get(kind: str):
        msg = outbox.get(timeout=spec["ipc_wait_s"])
        if msg[0] == "error":
            raise RuntimeError(f"receiver failed: {msg[1]}")
        if msg[0] != kind:
            raise RuntimeError(f"receiver sent {msg[0]!r}, expected {kind!r}")
        return msg[1:]

    (receiver_fp_before,) = get("ready")
    res["receiver_start_s"] = round(time.time() - t, 2)
    res["fingerprint_differs_before_sync"] = receiver_fp_before != sender_fp
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    t0, buckets = time.time(), 0
    for entries, buf, last in stream_buckets(named, spec["bucket_bytes"], dev):
        if entries:
            _sync(device)
            inbox.put(("bucket", buckets, entries, reduce_tensor(buf)))
            get("ack")  # the receiver has copied it out: the buffer may go
            buckets += 1
        del buf
    sync_s = time.time() - t0
    inbox.put(("done",))
    receiver_fp, receiver_tokens, loaded = get("result")
    proc.join(timeout=30)
    equal_tokens = sum(a == b for a, b in zip(sender_tokens, receiver_tokens))
    res.update(buckets=buckets, bucket_bytes=spec["bucket_bytes"], tensors_loaded=loaded,
               sync_s=round(sync_s, 4), s_per_gb=round(sync_s / (nbytes / 1e9), 3),
               gb_per_s=round(nbytes / 1e9 / sync_s, 3) if sync_s > 0 else None,
               fingerprint_sender=sender_fp[:16], fingerprint_receiver=receiver_fp[:16],
               fingerprints_equal=receiver_fp == sender_fp,
               greedy={"prompts": len(sender_tokens), "new_tokens": spec["greedy_tokens"],
                       "equal_prompts": equal_tokens, "sender_first": sender_tokens[0],
                       "receiver_first": receiver_tokens[0]},
               note="s_per_gb: from the first bucket to the receiver's last acknowledgement, per 1e9 bytes of "
                    "weights (pack, share the handle, map, unpack, copy into the model, acknowledge)")
    res["ok"] = bool(res["fingerprints_equal"] and equal_tokens == len(sender_tokens)
                     and res["fingerprint_differs_before_sync"])


# --------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="check_rl_child.py")
    p.add_argument("stage", choices=("env", "bug1", "nccl_group", "ipc_sync", "grpo", "trl", "hf_decode", "vllm_engine"))
    p.add_argument("--spec", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    spec = json.loads(Path(a.spec).read_text())
    res = Result(Path(a.out))
    res["stage"] = a.stage
    res.save()
    if a.stage == "env":
        from gpu_env import run_env as fn
    elif a.stage == "hf_decode":
        from gpu_decode import run_hf_decode as fn
    elif a.stage == "vllm_engine":
        from gpu_vllm import run_vllm_engine as fn
    elif a.stage in ("grpo", "trl"):
        import gpu_rl

        fn = gpu_rl.run_grpo if a.stage == "grpo" else gpu_rl.run_trl
    else:
        fn = {"bug1": run_bug1, "nccl_group": run_nccl_group, "ipc_sync": run_ipc_sync}[a.stage]
    try:
        fn(spec, res)
    except BaseException as err:  # noqa: BLE001 - recorded, then the exit status says it
        res.fail(_err(err))
        res["trace"] = traceback.format_exc()[-3000:]
    res.save()
    verdict = 'ok' if res.get('ok') else 'n/a' if res.get('not_applicable') else 'FAILED'
    print(f"[check_rl_child] {a.stage}: {verdict} in {res['elapsed_s']} s", flush=True)
    return 0 if res.get("ok") or res.get("not_applicable") else 1


if __name__ == "__main__":
    sys.exit(main())
