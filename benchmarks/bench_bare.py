"""The limit: the same math as the SFT / DPO / GRPO steps of ``bench_vs_trl.py`` with nothing around it.

    python benchmarks/bench_bare.py --work sft --batch 8 --max-len 128 [--steps 5 --warmup 3]
    python benchmarks/bench_bare.py --work grpo --prompts 4 --samples 4 --new-tokens 64

Plain PyTorch + transformers on the same model folder, data and shapes as the frameworks, with the
data tokenised once up front (outside the timed steps):

- ``sft``: packed forward/backward + AdamW step. The micro-batch is one row without padding
  (position ids restarting per sample) and attention runs sample by sample (causal SDPA per
  sample, :mod:`rlhforge.models.segment_attention`);
- ``dpo``: chosen + rejected packed the same way, one policy forward/backward, one reference
  forward without gradients, the sigmoid DPO loss (beta 0.1), AdamW step;
- ``grpo``: a minimal KV-cached sampling loop (``DynamicCache``, one batched multinomial per
  token), the built-in arithmetic reward, group-normalised advantages, then one padded
  forward/backward of the on-policy GRPO loss (ratio 1, no KL) and an AdamW step.

This file is also the ``bare`` side of ``bench_vs_trl.py`` (:func:`run_bare`), and holds the data
generators every side shares (:func:`write_sft`, :func:`write_dpo`). It prints one JSON line:
step-end timestamps, seconds per step after the warm-up steps, peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import time
from pathlib import Path

WORDS = ("the model learns to add small numbers and answer questions about them clearly while "
         "counting words letters digits").split()


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(max(1, n_words)))


def write_sft(path: Path, n: int, max_len: int, seed: int = 0) -> None:
    """Prompt/completion records whose tokenised length spreads over ~max_len/8 .. max_len."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            words = rng.randint(max(2, max_len // 8), max(3, max_len - 24))
            f.write(json.dumps({"prompt": f"Question {i}: say {words} words.", "completion": _text(rng, words)}) + "\n")


