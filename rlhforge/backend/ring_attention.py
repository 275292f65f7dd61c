"""Ring attention (context parallelism) over a ``torch.distributed`` group.

A packed row of ``N`` tokens (several samples back to back, padded to a multiple of the ring size
``R``) is cut into ``R`` contiguous slices of ``L = N / R`` tokens; ring rank ``r`` holds the
queries, keys and values of slice ``r``. The attention of the whole row is computed in ``R`` steps:
at step ``s`` rank ``r`` holds the K/V block of slice ``(r - s) mod R`` and computes the partial
attention of its queries against it (output and log-sum-exp, LSE), while it already sends that block
to rank ``r + 1`` and receives the next one from rank ``r - 1`` (``isend``/``irecv``; gloo on CPU,
NCCL on GPU). The partials are merged with the LSE trick::

    lse = logaddexp(lse_a, lse_b);  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Which query may see which key: same sample (sequence id) and key index <= query index in the packed
row. Every ring rank knows the whole row's sequence ids (:class:`RingLayout`, built once per batch
from the packed batch every ring rank holds), so the mask of block ``(r, j)`` is known without
sending ids around. Because slices are contiguous, a block from a later slice is never seen (skipped),
the own block is causal per sample, and a block from an earlier slice is seen only by the sample that
straddles the two slices, with no causal cut (:func:`block_plan`).

Backward is an explicit second ring (:class:`_RingAttention`): the K/V blocks go round again, each
rank adds its queries' contribution to the gradient of the block it holds, and the K/V gradient
buffer travels with the block, arriving home after ``R`` hops. The per-block gradients use the
*final* output and LSE (the flash-attention backward identity ``dS = P * (dP - rowsum(dO * O))``
with ``P = exp(S - lse_final)``), so no per-block state is kept.

Block kernels: :class:`TorchBlockKernel` (any device; float32 maths with an explicit mask; what the
CPU tests run) and :class:`FlashBlockKernel` (CUDA with fp16/bf16, ``flash_attn`` >= 2.7 varlen kernels on the same
:func:`block_plan`; not run in this repository's CI: no GPU).

``head_stride`` (``--ds.ring_attn_head_stride``, as OpenRLHF): the ring runs over ``head_stride``
key/value heads at a time (with their query heads), so the blocks in flight hold ``head_stride`` of
the ``num_key_value_heads`` heads: less memory, more (smaller) messages. The result does not depend
on it.

HF models: importing this module registers :data:`RING_ATTN_IMPL` with transformers'
``AttentionInterface``; load a model with ``attn_implementation=RING_ATTN_IMPL`` (or set
``model.config._attn_implementation``) and run its forward inside :func:`ring_layout_active`.
Grouped-query attention (fewer K/V heads) is handled without repeating K/V before sending. Sliding
windows (HF ``sliding_window``) are applied by the torch kernel; logit soft-capping is refused.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "RING_ATTN_IMPL",
    "RingLayout",
    "BlockPlan",
    "block_plan",
    "TorchBlockKernel",
    "FlashBlockKernel",
    "ring_attention",
    "ring_layout_active",
    "active_ring_layout",
    "hf_ring_attention",
]

RING_ATTN_IMPL = "rlhforge_ring"
"""The ``attn_implementation`` name under which HF models use ring attention."""


@dataclass(frozen=True)
class RingLayout:
    """The packed row as the ring sees it (identical on every rank of one ring)."""

    group: object
    """The ring's process group (``None``: the default group)."""
    ring_rank: int
    ring_size: int
    seq_ids: Tensor
    """[R * L] int64: the sample of every token of the padded row (non-decreasing; pads form their own)."""
    head_stride: int = 0
    """Key/value heads per ring pass (0 or >= num_key_value_heads: all at once)."""

    @property
    def local_len(self) -> int:
        return self.seq_ids.numel() // self.ring_size

    def slice_ids(self, rank: int) -> Tensor:
        """[L] the sequence ids of slice ``rank``."""
        n = self.local_len
        return self.seq_ids[rank * n : (rank + 1) * n]


