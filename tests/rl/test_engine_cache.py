"""The HF engine's decode-loop speed-ups: the preallocated KV cache (rlhforge.rollout.kv_cache: the same
keys/values as transformers' DynamicCache, written in place) and SDPA's native grouped-query attention
for decoding steps on CPU (rlhforge.rollout.decode_attention). With both, the engine samples the same
tokens with the same log-probs (bit-identical) as with DynamicCache and transformers' SDPA - greedy and
seeded, top-k / top-p, mixed prompt lengths, rows finishing early (batch compaction), MHA and GQA,
sliding-window attention, MoE routing records and Qwen2-VL images."""

import asyncio
import contextlib

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

from rlhforge.models.tiny import TinyModelSpec, build_tiny_model
from rlhforge.rollout.engine import SamplingParams
from rlhforge.rollout.hf_engine import HFEngine
from rlhforge.rollout.kv_cache import PreallocatedCache, PreallocatedLayer


def _kv(step: int, b: int = 3, n: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(b, 2, n, 4, generator=g), torch.randn(b, 2, n, 4, generator=g)


def test_cache_holds_what_dynamic_cache_holds_and_writes_in_place():
    ours, ref = PreallocatedCache(capacity=9), DynamicCache()
    for cache in (ours, ref):
        for layer in range(2):
            cache.update(*_kv(layer, n=5), layer)  # prefill: 5 tokens
    buffer = ours.layers[0]._k_buf.data_ptr()
    for step in range(1, 5):
        if step == 3:  # drop row 1, as the engine does for finished rows
            keep = torch.tensor([0, 2])
            ours.batch_select_indices(keep), ref.batch_select_indices(keep)
            buffer = ours.layers[0]._k_buf.data_ptr()
        for layer in range(2):
            kv = _kv(10 * step + layer, b=2 if step >= 3 else 3)
            k, v = ours.update(*kv, layer)
            k_ref, v_ref = ref.update(*kv, layer)
            assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
        assert ours.get_seq_length() == ref.get_seq_length() == 5 + step
        assert ours.get_mask_sizes(1, 0) == ref.get_mask_sizes(1, 0)
        assert ours.layers[0]._k_buf.data_ptr() == buffer  # no reallocation: written in place
        assert ours.layers[0].keys.data_ptr() == buffer  # the attention sees a view of the buffer
    assert ours.layers[0]._k_buf.shape[-2] == 9


def test_a_layer_grows_past_its_capacity_and_follows_a_replaced_tensor():
    ours, ref = PreallocatedLayer(capacity=2), DynamicCache().layer_class_to_replicate()
    for step in range(6):  # capacity 2, 3 tokens at once, then one by one: reallocates (doubling)
        kv = _kv(step, n=3 if step == 0 else 1)
        k, v = ours.update(*kv)
        assert torch.equal(k, ref.update(*kv)[0]) and torch.equal(v, ref.values)
    assert ours._k_buf.shape[-2] >= 8
    for layer in (ours, ref):  # a base-class method replaces the tensors: the next update continues from them
        layer.batch_repeat_interleave(2)
    k, v = ours.update(*_kv(99, b=6))
    assert torch.equal(k, ref.update(*_kv(99, b=6))[0]) and torch.equal(v, ref.values)


def _same_outputs(model, prompts, params, vision=None, **engine_kw):
    """Generate with the engine's defaults, with its SDPA decoding kernel and with DynamicCache + transformers'
    SDPA over the same weights. The SDPA kernel's tokens, log-probs, finish reasons and routing records are
    bit-identical to the baseline's; the default (batched-matmul decode attention) gives the same tokens,
    finish reasons and routing records and log-probs within 1e-5 (float rounding). Returns the defaults' outputs."""
    baseline = HFEngine(model, kv_cache="dynamic", native_gqa=False, shared_prefill=False, padding_mask_4d=False,
                        fast_decode=False, **engine_kw)
    exact = HFEngine(model, decode_kernel="sdpa", **engine_kw)
    fast = HFEngine(model, **engine_kw)
    assert fast.kv_cache == "preallocated" and fast.native_gqa and fast.decode_kernel == "bmm"
    outs = {name: asyncio.run(e.generate(prompts, params, vision=vision)) for name, e in
            (("baseline", baseline), ("exact", exact), ("fast", fast))}
    assert model.config.get_text_config(decoder=True)._attn_implementation == "sdpa"  # restored after each step
    for a, b, c in zip(outs["baseline"], outs["exact"], outs["fast"]):
        assert a.token_ids == b.token_ids == c.token_ids and a.finish_reason == b.finish_reason == c.finish_reason
        assert a.logprobs == b.logprobs  # bit-identical
        assert c.logprobs == pytest.approx(a.logprobs, abs=1e-5)
        if "routed_experts" in a.extra:
            assert torch.equal(a.extra["routed_experts"], b.extra["routed_experts"])
            assert torch.equal(a.extra["routed_experts"], c.extra["routed_experts"])
    return outs["fast"]


def _mixed_params(n: int) -> list[SamplingParams]:
    """Greedy, plain sampling, top-k, top-p and both; lengths 2..12 so rows finish early (compaction)."""
    kinds = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.8, top_k=5),
             dict(temperature=1.2, top_p=0.7), dict(temperature=1.0, top_k=20, top_p=0.9)]
    return [SamplingParams(max_new_tokens=[2, 12, 3, 12, 7, 12][i % 6], seed=100 + i, **kinds[i % len(kinds)])
            for i in range(n)]


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (int(torch.randint(1, 18, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture
def count_compactions(monkeypatch):
    """Count the batch compactions that reach the preallocated layers (the real method still runs)."""
    calls = []
    real = PreallocatedLayer.batch_select_indices

    def spy(self, indices):
        calls.append(len(indices))
        return real(self, indices)

    monkeypatch.setattr(PreallocatedLayer, "batch_select_indices", spy)
    return calls


@pytest.mark.parametrize("arch,kv_heads", [("llama", 2), ("llama", 4), ("qwen3", 2), ("qwen2", 2), ("mistral", 2),
                                           ("phi3", 4)])
def test_same_tokens_and_logprobs_as_dynamic_cache(arch, kv_heads, tmp_path, count_compactions):
    # kv_heads 4 of 4 heads: no GQA, the attention reads the buffer's strided views directly
    from rlhforge.rollout.fast_decode import FastDecoder

    path = build_tiny_model(tmp_path / arch, TinyModelSpec(num_key_value_heads=kv_heads), seed=0, arch=arch)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    # the lean decoding step: Llama, Qwen2 (q/k/v biases), Qwen3 (q/k norms); Mistral's window and Phi-3's
    # fused projections keep transformers' forward
    assert (FastDecoder.build(model) is not None) == (arch in ("llama", "qwen3", "qwen2"))
    tok = AutoTokenizer.from_pretrained(path)
    prompts, params = _prompts(8, len(tok)), _mixed_params(8)
    outs = _same_outputs(model, prompts, params, pad_token_id=tok.pad_token_id, eos_token_id=[len(tok) + 7])
    assert [len(o.token_ids) for o in outs] == [p.max_new_tokens for p in params]  # the eos id is never sampled
    assert count_compactions  # rows finished early and left the batch
    assert count_compactions[0] < len(prompts)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_shared_prompt_is_prefilled_once_with_the_same_outputs(arch, tmp_path):
    """GRPO groups: 3 prompts x 4 samples (plus one prompt alone) prefill 4 rows, then decode 13; tokens and
    log-probs equal the baseline's (each row prefilled on its own, transformers' mask each step)."""
    path = build_tiny_model(tmp_path / arch, TinyModelSpec(num_key_value_heads=2), seed=0, arch=arch)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    distinct = _prompts(4, len(tok), seed=3)
    prompts = [p for p in distinct[:3] for _ in range(4)] + distinct[3:]
    rows_fed = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: rows_fed.append(i[0].shape[0]))
    fast = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=[len(tok) + 7])
    assert fast.padding_mask_4d and fast.shared_prefill and fast.fast_decode
    asyncio.run(fast.generate(prompts, _mixed_params(len(prompts))))
    hook.remove()
    assert rows_fed[:2] == [4, 13]
    params = _mixed_params(len(prompts))
    outs = _same_outputs(model, prompts, params, pad_token_id=tok.pad_token_id, eos_token_id=[len(tok) + 7])
    alone = fast.generate_sync([prompts[1]], [params[1]])[0]  # a copy decodes as its request would alone
    assert alone.token_ids == outs[1].token_ids and alone.logprobs == pytest.approx(outs[1].logprobs, abs=1e-5)


def test_sliding_window_layers_mask_the_same(tmp_path):
    path = build_tiny_model(tmp_path / "gemma3", seed=0, arch="gemma3_text")
    config = AutoConfig.from_pretrained(path, sliding_window=6)  # shorter than the prompts + responses
    model = AutoModelForCausalLM.from_pretrained(path, config=config).eval()
    assert config.layer_types == ["sliding_attention", "full_attention"]
    tok = AutoTokenizer.from_pretrained(path)
    _same_outputs(model, _prompts(6, len(tok), seed=1), _mixed_params(6), pad_token_id=tok.pad_token_id,
                  eos_token_id=tok.eos_token_id)


def test_per_request_seeds_do_not_depend_on_the_batch(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = HFEngine.from_pretrained(str(tiny_model_dir), tok, batch_size=8)
    assert engine.kv_cache == "preallocated"
    prompts, params = _prompts(6, len(tok), seed=2), _mixed_params(6)
    together = engine.generate_sync(prompts, params)
    for p, sp, out in zip(prompts, params, together):
        alone = engine.generate_sync([p], [sp])[0]
        assert alone.token_ids == out.token_ids
        assert alone.logprobs == pytest.approx(out.logprobs, abs=1e-5)


def test_moe_routing_records_are_the_same():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, num_experts_per_tok=2, moe_intermediate_size=32, num_experts=4)).eval()
    outs = _same_outputs(model, _prompts(6, 64, seed=3), _mixed_params(6), pad_token_id=0, eos_token_id=63,
                         record_routing=True)
    assert all(o.extra["routed_experts"].shape[1:] == (2, 2) for o in outs)