def write_dpo(path: Path, n: int, max_len: int, seed: int = 0) -> None:
    """Preference pairs; chosen and rejected lengths drawn independently (each under max_len / 2)."""
    rng = random.Random(seed)
    half = max(4, max_len // 2 - 16)
    with open(path, "w") as f:
        for i in range(n):
            chosen, rejected = (_text(rng, rng.randint(max(2, half // 8), half)) for _ in range(2))
            f.write(json.dumps({"prompt": f"Question {i}: say some words.", "chosen": chosen, "rejected": rejected}) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def vm_hwm_gb(pid: int) -> float:
    """The process's own peak RSS (``VmHWM``; 0 once it is gone). ``wait4``'s ``ru_maxrss`` is no good
    for a child: Linux carries the high-water mark across fork + exec, so a child reads at least this driver's
    RSS at the fork (~0.47 GB: torch, transformers and DeepSpeed imported)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            line = next((x for x in f if x.startswith("VmHWM:")), "")
    except OSError:
        return 0.0
    return int(line.split()[1]) / 2**20 if line else 0.0


def wait_with_peak(proc, deadline: float | None = None):
    """Wait for a child (killed at ``deadline``, a ``time.time()``): ``(status, rusage, peak RSS GB)``,
    the peak its own :func:`vm_hwm_gb` polled every 50 ms (``ru_maxrss`` if it never read)."""
    hwm = 0.0
    while True:
        hwm = max(hwm, vm_hwm_gb(proc.pid))
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if deadline is not None and time.time() > deadline:
            proc.kill()
            pid, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.05)
    return status, usage, hwm or usage.ru_maxrss / 2**20


# ---------------------------------------------------------------------------------------------- helpers
def _chat(tok, prompt: str, answer: str | None, max_len: int) -> tuple[list[int], int]:
    """(ids truncated to max_len, prompt length) with the tokenizer's chat template."""
    msgs = [{"role": "user", "content": prompt}]
    p = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    if answer is None:
        return list(p), len(p)
    full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": answer}], tokenize=True, return_dict=False)
    return list(full)[:max_len], len(p)


def _packed_token_logps(model, seqs: list[list[int]]):
    """log p(token t | < t) of every token of every sequence, concatenated [N] (0 at each first token).

    The sequences go into one row with no padding; each attends only to itself through the per-sample
    causal SDPA of :mod:`rlhforge.models.segment_attention` (the kernel rlhforge uses on CPU)."""
    import torch

    from rlhforge.models.segment_attention import segment_attention, segment_kwargs

    lens = [len(s) for s in seqs]
    ids = torch.tensor([t for s in seqs for t in s])[None]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    kwargs = {"input_ids": ids, "position_ids": pos, "use_cache": False, **segment_kwargs(lens, ids.device)}
    with segment_attention(model, kwargs):
        logits = model(**kwargs).logits
    logp = torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    logp = torch.cat([torch.zeros_like(logp[:1]), logp])
    first = torch.zeros(len(logp), dtype=torch.bool)
    first[torch.tensor([0] + lens[:-1]).cumsum(0)] = True
    return logp.masked_fill(first, 0.0)


def _targets(seqs: list[list[int]], prompt_lens: list[int]):
    import torch

    return torch.cat([torch.tensor([0.0] * p + [1.0] * (len(s) - p)) for s, p in zip(seqs, prompt_lens)])


def _padded_batch(seqs: list[list[int]], prompt_lens: list[int], pad_id: int):
    """(ids, attention mask, completion-token targets), each [B, longest], right-padded."""
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    target = torch.zeros(len(seqs), width)
    for i, (seq, p) in enumerate(zip(seqs, prompt_lens)):
        ids[i, : len(seq)], attn[i, : len(seq)], target[i, p : len(seq)] = torch.tensor(seq), 1, 1.0
    return ids, attn, target


# ---------------------------------------------------------------------------------------------- the loops
def run_bare(work: str, model_dir: str, data: str | None, point: dict, steps: int, lr: float = 1e-5,
             seed: int = 0, precision: str = "fp32", sft_layout: str = "packed", compiled: bool = False) -> dict:
    """Run ``steps`` optimizer steps of ``work`` and return step-end timestamps (``time.time()``).

    ``precision="bf16"``: fp32 weights, the training (and reference) forwards under bf16 autocast, as
    rlhforge's ``--ds.param_dtype bf16`` and TRL's ``bf16=True`` on CPU; generation stays fp32.
    ``sft_layout="padded"``: the SFT batch padded to its longest sample instead of packed (TRL's
    layout), its forward and loss under ``torch.compile`` when ``compiled`` (``bench_compile.py``)."""
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"unknown precision {precision!r} (fp32, bf16)")
    if sft_layout not in ("packed", "padded"):
        raise ValueError(f"unknown sft_layout {sft_layout!r} (packed, padded)")
    if compiled and (work, sft_layout) != ("sft", "padded"):
        raise ValueError("compiled=True needs work='sft' and sft_layout='padded' (the packed attention "
                         "loops over the sample lengths: a new graph per batch)")
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    marks: list[float] = []
    extra: dict = {}

    def amp():
        if precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=torch.bfloat16)

    def step(loss):
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        marks.append(time.time())

    if work == "sft":
        batch, max_len = point["batch"], point["max_len"]
        records = read_jsonl(data)
        enc = [_chat(tok, r["prompt"], r["completion"], max_len) for r in records[: batch * steps]]

        def padded_loss(ids, attn, target):
            with amp():
                logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
            logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
            return -(logp * target[:, 1:]).sum() / target[:, 1:].sum()

        padded_loss_fn = torch.compile(padded_loss) if compiled else padded_loss
        for s in range(steps):
            chunk = enc[s * batch : (s + 1) * batch]
            seqs, plens = [c[0] for c in chunk], [c[1] for c in chunk]
            if sft_layout == "padded":
                step(padded_loss_fn(*_padded_batch(seqs, plens, tok.pad_token_id)))
                continue
            mask = _targets(seqs, plens)
            with amp():
                logp = _packed_token_logps(model, seqs)
            step(-(logp * mask).sum() / mask.sum())
    elif work == "dpo":
        import copy

        batch, max_len = point["batch"], point["max_len"]
        ref = copy.deepcopy(model).eval().requires_grad_(False)
        records = read_jsonl(data)[: batch * steps]
        for s in range(steps):
            seqs, plens = [], []
            for r in records[s * batch : (s + 1) * batch]:
                for side in ("chosen", "rejected"):
                    ids, p = _chat(tok, r["prompt"], r[side], max_len)
                    seqs.append(ids)
                    plens.append(p)
            mask = _targets(seqs, plens)
            seg = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor([len(x) for x in seqs]))

            def sums(lp):
                return torch.zeros(len(seqs)).index_add(0, seg, lp * mask)

            with amp():
                pol = sums(_packed_token_logps(model, seqs))
                with torch.no_grad():
                    refs = sums(_packed_token_logps(ref, seqs))
            margin = (pol[0::2] - refs[0::2]) - (pol[1::2] - refs[1::2])
            step(-torch.nn.functional.logsigmoid(0.1 * margin).mean())
    elif work == "grpo":
        extra = _grpo(model, tok, point, steps, step, amp)
    else:
        raise ValueError(f"unknown work {work!r} (sft, dpo, grpo)")
    return {"step_end_times": marks, "peak_rss_gb": peak_rss_gb(), **extra}


def _grpo(model, tok, point: dict, steps: int, step, amp) -> dict:
    import torch
    from transformers import DynamicCache

    from rlhforge.data.builtin import check_answer, generate_builtin

    prompts_per_step, group, new = point["prompts"], point["samples"], point["new_tokens"]
    temperature = 1.0
    records = generate_builtin("arithmetic", "train", n=prompts_per_step * steps, seed=0, max=14)
    eos = tok.eos_token_id
    lengths = []
    for s in range(steps):
        recs = [r for r in records[s * prompts_per_step : (s + 1) * prompts_per_step] for _ in range(group)]
        prompts = [_chat(tok, r["prompt"], None, 10**6)[0] for r in recs]
        width, n = max(len(p) for p in prompts), len(prompts)
        ids = torch.full((n, width), tok.pad_token_id, dtype=torch.long)
        attn = torch.zeros(n, width, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):], attn[i, width - len(p):] = torch.tensor(p), 1
        with torch.no_grad():  # the sampling loop
            cache, pos, step_ids, out = DynamicCache(), (attn.cumsum(-1) - 1).clamp(min=0), ids, []
            done = torch.zeros(n, dtype=torch.bool)
            gen_attn = attn
            for _ in range(new):
                logits = model(input_ids=step_ids, attention_mask=gen_attn, position_ids=pos, past_key_values=cache,
                               use_cache=True).logits[:, -1].float()
                nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1)[:, 0]
                nxt = nxt.masked_fill(done, tok.pad_token_id)
                out.append(nxt)
                done |= nxt == eos
                if bool(done.all()):
                    break
                step_ids = nxt[:, None]
                gen_attn = torch.cat([gen_attn, torch.ones(n, 1, dtype=attn.dtype)], 1)
                pos = pos[:, -1:] + 1
            comp = torch.stack(out, 1)
        comp_mask = torch.ones_like(comp, dtype=torch.float32)
        for i in range(n):  # keep the eos, mask what follows it
            hit = (comp[i] == eos).nonzero()
            if len(hit):
                comp_mask[i, int(hit[0]) + 1:] = 0
        lengths.append(float(comp_mask.sum(1).mean()))
        texts = tok.batch_decode(comp, skip_special_tokens=True)
        rewards = torch.tensor([check_answer("arithmetic", t, r["answer"]) for t, r in zip(texts, recs)])
        g = rewards.view(-1, group)
        adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).view(-1)
        full = torch.cat([ids, comp], 1)
        full_attn = torch.cat([attn, comp_mask.long()], 1)
        with amp():
            logits = model(input_ids=full, attention_mask=full_attn,
                           position_ids=(full_attn.cumsum(-1) - 1).clamp(min=0), use_cache=False).logits
        logits = logits[:, width - 1 : -1].float()
        logp = torch.log_softmax(logits / temperature, -1).gather(-1, comp[..., None])[..., 0]
        ratio = torch.exp(logp - logp.detach())  # on-policy: 1, gradient of logp
        per_seq = (ratio * adv[:, None] * comp_mask).sum(1) / comp_mask.sum(1).clamp(min=1)
        step(-per_seq.mean())
    return {"mean_response_length": sum(lengths) / len(lengths)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", choices=("sft", "dpo", "grpo"), required=True)
    parser.add_argument("--model", help="model folder (default: build the benchmark's tiny Llama)")
    parser.add_argument("--data", help="JSONL for sft/dpo (default: generated)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="bf16: forwards under bf16 autocast (fp32 weights), generation fp32")
    parser.add_argument("--result", help="write the JSON result here too")
    args = parser.parse_args(argv)
    import tempfile

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    point = ({"prompts": args.prompts, "samples": args.samples, "new_tokens": args.new_tokens} if args.work == "grpo"
             else {"batch": args.batch, "max_len": args.max_len})
    with tempfile.TemporaryDirectory() as tmp:
        model, data = args.model, args.data
        if model is None:
            sys.path.insert(0, str(Path(__file__).parent))
            from bench_vs_trl import build_model

            model = str(build_model(Path(tmp) / "model"))
        if data is None and args.work != "grpo":
            data = str(Path(tmp) / "data.jsonl")
            n = args.batch * (args.steps + args.warmup)
            (write_sft if args.work == "sft" else write_dpo)(Path(data), n, args.max_len)
        out = run_bare(args.work, model, data, point, args.steps + args.warmup, precision=args.precision)
    marks = out["step_end_times"]
    out["seconds_per_step"] = (marks[-1] - marks[args.warmup - 1]) / args.steps if args.warmup else None
    line = json.dumps({"work": args.work, "point": point, "precision": args.precision, **out})
    if args.result:
        Path(args.result).write_text(line)
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