@dataclass(frozen=True)
class BlockPlan:
    """Which part of block (query slice, key slice) attends, in varlen terms.

    Queries ``q_start:q_end`` of the query slice attend keys ``k_start:k_end`` of the key slice;
    inside that window the attention is per segment (``cu_q``/``cu_k``, cumulative lengths, the
    same segments on both sides) and causal when ``causal``. Rows outside the query window get
    nothing from this block (LSE -inf).
    """

    q_start: int
    q_end: int
    k_start: int
    k_end: int
    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    causal: bool
    q_offset: int = 0
    """Index of the query slice's first token in the packed row."""
    k_offset: int = 0
    window: int | None = None
    """Sliding window (HF ``sliding_window``): a query sees keys less than ``window`` tokens back."""


def _runs(ids: Tensor) -> tuple[int, ...]:
    """Cumulative lengths of the runs of equal values in a non-decreasing id vector."""
    change = (ids[1:] != ids[:-1]).nonzero()[:, 0] + 1
    return (0, *change.tolist(), ids.numel())


def block_plan(q_ids: Tensor, k_ids: Tensor, q_slice: int, k_slice: int, window: int | None = None
               ) -> BlockPlan | None:
    """The attending window of queries of slice ``q_slice`` against keys of slice ``k_slice``.

    Contiguous slices of one row: a later key slice is all in the future (None); the own slice is
    causal per sample; an earlier key slice is seen only by the sample that starts before the query
    slice and continues into it (its queries see all of its keys there, no causal cut), else None.
    With a sliding ``window``, a key slice that ends ``window`` or more tokens before the query
    slice starts is None too (the window itself is applied by :func:`plan_mask`).
    """
    n = q_ids.numel()
    q_off, k_off = q_slice * n, k_slice * n
    if k_slice > q_slice or (window is not None and q_off - (k_off + n - 1) >= window):
        return None
    if k_slice == q_slice:
        cu = _runs(q_ids)
        return BlockPlan(0, n, 0, k_ids.numel(), cu, cu, True, q_off, k_off, window)
    straddling = int(q_ids[0])
    if int(k_ids[-1]) != straddling:
        return None
    q_end = int((q_ids == straddling).sum())
    k_start = k_ids.numel() - int((k_ids == straddling).sum())
    return BlockPlan(0, q_end, k_start, k_ids.numel(), (0, q_end), (0, k_ids.numel() - k_start), False,
                     q_off, k_off, window)


def plan_mask(plan: BlockPlan, lq: int, lk: int, device=None) -> Tensor:
    """[lq, lk] bool: the pairs ``plan`` lets attend (what both kernels compute)."""
    allowed = torch.zeros(lq, lk, dtype=torch.bool, device=device)
    for a, b, c, d in zip(plan.cu_q[:-1], plan.cu_q[1:], plan.cu_k[:-1], plan.cu_k[1:]):
        qa, qb, ka, kb = plan.q_start + a, plan.q_start + b, plan.k_start + c, plan.k_start + d
        block = torch.ones(qb - qa, kb - ka, dtype=torch.bool, device=device)
        allowed[qa:qb, ka:kb] = block.tril() if plan.causal else block
    if plan.window is not None:
        qi = plan.q_offset + torch.arange(lq, device=device)
        ki = plan.k_offset + torch.arange(lk, device=device)
        allowed &= (qi[:, None] - ki[None, :]) < plan.window
    return allowed