def test_qwen2_vl_with_images_is_the_same(tmp_path):
    from transformers import AutoModelForImageTextToText

    from rlhforge.models.tiny_vlm import build_tiny_vlm
    from rlhforge.models.vlm import load_processor
    from tests.rl.test_vlm_rl import _prompts as vlm_prompts

    path = build_tiny_vlm(tmp_path / "vlm", arch="qwen2_vl", seed=0)
    processor = load_processor(str(path))
    model = AutoModelForImageTextToText.from_pretrained(str(path)).eval()
    ids, vision = map(list, zip(*vlm_prompts(processor)))
    params = [SamplingParams(3, temperature=1.0, seed=1), SamplingParams(10, temperature=0.0),
              SamplingParams(10, temperature=1.0, top_k=8, seed=2)]  # row 0 finishes first: compaction
    kw = dict(pad_token_id=processor.pad_token_id, eos_token_id=processor.eos_token_id,
              image_token_id=processor.image_token_id, banned_token_ids=processor.placeholder_token_ids)
    _same_outputs(model, ids, params, vision=vision, **kw)


def test_models_with_linear_attention_layers_keep_dynamic_cache():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1)
    model = LlamaForCausalLM(config)
    assert HFEngine(model, pad_token_id=0, eos_token_id=1).kv_cache == "preallocated"
    model.config.layer_types = ["linear_attention", "full_attention"]  # a hybrid's declaration (Qwen3-Next-like)
    assert HFEngine(model, pad_token_id=0, eos_token_id=1).kv_cache == "dynamic"
    with pytest.raises(ValueError, match="kv_cache must be"):
        HFEngine(model, pad_token_id=0, eos_token_id=1, kv_cache="static")


