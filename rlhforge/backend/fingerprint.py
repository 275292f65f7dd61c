"""Cheap, exact fingerprints of weights: what a weight sync sent, what each engine received, and whether
the engine's own parameters changed (docs/reliability.md, "Weights that never reach the engines").

A tensor's checksum is two wrapping 64-bit integer sums over its bytes read as 32-bit (or 16-bit, or
8-bit) words: the plain sum and a position-weighted one (weights ``1 + i mod 65521``, so moved or
swapped elements change it). Integer addition modulo 2**64 is associative, so the result is the same
on any device, for any reduction order and any chunking: the sender (actor rank 0, on its GPU) and
the receiver (an engine worker, on its own) compute it where the tensor already lives, one pass, no
copy to host memory, no hashing of every byte. A fingerprint is a sha256 over the sorted per-tensor
lines ``name|dtype|shape|sum|weighted`` (order-free: tensors may stream in any order).

After every sync (always on) the trainer compares the sender's fingerprint with each engine's, and
checks that an engine that received new weights also changed its parameters
(:func:`check_sync_reports`); a mismatch stops the run with :class:`WeightSyncMismatch` naming the
engine.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Sequence

import torch

__all__ = ["tensor_checksum", "Fingerprint", "state_fingerprint", "params_checksum", "SyncReport",
           "WeightSyncMismatch", "check_sync_reports", "check_engine_sync"]

_MASK = (1 << 64) - 1
_MOD = 65521
_CHUNK = _MOD * 64  # words per pass (~4.2M: bounded extra memory)
_WEIGHTS: dict[tuple, torch.Tensor] = {}


def _weights(device: torch.device, chunk: int) -> torch.Tensor:
    """``1 + j mod 65521`` for ``j < chunk + 65521``, once per device: chunk ``[start, start + n)`` uses the
    slice from ``start mod 65521`` (the weights repeat with that period)."""
    key = (device, chunk)
    w = _WEIGHTS.get(key)
    if w is None:
        w = _WEIGHTS[key] = torch.arange(chunk + _MOD, device=device, dtype=torch.int64).remainder_(_MOD).add_(1)
    return w


def _words(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    n = flat.numel()
    if n % 4 == 0:
        return flat.view(torch.int32)
    if n % 2 == 0:
        return flat.view(torch.int16)
    return flat


def _state(t: torch.Tensor) -> tuple | None:
    """What identifies ``t``'s contents as they are now: its storage, layout and version counter (every
    in-place write through torch bumps it); None for tensors without one (inference tensors)."""
    try:
        return t._version, t.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device
    except RuntimeError:
        return None


#: ``id(tensor) -> (weak reference, _state, checksum)`` of the last checksums computed (one sync's worth)
_SEEN: dict[int, tuple] = {}


def _remember(t: torch.Tensor, state: tuple | None, sums: tuple[int, int]) -> None:
    if state is None:
        return
    if len(_SEEN) > 4096:  # keep only the live ones (a sync's tensors and an engine's parameters)
        for k in [k for k, (ref, _, _) in _SEEN.items() if ref() is None]:
            del _SEEN[k]
    try:
        _SEEN[id(t)] = (weakref.ref(t), state, sums)
    except TypeError:  # pragma: no cover - tensors take weak references
        pass


def tensor_checksum(t: torch.Tensor, reuse: bool = False) -> tuple[int, int]:
    """``(sum, position-weighted sum)`` of ``t``'s bytes as words, each modulo 2**64 (device-independent).

    ``reuse``: the same tensor object checksummed before, unchanged since (same storage, layout and version
    counter), gives that result without reading it again. Only for tensors written through torch's own
    ops (a write through ``.data`` or a collective into a reused buffer may leave the counter as it was):
    the in-process HF engine's own parameters and the state dicts handed to it."""
    state = _state(t)
    if reuse and state is not None:
        seen = _SEEN.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == state:
            return seen[2]
    sums = _checksum(t)
    _remember(t, state, sums)
    return sums


