"""DeepSpeed AutoTP training (``--ds.tensor_parallel_size N``): the linear layers of each decoder
block are split over groups of N consecutive ranks (column-parallel q/k/v/gate/up, row-parallel
o/down with an all-reduce), by DeepSpeed itself during ``deepspeed.initialize`` (DS config
``tensor_parallel: {autotp_size: N}``).

The ranks of one tensor-parallel group see the same samples, so the data-parallel size is
``world / N`` and the data-parallel rank ``rank // N`` (:func:`tp_layout`); the global batch
arithmetic uses the data-parallel size. The output head is kept whole (``vocab_parallel_lm_head:
false``) so log-probs and entropies come from full-vocabulary logits as everywhere else.

Runs on CPU with gloo (tested at 2 ranks: equal loss and gradients to one rank) and on GPU with
NCCL. DeepSpeed's AutoTP training supports ZeRO stages 0-2, not 3.
"""

from __future__ import annotations

from typing import Iterator

import torch

__all__ = ["autotp_ds_config", "tp_layout", "check_tp_size", "iter_gathered_weights", "data_shard", "copies"]


def autotp_ds_config(tp_size: int) -> dict:
    """The ``tensor_parallel`` block of the DeepSpeed config."""
    return {"autotp_size": tp_size, "vocab_parallel_lm_head": False}


def check_tp_size(tp_size: int, world_size: int, zero_stage: int) -> None:
    """Refuse layouts DeepSpeed cannot run, showing the arithmetic."""
    if tp_size < 1:
        raise ValueError(f"--ds.tensor_parallel_size must be >= 1 (got {tp_size})")
    if world_size % tp_size:
        raise ValueError(f"--ds.tensor_parallel_size {tp_size} must divide the {world_size} training ranks "
                         f"(ranks = data-parallel size x tensor-parallel size)")
    if tp_size > 1 and zero_stage == 3:
        raise ValueError(f"--ds.tensor_parallel_size {tp_size} with --ds.zero_stage 3: DeepSpeed's AutoTP training "
                         "runs with ZeRO stages 0-2 (use --ds.zero_stage 1 or 2)")


def tp_layout(rank: int, world_size: int, tp_size: int) -> tuple[int, int]:
    """``(data-parallel rank, data-parallel size)`` of ``rank`` when groups of ``tp_size`` consecutive
    ranks share one model (DeepSpeed's (dp, tp) mesh: tp is the fastest-varying dimension)."""
    return rank // tp_size, world_size // tp_size


def iter_gathered_weights(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Full (unsplit) parameters and persistent buffers of an AutoTP module, one module at a time
    (every rank must iterate; each tensor is valid only until the next one is yielded). Tied
    parameters are yielded under each of their names."""
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    persistent = set(module.state_dict().keys())

    def walk(mod: torch.nn.Module, prefix: str):
        params = [p for p in mod.parameters(recurse=False) if p is not None]
        with GatherReplacedLayerParams(params, mod, enabled=bool(params)):
            for name, param in mod.named_parameters(recurse=False, remove_duplicate=False):
                yield prefix + name, param.detach()
        for name, buf in mod.named_buffers(recurse=False):
            if prefix + name in persistent:
                yield prefix + name, buf.detach()
        for name, child in mod.named_children():
            yield from walk(child, f"{prefix}{name}.")

    yield from walk(module, "")


def data_shard(strategy) -> tuple[int, int]:
    """``(data rank, data ranks)`` of any strategy: with AutoTP the ranks of one tensor-parallel group
    share a data shard; otherwise every rank is its own."""
    return getattr(strategy, "dp_rank", strategy.rank), getattr(strategy, "dp_size", strategy.world_size)


def copies(strategy) -> int:
    """How many ranks hold each sample (the tensor-parallel size): a sum over all ranks of per-sample
    statistics counts each sample this many times."""
    return getattr(strategy, "tp_size", 1)