class TorchBlockKernel:
    """Partial attention of one block in plain torch (float32), any device. Layout ``[H, L, D]``."""

    @staticmethod
    def _expand(x: Tensor, groups: int) -> Tensor:
        return x.repeat_interleave(groups, dim=0) if groups > 1 else x  # q head h uses kv head h // groups

    def forward(self, q: Tensor, k: Tensor, v: Tensor, plan: BlockPlan, scale: float) -> tuple[Tensor, Tensor]:
        groups = q.shape[0] // k.shape[0]
        k, v = self._expand(k.float(), groups), self._expand(v.float(), groups)
        scores = torch.einsum("hqd,hkd->hqk", q.float(), k) * scale
        allowed = plan_mask(plan, q.shape[1], k.shape[1], q.device)
        scores = scores.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # -inf on rows with no key
        finite = torch.isfinite(lse)
        probs = torch.exp(scores - torch.where(finite, lse, torch.zeros_like(lse))[..., None])
        out = torch.einsum("hqk,hkd->hqd", probs, v)
        return out, lse

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, plan: BlockPlan,
                 scale: float) -> tuple[Tensor, Tensor, Tensor]:
        hq, hk = q.shape[0], k.shape[0]
        groups = hq // hk
        ke, ve = self._expand(k.float(), groups), self._expand(v.float(), groups)
        qf, dout = q.float(), dout.float()
        scores = torch.einsum("hqd,hkd->hqk", qf, ke) * scale
        allowed = plan_mask(plan, q.shape[1], k.shape[1], q.device)
        probs = torch.exp(scores - lse[..., None]).masked_fill(~allowed, 0.0)  # P under the *final* lse
        dv = torch.einsum("hqk,hqd->hkd", probs, dout)
        dp = torch.einsum("hqd,hkd->hqk", dout, ve)
        delta = (dout * out.float()).sum(-1, keepdim=True)  # rowsum(dO * O_final)
        ds = probs * (dp - delta) * scale
        dq = torch.einsum("hqk,hkd->hqd", ds, ke)
        dk = torch.einsum("hqk,hqd->hkd", ds, qf)
        if groups > 1:
            dk = dk.view(hk, groups, *dk.shape[1:]).sum(1)
            dv = dv.view(hk, groups, *dv.shape[1:]).sum(1)
        return dq, dk, dv


class FlashBlockKernel:
    """Partial attention of one block with flash-attention's varlen kernels (CUDA, ``flash_attn`` >= 2.7).

    Same interface and layout (``[H, L, D]`` in, ``out [H, L, D]``, ``lse [H, L]`` float32) as
    :class:`TorchBlockKernel`; only the window of :func:`block_plan` is passed to the kernel (segments
    as ``cu_seqlens``), GQA natively. Not exercised by this repository's tests (no GPU, no flash_attn).
    """

    def __init__(self):
        import flash_attn  # noqa: PLC0415 - optional GPU dependency
        from flash_attn import flash_attn_interface as fa
        from packaging.version import Version

        if Version(flash_attn.__version__) < Version("2.7"):
            raise ImportError(f"flash_attn {flash_attn.__version__}: ring attention's kernel calls need >= 2.7")
        self.fa = fa

    @staticmethod
    def _cu(cu: tuple[int, ...], device) -> tuple[Tensor, int]:
        t = torch.tensor(cu, dtype=torch.int32, device=device)
        return t, int((t[1:] - t[:-1]).max())

    def forward(self, q: Tensor, k: Tensor, v: Tensor, plan: BlockPlan, scale: float) -> tuple[Tensor, Tensor]:
        if plan.window is not None:
            raise NotImplementedError("FlashBlockKernel has no sliding window (ring_attention uses the torch kernel)")
        hq, lq, d = q.shape
        qw = q[:, plan.q_start : plan.q_end].transpose(0, 1).contiguous()  # [Lq', H, D]
        kw = k[:, plan.k_start : plan.k_end].transpose(0, 1).contiguous()
        vw = v[:, plan.k_start : plan.k_end].transpose(0, 1).contiguous()
        cu_q, max_q = self._cu(plan.cu_q, q.device)
        cu_k, max_k = self._cu(plan.cu_k, q.device)
        res = self.fa._flash_attn_varlen_forward(
            qw, kw, vw, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale, causal=plan.causal,
            window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False)
        out_w, lse_w = res[0], res[1]  # [Lq', H, D], [H, Lq'] (flash_attn >= 2.7 varlen layout)
        out = q.new_zeros(hq, lq, d, dtype=torch.float32)
        lse = torch.full((hq, lq), float("-inf"), dtype=torch.float32, device=q.device)
        out[:, plan.q_start : plan.q_end] = out_w.transpose(0, 1).float()
        lse[:, plan.q_start : plan.q_end] = lse_w.float()
        return out, lse

    def backward(self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, plan: BlockPlan,
                 scale: float) -> tuple[Tensor, Tensor, Tensor]:
        qs, ks = slice(plan.q_start, plan.q_end), slice(plan.k_start, plan.k_end)
        t = lambda x, s: x[:, s].transpose(0, 1).contiguous()  # noqa: E731 - [H, L, D] window -> [L, H, D]
        qw, kw, vw = t(q, qs), t(k, ks), t(v, ks)
        dow, ow = t(dout.to(q.dtype), qs), t(out.to(q.dtype), qs)
        lse_w = lse[:, qs].contiguous()
        dq_w, dk_w, dv_w = torch.empty_like(qw), torch.empty_like(kw), torch.empty_like(vw)
        cu_q, max_q = self._cu(plan.cu_q, q.device)
        cu_k, max_k = self._cu(plan.cu_k, q.device)
        self.fa._flash_attn_varlen_backward(
            dow, qw, kw, vw, ow, lse_w, dq_w, dk_w, dv_w, cu_q, cu_k, max_q, max_k, dropout_p=0.0,
            softmax_scale=scale, causal=plan.causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
            alibi_slopes=None, deterministic=False)
        dq, dk, dv = (torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (q, k, v))
        dq[:, qs], dk[:, ks], dv[:, ks] = dq_w.transpose(0, 1).float(), dk_w.transpose(0, 1).float(), dv_w.transpose(0, 1).float()
        return dq, dk, dv


