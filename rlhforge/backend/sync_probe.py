"""The post-sync effect check: after every weight sync the engines score a small fixed probe and their
log-probs must match the trainer's (docs/rl.md, "Weights in effect after every sync").

A fingerprint (:mod:`rlhforge.backend.fingerprint`) proves the bytes arrived and the engine's parameters
changed; it cannot see weights that the engine's kernels do not read (a load that skipped vLLM's
post-load processing: on vLLM's CPU build the linear weights are repacked after loading, so a bare
``load_weights`` changes the parameters and nothing the kernels compute with) or weights put back
after the load (a wake that maps a stale copy). The probe measures the effect instead: the same token
sequences, scored by each engine (prompt log-probs, temperature 1, no filtering) and by the actor
(the forward that computes the old log-probs), compared token by token.

This module is the pure part: which tokens (:func:`probe_prompts`), the default bound per precision
(:func:`default_probe_bound`), the statistics (:func:`compare_probe`) and the stop
(:func:`check_probe`, :class:`WeightsNotInEffect`, a :class:`WeightSyncMismatch`).
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch

from rlhforge.backend.fingerprint import WeightSyncMismatch

__all__ = ["PROBE_BOUNDS", "PROBE_FALLBACK_TEXT", "WeightsNotInEffect", "probe_prompts", "default_probe_bound",
           "compare_probe", "check_probe"]

PROBE_BOUNDS = {"fp32": 1e-3, "bf16": 0.1, "fp16": 0.1}
"""Default bound on the mean absolute per-token log-prob difference, by the run's lower precision.

fp32 engine and fp32 trainer: the same weights give the same log-probs up to kernel rounding: 2e-7 mean
(1e-6 max) for vLLM's CPU build and for the HF engine against torch on the tiny test model
(benchmarks/results/sync_probe_cpu.json); fp32 GPU kernels should stay well below 1e-3 too (not measured
here: no GPU; a run that turns TF32 matmuls on should set the bound itself). One
optimizer step of the tests' runs moves the actor's probe log-probs by 0.02-0.2 per token, so 1e-3 sees an
engine one step stale. bf16/fp16 (either side): each logit keeps ~3 significant digits and engine and
trainer round differently: 1e-3 mean (4e-3 max) for vLLM's CPU bf16 kernels vs torch bf16 on the tiny
model, more for real models, whose logits are larger; 0.1 leaves that room and still stops weights the
kernels do not read (a skipped repack: 0.18 per token one step in; wrong layouts: nats). What a stale engine
would show is logged every sync (``sync/probe_policy_change``): where it stays below the bound, lower the
bound (``--train.sync_probe_bound``) to see one-step staleness."""

PROBE_FALLBACK_TEXT = ("The quick brown fox jumps over the lazy dog. 12 + 30 = 42, and the answer is "
                       "written in the box: \\boxed{42}.")
"""The probe when no prompt of the run can be one (every prompt carries images): tokenized by the run's
tokenizer."""


class WeightsNotInEffect(WeightSyncMismatch):
    """After a weight sync an engine's log-probs on the probe differ from the trainer's by more than the
    bound: the weights arrived (fingerprints match) but the engine does not compute with them."""


def probe_prompts(prompts: Iterable[Sequence[int]], max_tokens: int,
                  fallback: Callable[[], Sequence[int]] | None = None) -> list[list[int]]:
    """The probe: the first prompts of the run, in order, until ``max_tokens`` tokens (the last one cut),
    each at least 2 tokens long (the first token of a sequence has no log-prob). Each is a prompt the
    engines already serve, so each fits their length limit. ``fallback()``: token ids used when no prompt
    qualifies (e.g. every prompt carries images)."""
    out, total = [], 0
    for ids in prompts:
        if total >= max_tokens:
            break
        ids = [int(t) for t in ids][: max_tokens - total]
        if len(ids) >= 2:
            out.append(ids)
            total += len(ids)
    if not out and fallback is not None:
        ids = [int(t) for t in fallback()][:max_tokens]
        out = [ids] if len(ids) >= 2 else []
    if not out:
        raise ValueError("no probe for the post-sync check: no prompt has 2 tokens or more")
    return out


def default_probe_bound(engine_dtype: str, trainer_dtype: str) -> float:
    """The bound for an engine in ``engine_dtype`` and a trainer in ``trainer_dtype`` (``fp32``/``bf16``/
    ``fp16``): the looser of the two (:data:`PROBE_BOUNDS`)."""
    try:
        return max(PROBE_BOUNDS[engine_dtype], PROBE_BOUNDS[trainer_dtype])
    except KeyError as err:
        raise ValueError(f"unknown precision {err.args[0]!r} (known: {', '.join(PROBE_BOUNDS)})") from None


def compare_probe(trainer: Sequence[Sequence[float]], engines: Sequence[tuple[str, Sequence[Sequence[float]]]]
                  ) -> dict[str, tuple[float, float]]:
    """``{engine name: (mean, max)}`` of ``|engine - trainer|`` over every probe token. ``trainer`` and
    each engine's entry: one list of log-probs per probe sequence (tokens 2..n), same lengths."""
    ref = torch.cat([torch.as_tensor(list(r), dtype=torch.float64) for r in trainer])
    out = {}
    for name, rows in engines:
        if len(rows) != len(trainer) or any(len(a) != len(b) for a, b in zip(rows, trainer)):
            raise ValueError(f"{name} scored {[len(r) for r in rows]} probe tokens, the trainer "
                             f"{[len(r) for r in trainer]}")
        diff = (torch.cat([torch.as_tensor(list(r), dtype=torch.float64) for r in rows]) - ref).abs()
        out[name] = (float(diff.mean()), float(diff.max()))
    return out


def check_probe(stats: dict[str, tuple[float, float]], bound: float, version: int) -> None:
    """Raise :class:`WeightsNotInEffect` naming every engine whose mean difference exceeds ``bound`` (a
    non-finite difference always does) after the sync of weights ``version``."""
    bad = {name: s for name, s in stats.items() if not s[0] <= bound}
    if bad:
        raise WeightsNotInEffect(
            f"weight sync to version {version} did not take effect: "
            + "; ".join(f"{name}'s log-probs on the probe differ from the trainer's by {m:.3g} per token "
                        f"(max {mx:.3g})" for name, (m, mx) in bad.items())
            + f", above --train.sync_probe_bound {bound:g}. The fingerprints matched, so the weights arrived but the "
            "engine does not compute with them; generation would use other weights than the trainer's; the run "
            "stops (docs/rl.md, \"Weights in effect after every sync\")")