def test_decode_attention_is_sdpa_without_repeating_kv_heads():
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhforge.rollout.decode_attention import NAME, decode_attention

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=1, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(1, 64, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :4] = mask[1, :2] = 0  # left padding
    calls = []
    attn = model.model.layers[0].self_attn
    attn.register_forward_pre_hook(lambda m, a, kw: calls.append(m.config._attn_implementation), with_kwargs=True)
    logits = {}
    with torch.no_grad():
        for native in (False, True):
            cache = PreallocatedCache(12)
            with decode_attention(model) if native else contextlib.nullcontext():
                model(input_ids=ids[:, :8], attention_mask=mask[:, :8], past_key_values=cache, use_cache=True)
                logits[native] = model(input_ids=ids[:, 8:], attention_mask=mask, past_key_values=cache,
                                       use_cache=True).logits
    assert torch.equal(logits[False], logits[True])
    assert calls == ["sdpa", "sdpa", NAME, NAME] and config._attn_implementation == "sdpa"
    model.config._attn_implementation_internal = "eager"  # not SDPA: left as it is
    with decode_attention(model):
        assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2), (8, 2), (6, 1)])
def test_grouped_decode_attention_equals_sdpa_over_strided_cache_views(heads, kv_heads):
    """The lean decoding step's batched-matmul attention against SDPA's grouped-query attention and against
    an fp64 softmax(q k^T) v written out per head, on views of a larger buffer (as the preallocated
    cache hands them) with left padding; the padded keys get no weight."""
    from rlhforge.rollout.fast_decode import grouped_decode_attention, padding_bias

    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    b, length, capacity, dim, scale = 5, 11, 16, 8, 0.3
    q = torch.randn(b, heads, 1, dim, generator=g)
    buf_k, buf_v = (torch.randn(b, kv_heads, capacity, dim, generator=g) for _ in range(2))
    k, v = buf_k[:, :, :length], buf_v[:, :, :length]  # strided views, not contiguous
    mask = torch.ones(b, 1, 1, length, dtype=torch.bool)
    for row, pad in enumerate([0, 3, 7, 10, 1]):
        mask[row, ..., :pad] = False
    out = grouped_decode_attention(q, k, v, padding_bias(mask, kv_heads, q.dtype), scale)
    assert out.shape == (b, 1, heads * dim)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                           enable_gqa=heads != kv_heads)
    assert torch.allclose(out, ref.transpose(1, 2).reshape(b, 1, -1), atol=1e-6)
    by_hand = torch.zeros(b, heads, dim, dtype=torch.float64)
    for row in range(b):
        keep = mask[row, 0, 0]
        for h in range(heads):
            kv = h // (heads // kv_heads)
            w = torch.softmax(scale * (k[row, kv, keep].double() @ q[row, h, 0].double()), dim=0)
            by_hand[row, h] = w @ v[row, kv, keep].double()
    assert torch.allclose(out.double(), by_hand.reshape(b, 1, -1), atol=1e-6)
    moved = v.clone()
    moved[:, :, :3] += 100.0  # rows 1-3 pad their first 3 keys or more: they must not change; rows 0 and 4 must
    changed = (grouped_decode_attention(q, k, moved, padding_bias(mask, kv_heads, q.dtype), scale) - out).abs()
    assert changed[0].max() > 1 and changed[4].max() > 1 and changed[1:4].max() == 0


