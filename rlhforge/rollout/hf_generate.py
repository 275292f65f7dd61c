"""Generation helpers: batched HF ``generate`` (:func:`generate_ids`) and the HF engine's batched sampler.

Sampling for the engine (:func:`sample_batch`) draws every row of a decoding step at once, with
*counter-based* randomness: row ``b``'s uniform at response position ``t`` is a hash of ``(seed_b, t)``
(:func:`counter_uniform`, 46 bits from two 23-bit draws), and the token is the inverse-CDF draw from
``softmax`` of the top-k / top-p filtered logits: the first token whose cumulative probability (summed in
float64) exceeds ``u`` times the total, an exact draw from that distribution that reads the probabilities
twice (exponent and running sum) instead of hashing and transforming noise for every vocabulary entry.
A request's tokens therefore depend only on its prompt, parameters, seed and the weights: not on the
other rows of the batch, on the order of the rows, or on any global RNG state. The log-prob of each
sampled token under ``log_softmax(logits / T)`` (before filtering; ``T = 1`` when greedy) comes from the
same pass.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

__all__ = ["generate_ids", "counter_uniform", "filter_logits_batch", "sample_batch", "seed_keys", "shared_prompts",
           "left_padded", "batch_sampling", "row_uniform", "row_uniforms", "inverse_cdf"]

_MASK32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """``(x * c) mod 2**32`` for int64 tensors of 32-bit values. A constant above 2**31 is used as
    ``c - 2**32`` (same low 32 bits), so the int64 product never overflows."""
    return (x * (c - 2**32 if c >= 2**31 else c)) & _MASK32


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (``lowbias32``, C. Wellons) on int64 tensors of 32-bit values."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_keys(seeds: Sequence[int]) -> Tensor:
    """[B] int64 32-bit keys from 64-bit request seeds (both halves of the seed count)."""
    seeds = [int(s) % 2**64 for s in seeds]
    lo = torch.tensor([s & _MASK32 for s in seeds], dtype=torch.long)
    hi = torch.tensor([s >> 32 for s in seeds], dtype=torch.long)
    return _mix32(_mix32(lo) ^ _mix32(hi ^ 0x5BD1E995))


_VOCAB_HASH: dict[tuple[int, str], Tensor] = {}


def _vocab_hash(vocab: int, device: torch.device) -> Tensor:
    key = (vocab, str(device))
    if key not in _VOCAB_HASH:
        _VOCAB_HASH[key] = _mix32(_mul32(torch.arange(vocab, dtype=torch.long, device=device), 0x85EBCA6B) ^ 0x27D4EB2F)
    return _VOCAB_HASH[key]


def _as_int32(x: Tensor) -> Tensor:
    """int64 tensor of 32-bit values -> int32 with the same 32 bits."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


_VOCAB_HASH32: dict[tuple[int, str], Tensor] = {}


def _mix32_inplace(x: Tensor) -> Tensor:
    """:func:`_mix32` on an int32 tensor holding the 32 bits (overwritten): the same bits in half the memory
    traffic. int32 products wrap modulo 2**32 (the low 32 bits of the int64 product); int32's right shift is
    arithmetic, so its sign-extended bits are masked off (the logical shift of the unsigned value)."""
    y = torch.empty_like(x)
    for shift, mult in ((16, 0x7FEB352D), (15, 0x846CA68B), (16, None)):
        torch.bitwise_right_shift(x, shift, out=y).bitwise_and_((1 << (32 - shift)) - 1)
        x.bitwise_xor_(y)
        if mult is not None:
            x.mul_(mult - 2**32 if mult >= 2**31 else mult)
    return x


def counter_uniform(keys: Tensor, step: int, vocab: int) -> Tensor:
    """[B, V] float32 uniform noise in (0, 1), a pure function of ``(keys[b], step, v)``.

    The ``[B, V]`` grid is hashed in int32 with the bits of the int64 form (:func:`_counter_uniform_int64`,
    which a test holds it to, bit for bit): at a 151,936-token vocabulary and 16 rows the int64 form was
    most of a sampling step (36 ms, against 53 ms for the lm_head's matmul)."""
    return _uniform_grid(_step_keys(keys, torch.full_like(keys, int(step) & _MASK32)), vocab)


