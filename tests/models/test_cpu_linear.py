"""fp32 linear layers on oneDNN (rlhforge/models/cpu_linear.py): the same values and gradients as ``F.linear`` to
fp32 rounding, ``F.linear`` itself wherever the kernel does not apply, and one decision per run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rlhforge.models import cpu_linear
from rlhforge.models.cpu_linear import CpuLinear, is_plain_linear, linear, use_cpu_linear


@pytest.fixture
def onednn(monkeypatch):
    monkeypatch.setattr(cpu_linear, "_CHOICE", True)


def _close(a, b, rel=1e-5):
    scale = b.abs().max().clamp(min=1.0)
    assert (a - b).abs().max() <= rel * scale, float((a - b).abs().max() / scale)


@pytest.mark.parametrize("shape", [(7, 48), (3, 5, 48), (2, 1, 4, 48)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_values_and_gradients_match_f_linear(onednn, shape, with_bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = torch.randn(24, 48, generator=g, requires_grad=True)
    b = torch.randn(24, generator=g, requires_grad=True) if with_bias else None
    up = torch.randn(*shape[:-1], 24, generator=g)
    ours = linear(x, w, b)
    ref = F.linear(x, w, b)
    assert ours.shape == ref.shape
    _close(ours, ref)
    got = torch.autograd.grad((ours * up).sum(), [x, w] + ([b] if with_bias else []))
    want = torch.autograd.grad((ref * up).sum(), [x, w] + ([b] if with_bias else []))
    for a, e in zip(got, want):
        assert a.shape == e.shape
        _close(a, e)


@pytest.mark.parametrize("out, inp, copied", [(96, 16, (16, 64)), (16, 96, (16, 64)), (40, 40, (40, 64))])
def test_the_weight_gradient_copies_the_smaller_transposition(onednn, monkeypatch, out, inp, copied):
    """``grad.T @ x`` with oneDNN's first operand the smaller of ``grad.T`` and ``x.T`` (plus the transposed
    result): a widening layer (96 out of 16) reads ``x.T``, a narrowing one and a square one ``grad.T``; the
    gradient is ``[out, in]``, contiguous, equal to BLAS's and to the layer's own backward through ``linear``."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, inp, generator=g, requires_grad=True)
    w = torch.randn(out, inp, generator=g, requires_grad=True)
    up = torch.randn(64, out, generator=g)
    firsts = []
    real = cpu_linear.onednn_linear
    monkeypatch.setattr(cpu_linear, "onednn_linear", lambda a, *rest: firsts.append(tuple(a.shape)) or real(a, *rest))
    grad_w = cpu_linear.weight_grad(up, x.detach())
    assert firsts == [copied]
    assert grad_w.shape == (out, inp) and grad_w.is_contiguous()
    _close(grad_w, up.t().mm(x.detach()))
    (got,) = torch.autograd.grad((linear(x, w, None) * up).sum(), [w])
    assert torch.equal(got, grad_w)


def test_non_contiguous_input_and_frozen_weight(onednn):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(48, 10, generator=g).t().requires_grad_()  # [10, 48], transposed strides
    w = torch.randn(16, 48, generator=g)  # frozen: only the input's gradient
    out = linear(x, w)
    _close(out, F.linear(x, w))
    (gx,) = torch.autograd.grad(out.sum(), [x])
    _close(gx, torch.ones(10, 16) @ w)


def test_the_kernel_is_really_another_one(onednn):
    """Not F.linear in disguise: a product of many terms differs from MKL's in its last bits somewhere (the
    sums run in another order), while staying within fp32 rounding."""
    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(256, 512, generator=g), torch.randn(512, 512, generator=g)
    ours, ref = linear(x, w), F.linear(x, w)
    _close(ours, ref)
    assert torch.equal(ours, cpu_linear.onednn_linear(x, w, None))
    assert not torch.equal(ours, ref)