def test_an_unknown_decode_kernel_is_refused(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ValueError, match="decode_kernel must be 'bmm' or 'sdpa'"):
        HFEngine(model, pad_token_id=0, eos_token_id=1, decode_kernel="flash")


def test_a_bf16_engine_on_cpu_keeps_an_fp32_cache_and_agrees_with_fp32(tmp_path):
    """A bf16 run's engine (``from_model(dtype=bf16)``: a bf16 copy, the trainer's module untouched) keeps
    its KV cache in fp32 and attends in fp32 on CPU. The lean decoding step equals transformers' forward
    over that cache bit for bit, and the log-probs of the tokens it samples agree with the fp32 model's
    own forward over the same tokens up to bf16 rounding of the weights."""
    path = build_tiny_model(tmp_path / "llama", TinyModelSpec(num_key_value_heads=2), seed=0)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    kw = dict(pad_token_id=tok.pad_token_id, eos_token_id=[len(tok) + 7])
    engine = HFEngine.from_model(model, tok, dtype=torch.bfloat16)
    assert next(model.parameters()).dtype == torch.float32
    assert next(engine.model.parameters()).dtype == torch.bfloat16 and engine.cache_dtype == torch.float32
    cache = engine._new_cache(4)
    bf16_keys = torch.randn(2, 2, 3, 8, dtype=torch.bfloat16)
    keys, values = cache.update(bf16_keys, bf16_keys, 0)
    assert engine.fast_decode and keys.dtype == values.dtype == torch.float32 and torch.equal(keys, bf16_keys.float())
    prompts, params = _prompts(6, len(tok), seed=5), _mixed_params(6)
    slow = HFEngine(engine.model, fast_decode=False, **kw)
    exact = HFEngine(engine.model, decode_kernel="sdpa", **kw)
    outs = [asyncio.run(e.generate(prompts, params)) for e in (slow, exact, engine)]
    for a, b in zip(outs[0], outs[1]):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs  # bit-identical
    # the default decode attention (batched matmuls) rounds differently in fp32 and the bf16 layers after it
    # may round its output another way: its log-probs are held to the fp32 model's, as the others' are
    for o in outs[1:]:
        assert _worst_vs_fp32(model, prompts, o, params) < 0.05