def _step_keys(keys: Tensor, steps: Tensor) -> Tensor:
    """The (seed, step) hashes of ``keys`` and ``steps`` (int64 tensors of 32-bit values, broadcast)."""
    return _mix32(keys ^ _mul32(steps, 0x9E3779B9))


def _uniform_grid(k: Tensor, vocab: int) -> Tensor:
    """[..., V] float32 uniforms in (0, 1) from the (seed, step) hashes ``k`` [...]: entry ``v`` hashes ``k``
    with ``v``'s own hash (a bijection of ``v`` for each ``k``)."""
    key = (vocab, str(k.device))
    if key not in _VOCAB_HASH32:
        _VOCAB_HASH32[key] = _as_int32(_vocab_hash(vocab, k.device))
    h = _mix32_inplace(torch.bitwise_xor(_as_int32(k)[..., None], _VOCAB_HASH32[key]))
    # 23 bits: (m + 0.5) / 2**23 is exact in float32, so the noise never reaches 0 or 1
    return (h.bitwise_right_shift_(9).bitwise_and_(0x7FFFFF).float() + 0.5) * (1.0 / 2**23)


def _counter_uniform_int64(keys: Tensor, step: int, vocab: int) -> Tensor:
    """:func:`counter_uniform` in int64 arithmetic (its former form, the reference it equals bit for bit)."""
    k = _mix32(keys ^ _mul32(torch.full_like(keys, int(step) & _MASK32), 0x9E3779B9))  # [B]: (seed, step)
    h = _mix32(k[:, None] ^ _vocab_hash(vocab, keys.device)[None, :])  # a bijection of v for each (seed, step)
    return ((h >> 9).float() + 0.5) * (1.0 / 2**23)