def test_falls_back_to_f_linear_bit_for_bit(onednn):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(6, 32, generator=g), torch.randn(8, 32, generator=g)
    assert torch.equal(linear(x.bfloat16(), w.bfloat16()), F.linear(x.bfloat16(), w.bfloat16()))
    assert torch.equal(linear(x.double(), w.double()), F.linear(x.double(), w.double()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(linear(x, w), F.linear(x, w))
    assert linear(x[:0], w).shape == (0, 8)


def test_blas_chosen_is_f_linear(monkeypatch):
    monkeypatch.setattr(cpu_linear, "_CHOICE", False)
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(256, 512, generator=g), torch.randn(512, 512, generator=g)
    assert torch.equal(linear(x, w), F.linear(x, w))
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert use_cpu_linear(model) == 0 and type(model[0]) is nn.Linear


def test_use_cpu_linear_turns_only_plain_linears(onednn):
    torch.manual_seed(5)

    class Custom(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), Custom(16, 16), nn.Linear(16, 4, bias=False))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(5, 8)
    ref = model(x)
    assert use_cpu_linear(model) == 2
    assert type(model[0]) is CpuLinear and type(model[2]) is Custom and type(model[3]) is CpuLinear
    assert all(isinstance(m, nn.Linear) for m in (model[0], model[3])) and is_plain_linear(model[3])
    assert not is_plain_linear(model[2])
    assert {k: v for k, v in model.state_dict().items()}.keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    _close(model(x), ref)


def _choice_in_child(value: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != cpu_linear.ENV}
    if value is not None:
        env[cpu_linear.ENV] = value
    code = ("import os; from rlhforge.models.cpu_linear import onednn_chosen, ENV; "
            "print(onednn_chosen(), os.environ.get(ENV))")
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_the_choice_is_made_once_and_exported():
    forced = _choice_in_child("blas")
    assert forced.returncode == 0 and forced.stdout.split() == ["False", "blas"]
    auto = _choice_in_child(None)
    assert auto.returncode == 0, auto.stderr[-800:]
    chosen, exported = auto.stdout.split()
    assert exported == ("onednn" if chosen == "True" else "blas")  # children inherit the same decision
    bad = _choice_in_child("fastest")
    assert bad.returncode != 0 and "RLHFORGE_CPU_LINEAR='fastest'" in bad.stderr


def test_the_cache_bounds_are_set_where_the_user_set_none():
    env = {"LRU_CACHE_CAPACITY": "8"}
    added = cpu_linear.bound_onednn_caches(env)
    assert added == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(cpu_linear.CACHE_CAPACITY)}
    assert env == {"LRU_CACHE_CAPACITY": "8", **added}  # the user's own value stays
    assert cpu_linear.bound_onednn_caches(env) == {}
    code = ("import os; from rlhforge.models.cpu_linear import onednn_chosen, CACHE_ENVS; onednn_chosen(); "
            "print(*(os.environ.get(k, '-') for k in CACHE_ENVS))")
    base = {k: v for k, v in os.environ.items() if k not in (cpu_linear.ENV, *cpu_linear.CACHE_ENVS)}
    for choice, want in (("onednn", [str(cpu_linear.CACHE_CAPACITY)] * 2), ("blas", ["-", "-"])):
        out = subprocess.run([sys.executable, "-c", code], env={**base, cpu_linear.ENV: choice}, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.split() == want, (choice, out.stdout, out.stderr[-800:])


_GROWTH = r"""
import ctypes, sys, torch
torch.set_num_threads(1)
from rlhforge.models.cpu_linear import onednn_chosen, use_cpu_linear
from rlhforge.models.tiny import TinyModelSpec, build_tiny_model
from transformers import AutoModelForCausalLM
assert onednn_chosen()  # sets the cache bounds where the environment has none
path = build_tiny_model(sys.argv[1], TinyModelSpec(vocab_size=1000, hidden_size=256, intermediate_size=768,
                                                   num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4))
model = AutoModelForCausalLM.from_pretrained(path)
use_cpu_linear(model)
def step(tokens):
    model(input_ids=torch.randint(5, 900, (4, tokens))).logits.sum().backward()
    model.zero_grad(set_to_none=True)
def rss_mb():
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the heap holds free goes back: what is left is in use
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
step(150); step(151)
start = rss_mb()
for tokens in range(152, 212, 2):  # 30 token counts, as 30 micro-batches of a packed run would bring
    step(tokens)
print(rss_mb() - start)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_distinct_token_counts_do_not_grow_memory(tmp_path):
    """Every distinct token count is a new shape for every product of a training step. With oneDNN's and
    ideep's caches at their default 1,024 entries (the premise, set by hand here) the memory held after 30
    counts grew by 267 MB on a two-layer model of hidden size 256; with the bounds the choice sets, by 12 MB
    (the 64 entries' worth: it stays there)."""
    base = {k: v for k, v in os.environ.items() if k not in cpu_linear.CACHE_ENVS}
    base[cpu_linear.ENV] = "onednn"

    def growth(**env):
        out = subprocess.run([sys.executable, "-c", _GROWTH, str(tmp_path / str(len(env)))], env={**base, **env},
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return float(out.stdout.split()[-1])

    unbounded = growth(ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024", LRU_CACHE_CAPACITY="1024")
    bounded = growth()
    assert unbounded > 100, unbounded
    assert bounded < 40 and bounded < unbounded / 4, (bounded, unbounded)


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("blocked", [False, True])
def test_fused_head_on_onednn_equals_its_checkpointed_chunks_and_blas(onednn, keep, blocked, monkeypatch):
    """A CpuLinear head: the fused head (oneDNN products by hand) against the checkpointed chunks (the layer's
    own forward under autograd) and against the same head on BLAS, values and every gradient, three chunks;
    ``blocked``: the products made a few vocabulary rows at a time into the shared buffers and the weight's
    gradient (as a 151,936-token head is), 997 not a multiple of the block."""
    from rlhforge.models import chunked_head

    monkeypatch.setattr(chunked_head, "SAVED_PROBS_BYTES", 1 << 30 if keep else 0)
    if blocked:
        monkeypatch.setattr(chunked_head, "ONEDNN_BLOCK_BYTES", 4 * 32 * 100)  # 100 weight rows, ~12 logit columns
    torch.manual_seed(0)
    head = nn.Linear(32, 997)
    hidden, labels, upstream = torch.randn(45, 32), torch.randint(0, 997, (45,)), torch.randn(45)

    def run(layer, fused=True):
        layer.zero_grad(set_to_none=True)
        h = hidden.clone().requires_grad_(True)
        with monkeypatch.context() as m:
            if not fused:
                m.setattr(chunked_head, "_plain_head", lambda *a: False)
            lp, _ = chunked_head.head_logprobs(layer, h, labels, 0.7, chunk=16)
        (lp * upstream).sum().backward()
        return lp.detach(), h.grad, layer.weight.grad, layer.bias.grad

    blas = run(head)
    use_cpu_linear(head)
    assert type(head) is CpuLinear and chunked_head._plain_head(head, hidden)
    calls = []
    real = chunked_head.onednn_linear
    monkeypatch.setattr(chunked_head, "onednn_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    real_grad = chunked_head.weight_grad  # the weight's gradient of an unblocked chunk
    monkeypatch.setattr(chunked_head, "weight_grad", lambda *a: calls.append(a[0].shape) or real_grad(*a))
    fused = run(head)
    # the products by oneDNN: three chunks' logits, then per chunk the hidden states' and the weight's gradients
    # (with keep=False the logits again). Blocked: the weight's gradient in 10 blocks of 100 rows per chunk; with
    # keep=False the logits go into the shared buffer in 5 blocks of columns per chunk (200 columns of 16 rows,
    # 246 of the last 13 fit 12,800 bytes), in the forward and in the backward's recompute
    if not blocked:
        assert len(calls) == (9 if keep else 12)
    else:
        assert len(calls) == (3 + 3 + 3 * 10 if keep else 3 * 5 + 3 * 5 + 3 + 3 * 10)
    checkpointed = run(head, fused=False)
    for a, b, c in zip(fused, checkpointed, blas):
        _close(a, b)
        _close(a, c)


def test_fast_decoder_runs_a_converted_model_as_its_forward(onednn, tmp_path):
    """The HF engine's decoding step on a CpuLinear model: the same logits as that model's own forward (the
    same kernel, call for call), and greedy generation gives the tokens the forward picks."""
    from rlhforge.models.tiny import TinyModelSpec, build_tiny_model
    from rlhforge.rollout.fast_decode import FastDecoder
    from rlhforge.rollout.kv_cache import PreallocatedCache
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path / "llama", TinyModelSpec(num_key_value_heads=2), seed=0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    assert use_cpu_linear(model) > 0
    fast = FastDecoder.build(model, "sdpa")
    assert fast is not None
    torch.manual_seed(0)
    ids = torch.randint(5, 200, (3, 9))
    cache = PreallocatedCache(16)
    with torch.no_grad():
        model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
        mask = torch.ones(3, 1, 1, 9, dtype=torch.bool)
        got = fast.step(ids[:, -1:], torch.full((3, 1), 8), mask, cache)
        want = model(input_ids=ids).logits[:, -1]
    _close(got, want, rel=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fast_decoder_rotates_q_and_k_as_the_family_does_bit_for_bit(onednn, tmp_path, arch):
    """The decoding step rotates q and k with ``rotate_pairs`` (Llama, Qwen2: in one pass over the fused product's
    q and k columns; Qwen3, whose q/k norms come first: one call each): the logits are bit for bit those of the
    same step with the family's own ``apply_rotary_pos_emb``, the packed products being the same calls."""
    from rlhforge.models.tiny import TinyModelSpec, build_tiny_model
    from rlhforge.rollout.fast_decode import FastDecoder
    from rlhforge.rollout.kv_cache import PreallocatedCache
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path / arch, TinyModelSpec(num_key_value_heads=2), seed=0, arch=arch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    assert use_cpu_linear(model) > 0
    fast = FastDecoder.build(model)
    assert fast is not None and fast.joint_rope and fast.layers[0]["qkv"] is not None
    assert (fast.layers[0]["q_norm"] is None) == (arch != "qwen3")
    torch.manual_seed(0)
    ids = torch.randint(5, 200, (3, 9))
    mask = torch.ones(3, 1, 1, 9, dtype=torch.bool)
    mask[0, ..., :2] = False  # a left-padded row
    logits = []
    for joint in (True, False):
        fast.joint_rope = joint
        cache = PreallocatedCache(16)
        with torch.no_grad():
            model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
            logits.append(fast.step(ids[:, -1:], torch.full((3, 1), 8), mask, cache))
    assert torch.equal(logits[0], logits[1])


def test_rotate_pairs_is_transformers_rotation_and_others_keep_their_own():
    from rlhforge.rollout.fast_decode import _rope_matches, rope_tables, rotate_pairs
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        q, k = torch.randn(4, 8, 1, 64, generator=g).to(dtype), torch.randn(4, 2, 1, 64, generator=g).to(dtype)
        cos, sin = torch.randn(4, 1, 64, generator=g).to(dtype), torch.randn(4, 1, 64, generator=g).to(dtype)
        want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
        tables = rope_tables(cos, sin)
        assert torch.equal(rotate_pairs(q, *tables), want_q) and torch.equal(rotate_pairs(k, *tables), want_k)
        assert _rope_matches(apply_rotary_pos_emb, 64, dtype)

    def interleaved(q, k, cos, sin):  # GPT-J's pairs (0, 1), (2, 3), ...: another rotation
        def rot(x):
            return torch.stack([-x[..., 1::2], x[..., ::2]], -1).flatten(-2)
        return q * cos.unsqueeze(1) + rot(q) * sin.unsqueeze(1), k * cos.unsqueeze(1) + rot(k) * sin.unsqueeze(1)

    assert not _rope_matches(interleaved, 64, torch.float32) and not _rope_matches(apply_rotary_pos_emb, 63,
                                                                                   torch.float32)


def test_packed_decode_linear_follows_in_place_updates(onednn):
    """The packed copy a decoding step uses is made again when the weight is changed in place (a weight sync's
    ``load_state_dict``, an optimizer step), so it never decodes with stale weights."""
    from rlhforge.models.cpu_linear import PackedLinear, decode_linear

    torch.manual_seed(6)
    layer = nn.Linear(64, 96)
    use_cpu_linear(layer)
    call = decode_linear(layer)
    assert isinstance(call, PackedLinear)
    x = torch.randn(16, 1, 64)
    with torch.no_grad():
        _close(call(x), F.linear(x, layer.weight, layer.bias))
        layer.load_state_dict({"weight": torch.randn(96, 64), "bias": torch.randn(96)})
        _close(call(x), F.linear(x, layer.weight, layer.bias))
        layer.weight.mul_(-2.0)
        _close(call(x), F.linear(x, layer.weight, layer.bias))
    big = nn.Linear(8, 8)
    assert not isinstance(decode_linear(big), PackedLinear)  # a plain nn.Linear keeps F.linear's kernel


def test_fused_decode_linears_side_by_side_with_mixed_biases(onednn):
    """q/k/v (or gate/up) as one packed product: the outputs side by side equal each layer's own, a missing
    bias counts as zeros, and an in-place change of any one weight or bias is picked up."""
    from rlhforge.models.cpu_linear import decode_linears

    torch.manual_seed(7)
    layers = [nn.Linear(64, 64, bias=True), nn.Linear(64, 32, bias=False), nn.Linear(64, 32, bias=False)]
    for layer in layers:
        use_cpu_linear(layer)
    fused = decode_linears(layers)
    assert fused is not None and fused.sizes == [64, 32, 32]
    x = torch.randn(16, 1, 64)

    def check():
        parts = fused(x).split(fused.sizes, -1)
        for part, layer in zip(parts, layers):
            _close(part, F.linear(x, layer.weight, layer.bias))

    with torch.no_grad():
        check()
        layers[2].weight.add_(1.0)
        check()
        layers[0].bias.mul_(3.0)
        check()
    assert decode_linears([layers[0], nn.Linear(64, 8)]) is None  # a plain nn.Linear among them: not fused