def _worst_vs_fp32(model, prompts, outs, params) -> float:
    """The largest gap between generated tokens' log-probs and the fp32 ``model``'s own forward over them."""
    worst = 0.0
    for p, o, sp in zip(prompts, outs, params):
        if not o.token_ids:
            continue
        ids = torch.tensor([p + o.token_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(p) - 1: -1].float()
        t = max(sp.temperature, 1e-6) if sp.temperature > 0 else 1.0
        ref = torch.log_softmax(logits / t, -1).gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0]
        worst = max(worst, (ref - torch.tensor(o.logprobs)).abs().max().item())
    assert worst > 0  # bf16 weights: close to fp32, not equal
    return worst


def test_vllm_engines_take_the_runs_precision_bf16_included_on_cpu():
    from rlhforge.rollout.vllm_engine import vllm_dtype

    assert [vllm_dtype(d, cpu=True) for d in ("auto", "fp32", "bf16", "fp16")] == \
        ["float32", "float32", "bfloat16", "float32"]
    # GPU: ``auto`` trains in bf16 (backend.device.resolve_dtype), so the engines take bf16 too, not the
    # checkpoint's own dtype (issue 30: an fp32 checkpoint gave fp32 engines beside a bf16 trainer)
    assert [vllm_dtype(d, cpu=False) for d in ("auto", "fp32", "bf16", "fp16")] == \
        ["bfloat16", "float32", "bfloat16", "float16"]
    from rlhforge.backend.device import resolve_dtype

    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    for d in ("auto", "fp32", "bf16", "fp16"):  # the same rule as the trainer's, on the GPU
        assert vllm_dtype(d, cpu=False) == names[resolve_dtype(d, torch.device("cuda"))]
