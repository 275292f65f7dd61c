"""The HF engine's decoding step without transformers' per-forward machinery, for plain decoder LMs.

A decoding step of a small model on CPU spends more time in the Python around the kernels than in
them: transformers' forward builds the masks, recomputes the rotary tables, walks its output-capture
and kwargs plumbing and dispatches every module through hooks, for one token per row.
:class:`FastDecoder` runs the same step as direct calls of the model's own submodules - embedding,
each layer's norms, projections, the model family's own ``apply_rotary_pos_emb``, the cache's
``update``, SDPA with native grouped-query attention over the padding mask, the MLP, the final norm and
``lm_head`` - in transformers' order, so the logits are bit-identical to the model's forward.

It applies (:meth:`FastDecoder.build` returns None otherwise) to decoder-only causal LMs whose layers
are ``self_attn`` (``q/k/v/o_proj``, optional ``q_norm``/``k_norm``) + ``mlp`` with
``input_layernorm``/``post_attention_layernorm``, with plain causal attention
(:func:`rlhforge.models.segment_attention.plain_causal`), sdpa, no MoE routing records and no images:
Llama, Qwen2, Qwen3, Mistral without a window, Phi-3 is not (fused projections) and keeps the forward.

**Attention** (``attention``): ``"bmm"`` (the default) attends on CPU with :func:`grouped_decode_attention`,
three batched matmul-class calls over the cache's own strided views (other devices keep SDPA); ``"sdpa"`` with
``scaled_dot_product_attention(..., enable_gqa=True)``, bit-identical to transformers' forward. On CPU the
fused SDPA kernel pays a fixed cost per (row, head) for a one-token query: at 128 rows of ~100 cached
tokens (the benchmark's model, fp32 cache, 1 thread) it takes 1.0-1.7 ms a layer against 0.74-0.99 ms for
the matmuls, which read the cache about once. The two differ by float rounding only (~5e-7 in the attention
output); ``tests/rl/test_engine_cache.py`` holds the ``sdpa`` path to transformers bit for bit and the
``bmm`` path to it within 1e-5 in the log-probs, with the same tokens.
"""

from __future__ import annotations

import sys

import torch

from rlhforge.models.cpu_linear import decode_linear, decode_linears

__all__ = ["FastDecoder", "grouped_decode_attention", "padding_bias", "rope_tables", "rotate_pairs"]

_FAMILIES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
_RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")
_MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "MistralMLP")


