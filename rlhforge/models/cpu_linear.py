"""fp32 linear layers on CPU through oneDNN where that is measurably faster than the BLAS PyTorch calls.

PyTorch's CPU build multiplies fp32 matrices with MKL's ``sgemm``. On AMD processors MKL takes its AVX2 code
path; oneDNN (also inside PyTorch, and what it already uses for bf16) takes AVX-512 where the CPU has it. On
this project's CI machine (AMD EPYC, AVX-512, one thread) oneDNN ran the training step's shapes at 2.0-2.4x
MKL's rate (``[1024, 768] x [768, 256]``: 244 against 104 GFLOP/s; the backward's two products 1.5-2.3x) and a
16-row decoding step's at 1.4x (docs/performance.md, "oneDNN for fp32 linear layers on CPU").

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
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CpuLinear", "use_cpu_linear", "onednn_chosen", "linear", "is_plain_linear", "onednn_linear", "decode_linear", "PackedLinear", "ENV", "MIN_GAIN"]

ENV = "RLHFORGE_CPU_LINEAR"
MIN_GAIN = 1.25
"""``auto`` keeps oneDNN only when it runs the probe product at least this many times faster than BLAS."""

_CHOICE: bool | None = None


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

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    return best(lambda: F.linear(x, w)) / best(lambda: onednn_linear(x, w, None))


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
            grad_w = onednn_linear(grad.t(), x2.t(), None)  # grad.T @ x
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.sum(0)
        return grad_x, grad_w, grad_b


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
    """A linear layer's fp32 inference on oneDNN with its weight reordered once into oneDNN's blocked layout (a
    copy, made again whenever the weight changes in place: ``_version``), for the many small products of
    decoding: 16 rows x 256 -> 768 ran at 157 GFLOP/s packed, 120 from the plain weight and 83 on MKL (one core,
    docs/performance.md). Values as :func:`onednn_linear` gives them from the plain weight (oneDNN picks its
    kernel by shape: for a single row the last bits may differ). Another dtype goes to ``F.linear``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: int = 16):
        self.weight, self.bias, self.rows = weight, bias, rows
        self._packed, self._version = None, None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.dtype != torch.float32:
            return F.linear(x, w, self.bias)
        if self._packed is None or w._version != self._version:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), self.rows)
            self._version = w._version
        out = onednn_linear(x.reshape(-1, x.shape[-1]), self._packed, self.bias)
        return out.view(*x.shape[:-1], w.shape[0])


def decode_linear(module: nn.Module, rows: int = 16):
    """The call a decoding step makes for ``module``: a :class:`PackedLinear` for a :class:`CpuLinear` with an
    fp32 CPU weight of at most :data:`PACK_BYTES`, oneDNN on the plain weight above that, ``F.linear``'s kernel for
    a plain ``nn.Linear``, and anything else (LoRA, quantised) as the module itself."""
    w, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if type(module) is CpuLinear and w.device.type == "cpu" and w.dtype == torch.float32 and w.numel():
        if w.numel() * 4 <= PACK_BYTES and type(w) in (nn.Parameter, torch.Tensor):
            return PackedLinear(w, bias, rows)
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