def _default_kernel(x: Tensor):
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16):  # flash kernels take half precision only
        try:
            return FlashBlockKernel()
        except ImportError:  # not installed, or older than 2.7: the torch kernel (same results, more memory)
            pass
    return TorchBlockKernel()


def _exchange(x: Tensor, layout: RingLayout) -> tuple[list, Tensor]:
    """Start sending ``x`` to the next ring rank and receiving the previous rank's into a new buffer."""
    n, r = layout.ring_size, layout.ring_rank
    group = layout.group
    nxt = dist.get_global_rank(group, (r + 1) % n) if group is not None else (r + 1) % n
    prv = dist.get_global_rank(group, (r - 1) % n) if group is not None else (r - 1) % n
    recv = torch.empty_like(x)
    # the even ranks send first and the odd ones receive first, so paired blocking transports cannot wait on each other
    ops = [dist.P2POp(dist.isend, x, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
    if r % 2:
        ops.reverse()
    return dist.batch_isend_irecv(ops), recv


def _wait(reqs) -> None:
    for req in reqs:
        req.wait()


def _merge(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    new = torch.logaddexp(lse, lse_b)
    return out * torch.exp(lse - new)[..., None] + out_b * torch.exp(lse_b - new)[..., None], new


def _ring_forward(q, k, v, layout: RingLayout, scale: float, kernel, window=None) -> tuple[Tensor, Tensor]:
    n, r = layout.ring_size, layout.ring_rank
    q_ids = layout.slice_ids(r)
    kv = torch.stack([k, v])
    out = lse = None
    for step in range(n):
        reqs, nxt = _exchange(kv, layout) if step < n - 1 else ([], None)
        src = (r - step) % n
        plan = block_plan(q_ids, layout.slice_ids(src), r, src, window)
        if plan is not None:
            out_b, lse_b = kernel.forward(q, kv[0], kv[1], plan, scale)
            out, lse = (out_b, lse_b) if out is None else _merge(out, lse, out_b, lse_b)  # step 0: the own block
        if nxt is not None:
            _wait(reqs)
            kv = nxt
    return out, lse


def _ring_backward(dout, q, k, v, out, lse, layout: RingLayout, scale: float, kernel, window=None):
    n, r = layout.ring_size, layout.ring_rank
    q_ids = layout.slice_ids(r)
    kv = torch.stack([k, v])
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # gradient of the block held now
    for step in range(n):
        reqs, nxt = _exchange(kv, layout) if step < n - 1 else ([], None)
        src = (r - step) % n
        plan = block_plan(q_ids, layout.slice_ids(src), r, src, window)
        if plan is not None:
            dq_b, dk_b, dv_b = kernel.backward(dout, q, kv[0], kv[1], out, lse, plan, scale)
            dq += dq_b
            dkv[0] += dk_b
            dkv[1] += dv_b
        if n > 1:  # the gradient travels with its block; after n hops it is home
            greqs, dkv = _exchange(dkv, layout)
            _wait(greqs)
        if nxt is not None:
            _wait(reqs)
            kv = nxt
    return dq, dkv[0], dkv[1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, scale, kernel, window):
        out, lse = _ring_forward(q, k, v, layout, scale, kernel, window)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.scale, ctx.kernel, ctx.window = layout, scale, kernel, window
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout.contiguous(), q, k, v, out, lse, ctx.layout, ctx.scale, ctx.kernel,
                                    ctx.window)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, layout: RingLayout, scale: float | None = None,
                   kernel=None, window: int | None = None) -> Tensor:
    """Causal, per-sample attention of this rank's slice against the whole packed row.

    Args:
        q: [Hq, L, D] this slice's queries; k, v: [Hkv, L, D] its keys and values (Hq % Hkv == 0).
        layout: the ring and the row's sequence ids (:class:`RingLayout`); L == layout.local_len.
        scale: softmax scale (default ``D ** -0.5``).
        kernel: block kernel (default: flash-attention on CUDA when installed, else torch; with a
            ``window``, torch).
        window: sliding window (HF ``sliding_window``): keys less than ``window`` tokens back.

    Returns:
        [Hq, L, D] in q's dtype; differentiable in q, k and v (the backward runs a second ring, so
        every rank of the ring must run the backward too).
    """
    hq, length, d = q.shape
    hk = k.shape[0]
    if hq % hk:
        raise ValueError(f"{hq} query heads are not a multiple of {hk} key/value heads")
    if length != layout.local_len:
        raise ValueError(f"the slice has {length} tokens but the layout gives {layout.local_len} per rank")
    scale = d ** -0.5 if scale is None else float(scale)
    kernel = kernel or (TorchBlockKernel() if window is not None else _default_kernel(q))
    groups = hq // hk
    stride = layout.head_stride if 0 < layout.head_stride < hk else hk
    parts = []
    for h in range(0, hk, stride):
        h_end = min(h + stride, hk)
        parts.append(_RingAttention.apply(q[h * groups : h_end * groups].contiguous(), k[h:h_end].contiguous(),
                                          v[h:h_end].contiguous(), layout, scale, kernel, window))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)


