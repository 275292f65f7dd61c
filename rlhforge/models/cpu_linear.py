"""fp32 linear layers on CPU through oneDNN where that is measurably faster than the BLAS PyTorch calls.

PyTorch's CPU build multiplies fp32 matrices with MKL's ``sgemm``. On AMD processors MKL takes its AVX2 code
path; oneDNN (also inside PyTorch, and what it already uses for bf16) takes AVX-512 where the CPU has it. On
this project's CI machine (AMD EPYC, AVX-512, one thread) oneDNN ran the forward products of a 1,024-row
micro-batch at 2.2-2.4x MKL's rate (``[1024, 768] x [768, 256]``: 225 against 94 GFLOP/s), the backward's two
products at 1.4-2.3x, and a 16-row decoding step's forward products at 1.3-1.9x
(``benchmarks/results/cpu_linear.json``; docs/performance.md, "oneDNN for fp32 linear layers on CPU").

:class:`CpuLinear` is ``nn.Linear`` with that kernel: its forward and both products of its backward run
oneDNN's matmul (``torch.ops.mkldnn._linear_pointwise``, the op inductor lowers CPU linear layers to), with
fp32 accumulation: the results differ from MKL's by the order of the sums (about 3e-6 relative), as two BLAS
libraries do. Anything else (another dtype or device, autocast, a tensor subclass, a sharded placeholder)
goes to ``F.linear`` unchanged. :func:`use_cpu_linear` turns a model's plain ``nn.Linear`` layers into
:class:`CpuLinear` in place (their class only: parameters, state dict and ``isinstance`` stay the same).

Whether to use it is decided once per run (:func:`onednn_chosen`): ``RLHFORGE_CPU_LINEAR=onednn`` or ``blas``,
or ``auto`` (the default): a ~0.1 s measurement of both kernels on one training-sized product, oneDNN kept
only if it is at least :data:`MIN_GAIN` times faster. The decision is written back to
``RLHFORGE_CPU_LINEAR`` so that every process a run starts (ranks, Ray workers, engines) uses the same
kernel.

**oneDNN's caches** (:func:`bound_onednn_caches`). oneDNN keeps every primitive it made (its primitive cache)
and PyTorch's ideep layer every computation it set up (its LRU cache), up to 1,024 shapes each, and a training
micro-batch's token count is a new shape for every product of the step. Their memory grew with each distinct
token count: after 30 counts a two-layer model of hidden size 256 held 267 MB more (after ``malloc_trim``); a
GRPO run at 16 x 8 x 64 went from 2.07 to 2.69 GB of peak RSS between its 3rd and 16th step, and an SFT run
(b8 len128) reached 1.07 GB in 40 steps. Before the first oneDNN product, the choice sets both capacities to
:data:`CACHE_CAPACITY` where the user has not set them: the 30 counts then hold 12 MB, the SFT run peaks at
0.73 GB, and the decoding step's few shapes stay cached (no slower step measured at 64; at 32 the GRPO
step was 1-2% slower, its training products made anew each step).
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CpuLinear", "use_cpu_linear", "onednn_chosen", "bound_onednn_caches", "CACHE_CAPACITY", "linear",
           "weight_grad", "is_plain_linear", "onednn_linear", "decode_linear", "decode_linears", "PackedLinear",
           "best_seconds", "ENV", "MIN_GAIN"]

ENV = "RLHFORGE_CPU_LINEAR"
MIN_GAIN = 1.25
"""``auto`` keeps oneDNN only when it runs the probe product at least this many times faster than BLAS."""

_CHOICE: bool | None = None
#: the capacity of oneDNN's primitive cache and ideep's LRU cache (see the module's docstring)
CACHE_CAPACITY = 64
CACHE_ENVS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def _op():
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` by oneDNN, ``x`` 2-D (any strides)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _probe_gain(rows: int = 512, cols: int = 512, repeats: int = 6) -> float:
    """How many times faster oneDNN runs a ``[rows, cols] x [cols, cols]`` fp32 product than ``F.linear``."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, cols, generator=g), torch.randn(cols, cols, generator=g)
    return best_seconds(lambda: F.linear(x, w), repeats) / best_seconds(lambda: onednn_linear(x, w, None), repeats)