def filter_logits_batch(logits: Tensor, top_p: Tensor, top_k: Tensor, *, any_filter: bool | None = None) -> Tensor:
    """Mask (``-inf``) tokens outside each row's top-k, then outside its top-p nucleus. [B, V].

    ``top_k`` [B] int (<= 0 or >= V: all), ``top_p`` [B] float (>= 1: all). Rows without either
    are returned unchanged; top-p keeps tokens until the mass before them reaches ``top_p``.
    ``any_filter``: whether some row filters at all, when the caller knows (the decode loop decides it
    once per batch instead of a device -> host sync per step); None: found from the tensors.
    """
    vocab = logits.shape[-1]
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1.0
    if any_filter is None:
        any_filter = bool(use_k.any()) or bool(use_p.any())
    if not any_filter:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    # rows without a top-k (use_k False) or a top-p (use_p False) keep every token
    kth = sorted_logits.gather(-1, (top_k.clamp(1, vocab) - 1)[:, None])  # [B, 1]
    sorted_logits = sorted_logits.masked_fill(use_k[:, None] & (sorted_logits < kth), float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    remove = (probs.cumsum(-1) - probs) >= top_p[:, None]
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove & use_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample_batch(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor, keys: Tensor, step: int, *,
                 all_greedy: bool | None = None, any_filter: bool | None = None, banned: Tensor | None = None,
                 any_greedy: bool | None = None, uniforms: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """One token per row and its log-prob, all rows at once.

    Args:
        logits: [B, V] float32 next-token logits.
        temperature: [B] float; 0 means greedy (argmax, log-prob under ``log_softmax(logits)``).
        top_p, top_k: [B] per-row filters (see :func:`filter_logits_batch`); greedy rows ignore them.
        keys: [B] int64 per-request keys (:func:`seed_keys`).
        step: the response position being sampled (0 for the first generated token).
        all_greedy, any_filter, any_greedy: known once per batch by the decode loop (no per-step host
            sync); None: found from the tensors.
        uniforms: [B] float64, ``row_uniform(keys, step)`` when the caller made every step's at once
            (:func:`row_uniforms`); None: made here.
        banned: token ids never chosen (greedy or sampled); like a filter, they do not change the
            log-probs (those of the unfiltered distribution).

    Returns:
        ``(tokens [B] int64, logprobs [B] float32)`` with log-probs of ``log_softmax(logits / T)``.
    """
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / scale[:, None]
    logp_all = torch.log_softmax(scaled, dim=-1)
    if banned is not None:
        logits = logits.index_fill(-1, banned, float("-inf"))
        scaled = scaled.index_fill(-1, banned, float("-inf"))
    if all_greedy is None:
        all_greedy = bool(greedy.all())
    if all_greedy:
        tokens = torch.argmax(logits, dim=-1)
    else:
        filtered = filter_logits_batch(scaled, top_p, top_k, any_filter=any_filter)
        # unfiltered and nothing banned: the probabilities are those of the log-probs already computed
        probs = logp_all.exp() if filtered is scaled and banned is None else torch.softmax(filtered, dim=-1)
        u = row_uniform(keys.to(logits.device), step) if uniforms is None else uniforms
        tokens = inverse_cdf(probs, u)
        if any_greedy is None:
            any_greedy = bool(greedy.any())
        if any_greedy:
            tokens = torch.where(greedy, torch.argmax(logits, dim=-1), tokens)
    return tokens, logp_all.gather(-1, tokens[:, None])[:, 0]


def row_uniform(keys: Tensor, step: int) -> Tensor:
    """[B] float64 uniforms in (0, 1), a pure function of ``(keys[b], step)``: two 23-bit counter draws
    (:func:`counter_uniform` at entries 0 and 1) make 46 bits, so the inverse CDF resolves probabilities far
    below float32's 2**-23."""
    return _refined(counter_uniform(keys, step, 2))


def row_uniforms(keys: Tensor, steps: int) -> Tensor:
    """[B, steps] float64: column ``t`` is ``row_uniform(keys, t)``, bit for bit (the same integer hash and the
    same float arithmetic, elementwise), made in one pass instead of ~15 small ops at every decoding step."""
    t = torch.arange(steps, dtype=torch.long, device=keys.device)
    return _refined(_uniform_grid(_step_keys(keys[:, None], t[None, :]), 2))


def _refined(draws: Tensor) -> Tensor:
    """[...] float64 from two float32 draws [..., 2]: the first's grid (m + 0.5) / 2**23, refined within its own
    cell by the second."""
    hi, lo = draws.double().unbind(-1)
    return hi + (lo - 0.5) * (1.0 / 2**23)


#: vocabulary entries per block of :func:`inverse_cdf`'s two-level running sum
CDF_BLOCK = 128
#: vocabularies up to this size take the one-level running sum: on one core at 16 rows it took 30-62 us
#: against 73-80 for the two levels from 600 to 2,000 entries; the two levels win from ~3,000 (4,096: 81
#: against 112 us; 151,936: 2.6 against 19 ms)
ONE_LEVEL_MAX = 16 * CDF_BLOCK


def inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """[B] the first index whose cumulative sum of ``probs`` [B, V] (float64) exceeds ``u`` [B] times the row's
    total: a draw from ``probs / total`` for ``u`` uniform in (0, 1). A zero-probability entry is never drawn.

    Above :data:`ONE_LEVEL_MAX` entries the running sum goes in two levels: float64 sums of blocks of
    :data:`CDF_BLOCK` entries and their running sum find the block, then a float64 running sum inside that
    block finds the entry. Both levels add the same float32 values in float64, so the draw is the one-level
    draw up to float64 rounding at the boundaries (a test compares them on many rows); it reads the
    probabilities once instead of writing and searching a float64 copy of them (16 x 151,936: 19 -> 2.6 ms)."""
    rows, vocab = probs.shape
    if vocab <= ONE_LEVEL_MAX:
        cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
        target = u.to(cdf.dtype)[:, None] * cdf[:, -1:]
        return _first_above(cdf, target, probs)
    full = vocab // CDF_BLOCK * CDF_BLOCK
    sums = probs[:, :full].reshape(rows, -1, CDF_BLOCK).sum(-1, dtype=torch.float64)
    if full < vocab:
        sums = torch.cat([sums, probs[:, full:].sum(-1, keepdim=True, dtype=torch.float64)], dim=-1)
    cum = sums.cumsum(-1)
    target = u.to(cum.dtype)[:, None] * cum[:, -1:]
    block = _first_above(cum, target, sums)  # [B], a block of nonzero mass
    before = torch.where(block > 0, cum.gather(-1, (block - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    index = block[:, None] * CDF_BLOCK + torch.arange(CDF_BLOCK, device=probs.device)  # [B, CDF_BLOCK]
    inside = probs.gather(-1, index.clamp(max=vocab - 1)).double().masked_fill_(index >= vocab, 0.0)
    at = _first_above(before[:, None] + inside.cumsum(-1), target, inside)
    return block * CDF_BLOCK + at


def _first_above(cdf: Tensor, target: Tensor, mass: Tensor) -> Tensor:
    """[B] the first index where ``cdf`` [B, N] exceeds ``target`` [B, 1]; where float rounding leaves none
    (``target`` at the very top), the last index of nonzero ``mass``."""
    found = torch.searchsorted(cdf, target, right=True)[:, 0]
    last = torch.where(mass > 0, torch.arange(mass.shape[-1], device=mass.device), -1).amax(-1).clamp_(min=0)
    return torch.minimum(found, last)


def left_padded(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[Tensor, Tensor]:
    """Token ids and attention mask [B, W] (host tensors) of ``prompts`` padded on the left to the longest."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        attn[r, width - len(p):] = 1
    return ids, attn


def batch_sampling(params: Sequence, seeds: Sequence[int], eos_token_ids: Sequence[int], device) -> dict:
    """The per-row sampling tensors of one decoding batch on ``device``: ``temperature``, ``top_p``, ``top_k``,
    ``keys`` (:func:`seed_keys`), ``max_new`` [B] and ``stops`` [B, S] (each row's stop ids and the eos ids,
    -1 padded); and ``all_greedy`` / ``any_greedy`` / ``any_filter``, decided once per batch (a subset of the
    rows still samples and filters correctly either way)."""
    stop_sets = [sorted(set(sp.stop_token_ids) | set(eos_token_ids)) for sp in params]
    stops = torch.full((len(params), max(len(s) for s in stop_sets)), -1, dtype=torch.long)
    for r, st in enumerate(stop_sets):
        stops[r, : len(st)] = torch.tensor(st, dtype=torch.long)
    return {"temperature": torch.tensor([float(sp.temperature) for sp in params], device=device),
            "top_p": torch.tensor([float(sp.top_p) for sp in params], device=device),
            "top_k": torch.tensor([int(sp.top_k or 0) for sp in params], device=device),
            "keys": seed_keys(seeds).to(device),
            "max_new": torch.tensor([sp.max_new_tokens for sp in params], device=device),
            "stops": stops.to(device),
            "all_greedy": all(sp.temperature <= 0 for sp in params),
            "any_greedy": any(sp.temperature <= 0 for sp in params),
            "any_filter": any(sp.top_p < 1.0 or (sp.top_k or 0) > 0 for sp in params)}


def shared_prompts(prompts: Sequence[Sequence[int]], device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the first row of each distinct prompt, the distinct prompt of every row), or (None, None) if all differ."""
    first: dict[tuple[int, ...], int] = {}
    of_row = [first.setdefault(tuple(p), len(first)) for p in prompts]
    if len(first) == len(prompts):
        return None, None
    firsts = [0] * len(first)
    for r in range(len(prompts) - 1, -1, -1):
        firsts[of_row[r]] = r
    return (torch.tensor(firsts, dtype=torch.long, device=device),
            torch.tensor(of_row, dtype=torch.long, device=device))


@torch.no_grad()
def generate_ids(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    eos_token_id: int | list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    batch_size: int = 32,
) -> list[list[int]]:
    """Completion ids per prompt (eos kept when generated, padding removed). ``temperature=0`` is greedy."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: list[list[int]] = []
    eos = set(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id])
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        ids, attn = left_padded(chunk, pad_token_id)
        width = ids.shape[1]
        sampling = dict(do_sample=temperature > 0)
        if temperature > 0:
            sampling.update(temperature=temperature, top_p=top_p, top_k=top_k or None)
        gen = model.generate(
            input_ids=ids.to(device), attention_mask=attn.to(device), max_new_tokens=max_new_tokens,
            pad_token_id=pad_token_id, eos_token_id=list(eos), **sampling,
        )
        for row in gen[:, width:].tolist():
            tokens = []
            for t in row:
                tokens.append(t)
                if t in eos:
                    break
            out.append(tokens)
    model.train(was_training)
    return out