class FastDecoder:
    def __init__(self, model, rope_fn, attention: str = "bmm"):
        if attention not in ("bmm", "sdpa"):
            raise ValueError(f"attention must be 'bmm' or 'sdpa', got {attention!r}")
        self.attention = attention
        inner = model.model
        self.embed, self.rotary = inner.embed_tokens, inner.rotary_emb
        self.norm, self.lm_head = self._rms_norm(inner.norm), self._linear(model.lm_head)
        self.rope_fn = rope_fn
        self.layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            plain_mlp = type(mlp).__name__ in _MLPS and hasattr(mlp, "act_fn")
            self.layers.append(dict(
                norm1=self._rms_norm(layer.input_layernorm), norm2=self._rms_norm(layer.post_attention_layernorm),
                q=self._linear(attn.q_proj), k=self._linear(attn.k_proj), v=self._linear(attn.v_proj),
                o=self._linear(attn.o_proj), head_dim=attn.head_dim, scaling=attn.scaling,
                q_norm=self._rms_norm(attn.q_norm) if hasattr(attn, "q_norm") else None,
                k_norm=self._rms_norm(attn.k_norm) if hasattr(attn, "k_norm") else None,
                mlp=mlp if not plain_mlp else None, act=getattr(mlp, "act_fn", None),
                gate=self._linear(mlp.gate_proj) if plain_mlp else None,
                up=self._linear(mlp.up_proj) if plain_mlp else None,
                down=self._linear(mlp.down_proj) if plain_mlp else None,
                # CpuLinear layers on oneDNN: q/k/v as one product, gate/up as one (rlhforge/models/cpu_linear.py)
                qkv=decode_linears([attn.q_proj, attn.k_proj, attn.v_proj]),
                gate_up=decode_linears([mlp.gate_proj, mlp.up_proj]) if plain_mlp else None))
        # the family's rotation is rotate_pairs' (checked once here): q and k rotated in one pass each step
        self.joint_rope = bool(self.layers) and _rope_matches(rope_fn, self.layers[0]["head_dim"], model.dtype)

    @classmethod
    def build(cls, model, attention: str = "bmm") -> "FastDecoder | None":
        from rlhforge.models.segment_attention import plain_causal

        if type(model).__name__ not in _FAMILIES or model.training:
            return None
        config = model.config
        if getattr(config, "_attn_implementation_internal", None) != "sdpa" or not plain_causal(config):
            return None
        inner = getattr(model, "model", None)
        if inner is None or not all(hasattr(inner, k) for k in ("embed_tokens", "norm", "rotary_emb", "layers")):
            return None
        for layer in inner.layers:
            attn = getattr(layer, "self_attn", None)
            if attn is None or not all(hasattr(attn, k) for k in ("q_proj", "k_proj", "v_proj", "o_proj")):
                return None
            if not all(hasattr(layer, k) for k in ("mlp", "input_layernorm", "post_attention_layernorm")):
                return None
        if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
            return None
        rope_fn = getattr(sys.modules[type(model).__module__], "apply_rotary_pos_emb", None)
        if rope_fn is None:
            return None
        return cls(model, rope_fn, attention)

    @staticmethod
    def _linear(mod):
        """A plain ``nn.Linear`` as its kernel call (no module dispatch); a
        :class:`~rlhforge.models.cpu_linear.CpuLinear` on oneDNN, its weight packed for decoding where small
        (:func:`~rlhforge.models.cpu_linear.decode_linear`); anything else (LoRA, quantised) as is."""
        return decode_linear(mod)

    @staticmethod
    def _rms_norm(mod):
        """transformers' RMSNorm (Llama's and its copies) inline, the same ops in the same order; else the module."""
        if type(mod).__name__ not in _RMS_NORMS or not hasattr(mod, "variance_epsilon"):
            return mod
        weight, eps = mod.weight, mod.variance_epsilon

        def norm(x):
            dtype = x.dtype
            x32 = x.to(torch.float32)
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
            return weight * x32.to(dtype)
        return norm

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: torch.Tensor, cache) -> torch.Tensor:
        """Logits [B, V] of one decoding step: ``input_ids`` [B, 1], ``position_ids`` [B, 1], ``mask`` the
        padding mask as SDPA's boolean [B, 1, 1, L] (L: the cache's length after this step)."""
        sdpa = torch.nn.functional.scaled_dot_product_attention
        b = input_ids.shape[0]
        bias = None  # the bmm path's additive padding mask, built once per step (every layer has the same)

        def attend(i, p, q, k, v):
            nonlocal bias
            k, v = cache.update(k, v, i)
            if self.attention == "bmm" and k.device.type == "cpu":
                if bias is None or bias.shape[0] != b * k.shape[1]:
                    bias = padding_bias(mask, k.shape[1], k.dtype)
                return grouped_decode_attention(q.to(k.dtype), k, v, bias, p["scaling"])
            out = sdpa(q.to(k.dtype), k, v, attn_mask=mask, scale=p["scaling"],
                       enable_gqa=q.shape[1] != k.shape[1])  # (a bf16 model's cache may be fp32)
            return out.transpose(1, 2).reshape(b, 1, -1).contiguous()
        return self.run(input_ids, position_ids, attend)

    def run(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attend) -> torch.Tensor:
        """Logits [B, V] of one decoding step whose attention is ``attend(layer index, layer, q [B, H, 1, D],
        k [B, KVH, 1, D], v [B, KVH, 1, D])`` -> ``[B, 1, H * D]`` (it stores the new keys/values and attends
        over the cache): :meth:`step`'s over the KV cache, :mod:`rlhforge.rollout.graph_decode`'s over a
        static buffer."""
        h = self.embed(input_ids)
        cos, sin = self.rotary(h, position_ids)
        tables = rope_tables(cos, sin) if self.joint_rope else None
        b = input_ids.shape[0]
        for i, p in enumerate(self.layers):
            q, k, v = self._attention_inputs(p, p["norm1"](h), b, cos, sin, tables)
            h = h + p["o"](attend(i, p, q, k, v).to(h.dtype))
            h = self._mlp(p, h)
        return self.lm_head(self.norm(h)[:, -1:, :])[:, -1, :]

    def _attention_inputs(self, p: dict, x: torch.Tensor, b: int, cos: torch.Tensor, sin: torch.Tensor,
                          tables: tuple | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A layer's q [B, H, 1, D] and k [B, KVH, 1, D], rotated, and v [B, KVH, 1, D] from its normed input."""
        shape = (b, 1, -1, p["head_dim"])
        if p["qkv"] is not None and tables is not None and p["q_norm"] is None:
            # q and k rotated in one pass over their side-by-side columns of the fused product
            qkv = p["qkv"](x)
            nq, nk, _ = p["qkv"].sizes
            qk = rotate_pairs(qkv[..., :nq + nk].view(shape).transpose(1, 2), *tables)
            heads = nq // p["head_dim"]
            return qk[:, :heads], qk[:, heads:], qkv[..., nq + nk:].view(shape).transpose(1, 2)
        if p["qkv"] is not None:
            q, k, v = (t.view(shape) for t in p["qkv"](x).split(p["qkv"].sizes, -1))
        else:
            q, k, v = p["q"](x).view(shape), p["k"](x).view(shape), p["v"](x).view(shape)
        if p["q_norm"] is not None:
            q, k = p["q_norm"](q), p["k_norm"](k)
        if tables is not None:
            q, k = rotate_pairs(q.transpose(1, 2), *tables), rotate_pairs(k.transpose(1, 2), *tables)
        else:
            q, k = self.rope_fn(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q, k, v.transpose(1, 2)

    @staticmethod
    def _mlp(p: dict, h: torch.Tensor) -> torch.Tensor:
        """The layer's second half: ``h + mlp(norm2(h))``."""
        x = p["norm2"](h)
        if p["gate_up"] is not None:
            gate, up = p["gate_up"](x).split(p["gate_up"].sizes, -1)
            return h + p["down"](p["act"](gate) * up)
        return h + (p["mlp"](x) if p["mlp"] is not None else p["down"](p["act"](p["gate"](x)) * p["up"](x)))


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One step's rotary tables for :func:`rotate_pairs`, made once for all layers: ``cos`` [B, 1, 1, D] and
    ``sin`` with its first half negated (from the rotary embedding's [B, 1, D])."""
    half = cos.shape[-1] // 2
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return cos, torch.cat([-sin[..., :half], sin[..., half:]], -1), half


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, half: int) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` (Llama's ``apply_rotary_pos_emb``) in four ops instead of
    seven, bit for bit: ``rotate_half(x) * sin`` is ``cat(-x2, x1) * sin``, and ``(-a) * b == a * (-b)`` exactly in
    IEEE arithmetic, so it is ``roll(x, half) * cat(-sin1, sin2)``; the products and the sum are the same ops on
    the same values."""
    return x * cos + x.roll(half, -1) * signed_sin


def _rope_matches(rope_fn, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the model family's ``apply_rotary_pos_emb`` gives :func:`rotate_pairs`' values bit for bit (checked
    on random values once per decoder; a family with another rotation keeps its own function)."""
    if head_dim % 2:
        return False
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 1, head_dim, generator=g).to(dtype) for _ in range(2))
    cos, sin = (torch.randn(2, 1, head_dim, generator=g).to(dtype) for _ in range(2))
    try:
        want = rope_fn(q, k, cos, sin)
    except Exception:  # noqa: BLE001 - another signature: keep the family's function
        return False
    tables = rope_tables(cos, sin)
    return all(torch.equal(w, rotate_pairs(x, *tables)) for w, x in zip(want, (q, k)))


def padding_bias(mask: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> torch.Tensor:
    """The boolean padding mask ``[B, 1, 1, L]`` (True: attend) as the additive bias ``[B * kv_heads, 1, L]``
    (0 or -inf) that :func:`grouped_decode_attention` takes, one row per (row, KV head)."""
    b, length = mask.shape[0], mask.shape[-1]
    bias = torch.zeros((b, 1, 1, length), dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    return bias.expand(b, kv_heads, 1, length).reshape(b * kv_heads, 1, length)


def grouped_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                             scaling: float) -> torch.Tensor:
    """One decoding step's attention with grouped KV heads, as batched matmuls.

    ``q`` [B, H, 1, D]; ``k``, ``v`` [B, KVH, L, D] (H a multiple of KVH; query head ``h`` reads KV head
    ``h // (H // KVH)``, as SDPA's ``enable_gqa``; strided views of a larger cache are read in place);
    ``bias`` [B * KVH, 1, L] from :func:`padding_bias`. Returns ``[B, 1, H * D]``, the heads concatenated as
    the output projection takes them. Every row must attend to at least one key."""
    b, heads, _, dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = heads // kv_heads
    qg = q.reshape(b * kv_heads, group, dim)  # the query heads of one KV head side by side
    scores = torch.baddbmm(bias, qg, k.reshape(b * kv_heads, length, dim).transpose(1, 2), alpha=scaling)
    out = torch.bmm(torch.softmax(scores, dim=-1), v.reshape(b * kv_heads, length, dim))
    return out.view(b, 1, heads * dim)