def best_seconds(fn, repeats: int) -> float:
    """The shortest of ``repeats`` timed calls of ``fn`` after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bound_onednn_caches(environ=os.environ) -> dict[str, str]:
    """Set oneDNN's primitive cache and ideep's LRU cache to :data:`CACHE_CAPACITY` entries where ``environ``
    does not set them; returns what it set. Both are read when the process makes its first oneDNN product, so
    this runs before it (and the processes a run starts inherit it)."""
    added = {k: str(CACHE_CAPACITY) for k in CACHE_ENVS if not environ.get(k)}
    environ.update(added)
    return added


def onednn_chosen() -> bool:
    """Whether fp32 CPU linear layers run on oneDNN in this process (decided once; see the module's docstring).
    An unknown ``RLHFORGE_CPU_LINEAR`` value is an error naming the variable."""
    global _CHOICE
    if _CHOICE is not None:
        return _CHOICE
    want = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if want not in ("auto", "onednn", "blas"):
        raise ValueError(f"{ENV}={want!r}: expected auto, onednn or blas")
    available = _op() is not None and torch.backends.mkldnn.is_available()
    if available and want != "blas":
        bound_onednn_caches()  # before the probe's first oneDNN product
    if want == "onednn" and not available:
        raise ValueError(f"{ENV}=onednn: this PyTorch has no oneDNN linear op (torch.ops.mkldnn._linear_pointwise)")
    if want == "auto":
        try:
            want = "onednn" if available and _probe_gain() >= MIN_GAIN else "blas"
        except RuntimeError:  # the op exists but refuses: keep BLAS
            want = "blas"
        os.environ[ENV] = want  # the processes this one starts use the same kernel
    _CHOICE = want == "onednn"
    return _CHOICE


def _eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and type(weight) in (nn.Parameter, torch.Tensor) and type(x) in (nn.Parameter, torch.Tensor)
            and weight.dim() == 2 and weight.numel() > 0 and x.dim() >= 1 and x.numel() > 0
            and (bias is None or bias.dtype == torch.float32)
            and not torch.is_autocast_enabled("cpu"))


class _Linear(torch.autograd.Function):
    """``F.linear`` with oneDNN's matmul in the forward and in both products of the backward."""

    @staticmethod
    def forward(ctx, x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return onednn_linear(x2, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x2, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = onednn_linear(grad, weight.t(), None)  # grad @ weight
        if ctx.needs_input_grad[1]:
            grad_w = weight_grad(grad, x2)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum(0)
        return grad_x, grad_w, grad_b


def weight_grad(grad: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """``grad.T @ x2`` (``[out, in]``) by oneDNN, which reads its first operand contiguous: of ``grad.T`` (``out x
    T`` values copied) and ``x2.T`` (``in x T``, then the ``in x out`` result transposed back), the smaller copy is
    made. A layer that widens its input (an MLP's gate/up, the head) copies a third as much or less: at 10,240
    tokens a ``768 x 10240`` transposition took 9.9 ms, ``256 x 10240`` 1.7 ms."""
    tokens, out, inp = grad.shape[0], grad.shape[1], x2.shape[1]
    if out * tokens > inp * (tokens + out):
        return onednn_linear(x2.t(), grad.t(), None).t().contiguous()
    return onednn_linear(grad.t(), x2.t(), None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, on oneDNN where :func:`onednn_chosen` and the tensors allow it."""
    if not (_eligible(x, weight, bias) and onednn_chosen()):
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        out = _Linear.apply(x2, weight, bias)
    else:
        out = onednn_linear(x2, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


PACK_BYTES = 32 << 20
"""A decoding step's layer of at most this many weight bytes runs on a oneDNN-packed copy of its weight
(:class:`PackedLinear`); larger ones (a 151,936-token head) on the weight itself, without a second copy."""


class PackedLinear:
    """The fp32 inference of one or more linear layers that read the same input, on oneDNN, their weights
    concatenated (one product, the outputs side by side: a layer's q/k/v or gate/up projections) and reordered
    once into oneDNN's blocked layout. The copy is made again whenever one of the weights changes in place
    (``_version``: a weight sync's ``load_state_dict``, an optimizer step). For the many small products of
    decoding: 16 rows x 256 -> 768 ran at 157 GFLOP/s packed, 120 from the plain weight and 83 on MKL (one
    core), and q/k/v as one product took 40 us against 70 for three. Values as :func:`onednn_linear` gives them
    from the concatenated weight (oneDNN picks its kernel by shape: for a single row the last bits may differ).
    Another input dtype goes to ``F.linear`` of the concatenated weight."""

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None], rows: int = 16):
        self.weights, self.biases, self.rows = weights, biases, rows
        self.sizes = [w.shape[0] for w in weights]
        self._packed = self._bias = self._plain = None
        self._versions: list[int] | None = None

    def _refresh(self) -> None:
        versions = [w._version for w in self.weights] + [b._version for b in self.biases if b is not None]
        if self._packed is not None and versions == self._versions:
            return
        with torch.no_grad():
            weights = [w.detach() for w in self.weights]
            plain = weights[0] if len(weights) == 1 else torch.cat(weights)
            if all(b is None for b in self.biases):
                self._bias = None
            else:
                self._bias = torch.cat([b.detach() if b is not None else plain.new_zeros(n)
                                        for b, n in zip(self.biases, self.sizes)])
            self._packed = torch.ops.mkldnn._reorder_linear_weight(plain, self.rows)
        self._plain, self._versions = plain, versions

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self._refresh()
        if x.dtype != torch.float32:
            return F.linear(x, self._plain, self._bias)
        out = onednn_linear(x.reshape(-1, x.shape[-1]), self._packed, self._bias)
        return out.view(*x.shape[:-1], out.shape[-1])


def _packable(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (type(module) is CpuLinear and w.device.type == "cpu" and w.dtype == torch.float32 and w.numel() > 0
            and type(w) in (nn.Parameter, torch.Tensor))


def decode_linears(modules: list[nn.Module], rows: int = 16) -> PackedLinear | None:
    """One :class:`PackedLinear` for ``modules`` (linear layers of one input, outputs side by side), when all are
    :class:`CpuLinear` with fp32 CPU weights of at most :data:`PACK_BYTES` together; else None."""
    if not modules or not all(_packable(m) for m in modules):
        return None
    if sum(m.weight.numel() for m in modules) * 4 > PACK_BYTES:
        return None
    return PackedLinear([m.weight for m in modules], [m.bias for m in modules], rows)


def decode_linear(module: nn.Module, rows: int = 16):
    """The call a decoding step makes for ``module``: a :class:`PackedLinear` for a :class:`CpuLinear` with an
    fp32 CPU weight of at most :data:`PACK_BYTES`, oneDNN on the plain weight above that, ``F.linear``'s kernel for
    a plain ``nn.Linear``, and anything else (LoRA, quantised) as the module itself."""
    packed = decode_linears([module], rows)
    if packed is not None:
        return packed
    w, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if _packable(module):
        return lambda x: linear(x, w, bias)
    if type(module) in (nn.Linear, CpuLinear):
        return lambda x: torch._C._nn.linear(x, w, bias)
    return module


class CpuLinear(nn.Linear):
    """``nn.Linear`` whose fp32 CPU forward (and backward) runs on oneDNN (:func:`linear`)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's name
        return linear(input, self.weight, self.bias)


def is_plain_linear(module: nn.Module) -> bool:
    """A plain linear layer: ``nn.Linear`` itself or :class:`CpuLinear` (not LoRA, quantised or other kinds)."""
    return type(module) in (nn.Linear, CpuLinear)


def use_cpu_linear(model: nn.Module) -> int:
    """Turn ``model``'s plain ``nn.Linear`` layers into :class:`CpuLinear` in place when oneDNN is chosen
    (:func:`onednn_chosen`); returns how many were turned (0 when BLAS is kept)."""
    if not onednn_chosen():
        return 0
    turned = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = CpuLinear
            turned += 1
    return turned