def _checksum(t: torch.Tensor) -> tuple[int, int]:
    w = _words(t)
    s1 = s2 = 0
    pos = _weights(w.device, _CHUNK)
    for start in range(0, w.numel(), _CHUNK):
        c = w[start : start + _CHUNK].to(torch.int64)
        s1 = (s1 + int(c.sum())) & _MASK
        off = start % _MOD
        s2 = (s2 + int(c.mul_(pos[off : off + c.numel()]).sum())) & _MASK
    return s1, s2


class Fingerprint:
    """Order-free fingerprint of named tensors, added as they stream past (nothing is kept but one short
    line per tensor)."""

    def __init__(self, reuse: bool = False):
        self.parts: dict[str, str] = {}
        self.reuse = reuse  # tensor_checksum(reuse=)

    def add(self, name: str, t: torch.Tensor) -> torch.Tensor:
        s1, s2 = tensor_checksum(t, self.reuse)
        self.parts[name] = f"{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}|{s1}|{s2}"
        return t

    def __len__(self) -> int:
        return len(self.parts)

    def hexdigest(self) -> str:
        return hashlib.sha256("".join(f"{k}={v};" for k, v in sorted(self.parts.items())).encode()).hexdigest()


def state_fingerprint(named, reuse: bool = False) -> str:
    """:class:`Fingerprint` of a state dict (or of (name, tensor) pairs): equal weights, equal print
    (``reuse``: :func:`tensor_checksum`'s)."""
    fp = Fingerprint(reuse)
    for name, t in (named.items() if isinstance(named, dict) else named):
        fp.add(name, t)
    return fp.hexdigest()


def params_checksum(module: torch.nn.Module, reuse: bool = False) -> str:
    """Fingerprint of a module's own parameters and buffers as they are now (an engine's model, whose
    names and layout may differ from the trainer's: only compared with itself before and after a load;
    ``reuse``: :func:`tensor_checksum`'s)."""
    fp = Fingerprint(reuse)
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        if t.device.type != "meta":
            fp.add(name, t)
    return fp.hexdigest()


class SyncReport(dict):
    """One engine worker's account of a sync: ``fingerprint`` (what arrived), ``tensors`` (how many),
    ``params_changed`` (its parameters differ from before the load), ``previous`` (the fingerprint of the
    sync before; None: the engine never synced, so it still holds the weights it started with)."""


class WeightSyncMismatch(RuntimeError):
    """After a weight sync, an engine holds something other than what the trainer sent."""


def check_sync_reports(expected: str, reports: Sequence[tuple[str, Sequence[dict]]], version: int) -> None:
    """Raise :class:`WeightSyncMismatch` unless every engine worker received ``expected`` and, when what it
    received changed since its previous sync, its parameters changed too. ``reports``: ``(engine name,
    [report of each of its workers])``; ``version``: the weights version this sync loads."""
    problems = []
    for name, workers in reports:
        for rank, rep in enumerate(workers):
            who = name if len(workers) == 1 else f"{name} worker {rank}"
            got = rep.get("fingerprint")
            if got != expected:
                problems.append(f"{who} received weights with fingerprint {str(got)[:12]} ({rep.get('tensors')} tensors), "
                                f"the trainer sent {expected[:12]}")
            elif rep.get("previous") not in (None, got) and not rep.get("params_changed", True):
                problems.append(f"{who} received new weights ({got[:12]}) but its parameters did not change "
                                "(the names were not loaded)")
    if problems:
        raise WeightSyncMismatch(f"weight sync to version {version} did not reach the engines: " + "; ".join(problems)
                                 + ". Generation would use stale weights; the run stops (docs/reliability.md)")




def check_engine_sync(engine, expected: str | None, version: int) -> None:
    """:func:`check_sync_reports` for an engine the trainer loaded itself (``engine.sync_reports()``: the
    HF engine, in-process vLLM engines and their router). ``expected``: the sender's fingerprint. An
    engine without reports (a test double, a user's own engine) is not checked."""
    reports = getattr(engine, "sync_reports", None)
    if reports is None or expected is None:
        return
    check_sync_reports(expected, reports(), version)