_ACTIVE: list[RingLayout] = []
_LAST: list[RingLayout] = []  # the layout of the last forward, for recomputation in its backward


@contextlib.contextmanager
def ring_layout_active(layout: RingLayout) -> Iterator[RingLayout]:
    """Model forwards inside this block use ``layout`` in their ring-attention layers.

    The layout also stays the "last" one after the block: gradient checkpointing re-runs the
    forward during the backward, outside the block, and then uses it (the backward of a micro-batch
    always follows its own forward)."""
    _ACTIVE.append(layout)
    _LAST[:] = [layout]
    try:
        yield layout
    finally:
        _ACTIVE.pop()


def active_ring_layout() -> RingLayout:
    if _ACTIVE:
        return _ACTIVE[-1]
    if _LAST and torch.is_grad_enabled():  # a checkpointed layer recomputed in the backward
        return _LAST[0]
    raise RuntimeError(f"attn_implementation={RING_ATTN_IMPL!r} needs a ring layout: run the forward inside "
                       "rlhforge.backend.ring_attention.ring_layout_active(...) (context_parallel."
                       "ring_token_logprobs does)")


def hf_ring_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None, dropout=0.0,
                      **kwargs):
    """transformers attention function: ``query [1, Hq, L, D]``, ``key/value [1, Hkv, L, D]`` -> ``[1, L, Hq, D]``."""
    layout = active_ring_layout()
    if query.shape[0] != 1:
        raise ValueError(f"ring attention takes one packed row (got a batch of {query.shape[0]})")
    if dropout and module.training:
        raise ValueError(f"ring attention has no attention dropout (got {dropout})")
    if kwargs.get("softcap") is not None:
        raise ValueError(f"ring attention does not implement softcap (got {kwargs['softcap']!r})")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = ring_attention(query[0], key[0], value[0], layout, scale, window=kwargs.get("sliding_window"))
    return out.transpose(0, 1).unsqueeze(0).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(RING_ATTN_IMPL, hf_ring_attention)


_register()
