"""One optimizer step, and its no-grad twin, for every paradigm (SFT, RM, DPO, the RL actor and critic).

Each paradigm keeps only its loss function; the loop is here::

    norm = step_normaliser(strategy, tokens=..., seqs=...)          # one all-reduce: the global counts
    out = run_step(strategy, micro_batches, loss_fn, norm, dummy=...)
    # for each micro-batch: loss, totals = loss_fn(mb, norm) under strategy.autocast(),
    #   strategy.backward(loss, is_last_micro_batch); then strategy.step(); totals summed over the
    #   micro-batches and over the ranks (one all-reduce) -> out.totals

The loss contract (DESIGN.md, the seam :mod:`rlhforge.backend.strategy`): a loss function returns its
micro-batch's *share* of the step's loss, normalised by the **global** token (or sequence) count of the
whole optimizer step over every micro-batch and rank (:class:`StepNormaliser`: ``sum * dp / N``), so
results do not depend on the number of ranks or micro-batches. Strategies sum gradients over
micro-batches and average them over the data-parallel ranks.

``None`` entries in ``micro_batches`` are dummy passes (``dummy`` runs, its loss x 0, its totals
dropped): every rank runs the same number of forward/backward passes (ZeRO-3 gathers, DDP hooks).

Ranks that hold the same samples (the ``R`` ranks of a ring with ring attention, the ranks of an AutoTP
group) are ``copies``: global counts and reduced totals are divided by them; the data-parallel size is
``world / tp`` (DeepSpeed averages AutoTP gradients over that), while a ring's ranks each scale as if
alone and their partial gradients add up.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from rlhforge.algorithms.aggregation import aggregate_loss

__all__ = ["StepNormaliser", "StepResult", "step_normaliser", "run_step", "run_no_grad", "reduce_totals",
           "pad_micro_batch_count", "sum_totals"]


@dataclass(frozen=True)
class StepNormaliser:
    """The global counts of one optimizer step (each sample counted once) and the data-parallel size."""

    tokens: float
    """Loss tokens of the whole step, all micro-batches of all ranks."""
    seqs: float
    """Sequences (or pairs) of the whole step."""
    dp_size: int
    """Data-parallel ranks gradients are averaged over."""
    copies: int = 1
    """Ranks holding each sample (ring x AutoTP): reduced totals are divided by it."""
    norm_constant: float | None = None
    """Dr. GRPO's constant (``seq_mean_token_sum_norm``)."""

    def aggregate(self, loss: torch.Tensor, mask: torch.Tensor, mode: str = "token_mean") -> torch.Tensor:
        """Per-token ``loss`` [B, T] -> this micro-batch's share of the step's ``mode`` aggregate."""
        return aggregate_loss(loss, mask, mode, global_tokens=self.tokens, global_seqs=self.seqs,
                              dp_size=self.dp_size, norm_constant=self.norm_constant)

    def seq_share(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """A summed per-sequence (per-pair) loss -> its share of the step's mean over sequences."""
        return loss_sum * (self.dp_size / max(float(self.seqs), 1.0))


def step_normaliser(strategy, *, tokens: float = 0.0, seqs: float = 0.0, ring_size: int = 1,
                    norm_constant: float | None = None) -> StepNormaliser:
    """This rank's ``tokens`` and ``seqs`` summed over the ranks (one all-reduce) -> :class:`StepNormaliser`."""
    counts = strategy.all_reduce(torch.tensor([float(tokens), float(seqs)]), op="sum")
    tp = getattr(strategy, "tp_size", 1)
    copies = ring_size * tp
    return StepNormaliser(tokens=float(counts[0]) / copies, seqs=float(counts[1]) / copies,
                          dp_size=strategy.world_size // tp, copies=copies, norm_constant=norm_constant)


def pad_micro_batch_count(strategy, batches: list) -> list:
    """Every rank must run the same number of passes (ZeRO-3 gathers, DDP hooks): ranks with fewer
    micro-batches get ``None`` entries (dummy passes of :func:`run_step` / :func:`run_no_grad`)."""
    count = strategy.all_reduce(torch.tensor(float(len(batches))), op="max")
    return list(batches) + [None] * (int(count.item()) - len(batches))


def reduce_totals(strategy, totals: dict[str, float], copies: int = 1) -> dict[str, float]:
    """Per-rank sums -> sums over the ranks (one all-reduce, float64), each sample counted once."""
    if not totals:
        return {}
    keys = sorted(totals)
    summed = strategy.all_reduce(torch.tensor([float(totals[k]) for k in keys], dtype=torch.float64), op="sum")
    return {k: float(v) / copies for k, v in zip(keys, summed.tolist())}


def _add(totals: dict[str, float], more: dict[str, Any]) -> None:
    for k, v in more.items():
        totals[k] = totals.get(k, 0.0) + float(v.detach().double() if torch.is_tensor(v) else v)


def sum_totals(results: Sequence[dict[str, Any] | None]) -> dict[str, float]:
    """Dicts of per-micro-batch totals (``None``: a dummy pass) -> their sums (float64)."""
    totals: dict[str, float] = {}
    for r in results:
        if r is not None:
            _add(totals, r)
    return totals


@dataclass
class StepResult:
    totals: dict[str, float]
    """The loss function's totals summed over micro-batches and ranks (/ copies)."""
    stats: dict[str, float]
    """``strategy.step()``: ``grad_norm``, ``lr``, ``skipped``."""
    micro_batches: int
    """Forward/backward passes this rank ran (dummies included)."""
    extra: dict = field(default_factory=dict)

    @property
    def skipped(self) -> bool:
        return bool(self.stats.get("skipped", 0.0))


LossFn = Callable[[Any, StepNormaliser], "tuple[torch.Tensor, dict[str, Any]]"]


def run_step(strategy, micro_batches: Sequence[Any], loss_fn: LossFn, norm: StepNormaliser, *,
             dummy: Any = None, reduce: bool = True) -> StepResult:
    """One optimizer step: ``loss, totals = loss_fn(mb, norm)`` for each micro-batch under
    ``strategy.autocast()`` (``loss`` already normalised by ``norm``: :meth:`StepNormaliser.aggregate`),
    ``strategy.backward``, then ``strategy.step()`` (clip, optimizer, scheduler). ``totals`` are summed
    over the real micro-batches and (``reduce``) over the ranks in one all-reduce, divided by
    ``norm.copies``."""
    totals: dict[str, float] = {}
    n = len(micro_batches)
    for k, mb in enumerate(micro_batches):
        is_dummy = mb is None
        with strategy.autocast():
            loss, mb_totals = loss_fn(dummy if is_dummy else mb, norm)
        strategy.backward(loss * 0.0 if is_dummy else loss, is_last_micro_batch=k == n - 1)
        if not is_dummy:
            _add(totals, mb_totals)
    stats = strategy.step()
    if reduce:
        totals = reduce_totals(strategy, totals, norm.copies)
    return StepResult(totals=totals, stats=stats, micro_batches=n)


@torch.no_grad()
def run_no_grad(strategy, micro_batches: Sequence[Any], fn: Callable[[Any], Any], *, dummy: Any = None) -> list:
    """``fn(mb)`` for each micro-batch with the model in eval mode, without gradients, under
    ``strategy.autocast()`` (log-probs, values, evaluation); ``None`` entries run ``dummy`` (collectives
    stay aligned) and give ``None``. The model is back in train mode afterwards."""
    strategy.eval()
    out = []
    try:
        for mb in micro_batches:
            with strategy.autocast():
                result = fn(dummy if mb is None else mb)
            out.append(None if mb is None else result)
    finally:
        strategy.train()
    return out
