"""What the RL workers share (:mod:`rlhforge.workers.actor`, :mod:`rlhforge.workers.critic`):
checkpoint state, export, memory and sleep of a trainable model, moving batches, per-sample results,
the per-step plan a strategy is built with, and the reduction of step metrics over ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from rlhforge.algorithms import entropy_from_logits
from rlhforge.workers.experience import ExperienceSample, collate_experience, split_packed, unpad_rows
from rlhforge.models.forward import is_packed

__all__ = ["TrainableWorker", "to_device", "per_sample", "shifted_entropy", "scatter", "reduce_step_metrics"]


class TrainableWorker:
    """What actor and critic workers share: checkpoint state, export, memory, sleep."""

    strategy: Any
    tokenizer: Any
    train_tokens: int | None = None
    """``--train.dynamic_batch_enable``: token budget of a training micro-batch (None: fixed micro-batches)."""
    pass_tokens: int | None = None
    """... and of a no-grad (log-prob / value) micro-batch (``--rollout.max_tokens_per_gpu``)."""

    ema: Any = None
    """``--train.enable_ema`` (actor): a ``backend.ema.ParamEMA``; HF exports write the EMA weights and
    resume states hold it (weight sync and training use the live weights)."""

    def _batch(self, chunk, **kw) -> dict:
        """A micro-batch of experience samples, collated (:func:`collate_experience`) on this worker's device."""
        return to_device(collate_experience(chunk, self.tokenizer.pad_token_id, self.packed, **kw), self.device)

    def save_state(self, directory) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.strategy.save_state(Path(directory))
        if self.ema is not None:
            self.ema.save(directory)

    def load_state(self, directory) -> None:
        self.strategy.load_state(Path(directory))
        if self.ema is not None:
            self.ema.load(directory)

    def save_hf(self, out_dir) -> None:
        import contextlib

        from rlhforge.models.export import save_hf

        with self.ema.swapped() if self.ema is not None else contextlib.nullcontext():
            save_hf(self.strategy, self.tokenizer, Path(out_dir))

    def peak_memory_gb(self) -> float:
        from rlhforge.backend.device import peak_memory_bytes

        return peak_memory_bytes(self.strategy.device) / 2**30

    def release_cached_memory(self) -> int:
        """Cached, unused device memory back to the GPU (before a colocated engine wakes up); bytes released."""
        from rlhforge.backend.device import release_cached_memory

        return release_cached_memory(self.strategy.device)

    def offload_states(self) -> dict:
        """``--ds.enable_sleep``: optimizer states to host memory between training phases."""
        from rlhforge.backend.sleep import offload_states

        return offload_states(self.strategy)

    def reload_states(self) -> dict:
        from rlhforge.backend.sleep import reload_states

        return reload_states(self.strategy)


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def per_sample(x: torch.Tensor, batch: dict, samples: Sequence[ExperienceSample],
               dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """A micro-batch's per-token values (``[B, T, ...]`` padded, ``[1, N, ...]`` packed) -> one ``[len, ...]``
    tensor per sample, as ``dtype`` on the CPU."""
    x = x.detach().to(dtype).cpu()
    if is_packed(batch):
        return [t.clone() for t in split_packed(x, batch["seq_lens"])]
    return unpad_rows(x, [len(s) for s in samples])


def scatter(groups: Sequence[Sequence[int]], results: Sequence[Sequence[Any]], n: int) -> list:
    """Per-micro-batch results (one per index of each group) -> one list of ``n`` in sample order."""
    out: list = [None] * n
    for idx, rows in zip(groups, results):
        for i, row in zip(idx, rows):
            out[i] = row
    return out


def shifted_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[B, T] entropy of the distribution that predicted token t (0 at t = 0)."""
    ent = entropy_from_logits(logits[:, :-1], temperature=temperature)
    return torch.cat([torch.zeros_like(ent[:, :1]), ent], dim=1)


def reduce_step_metrics(dp_scaled: dict[str, float], token_weighted: dict[str, float], all_reduce,
                        world_size: int) -> dict[str, float]:
    """Per-rank metrics of one optimizer step -> the step's global values, in one all-reduce (sum).

    The two kinds need different reductions:

    - ``dp_scaled``: losses built by ``aggregate_loss`` (``policy_loss``, ``kl_loss``,
      ``value_loss``). Each rank's value is ``sum over its tokens * dp / N_global`` (the
      ``dp_size`` scaling that makes averaged gradients exact), so the global value is the
      **mean** over ranks: ``sum / dp``.
    - ``token_weighted``: everything else (``entropy``, and whatever the policy / value loss
      returns: ``clip_frac``, ``approx_kl``, ``ratio_mean``, ``dual_clip_frac``, ``values_mean``
      ...). Each rank's value is ``sum over its micro-batches of (micro-batch mean x micro-batch
      tokens / N_global)``: a partial sum of the global token mean, so the global value is the
      **sum** over ranks.

    ``all_reduce(tensor, op="sum")`` is the strategy's (identity with one rank). Pure arithmetic
    otherwise; ``tests/distributed/test_metric_reduction.py`` checks it on 1 vs 2 ranks.
    """
    both = set(dp_scaled) & set(token_weighted)
    if both:
        raise ValueError(f"metrics {sorted(both)} are listed as both dp-scaled and token-weighted")
    keys = sorted(dp_scaled) + sorted(token_weighted)
    values = {**dp_scaled, **token_weighted}
    if not keys:
        return {}
    summed = all_reduce(torch.tensor([float(values[k]) for k in keys], dtype=torch.float64), op="sum").tolist()
    out = {k: float(v) for k, v in zip(keys, summed)}
    for k in dp_scaled:
        out[k] /= world_size
    return out
