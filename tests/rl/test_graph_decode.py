"""The HF engine's static-shape decode loop (rlhforge.rollout.graph_decode, ``--rollout.hf_decode``): static
KV buffers, bucketed shapes, finished rows masked in place, CUDA graphs on a GPU. On CPU the same static step
runs eagerly: it must give the eager engine's tokens (greedy and seeded sampling, mixed prompt lengths, rows
stopping early at EOS, a bucket larger than the batch, GRPO groups sharing a prefill) with log-probs equal up
to float rounding; on CUDA the captured graph's replay must equal the static step run eagerly."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhforge.models.tiny import TinyModelSpec, build_tiny_model
from rlhforge.rollout.engine import SamplingParams
from rlhforge.rollout.graph_decode import GraphDecoder, StaticStep, buckets
from rlhforge.rollout.hf_engine import HFEngine


def _model(tmp_path, arch: str, kv_heads: int = 2):
    path = build_tiny_model(tmp_path / arch, TinyModelSpec(num_key_value_heads=kv_heads), seed=0, arch=arch)
    return AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (int(torch.randint(1, 18, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _engines(model, tok, eos, **kw):
    common = dict(pad_token_id=tok.pad_token_id, eos_token_id=eos, **kw)
    return HFEngine(model, hf_decode="eager", **common), HFEngine(model, hf_decode="graphs", **common)


def _assert_same(eager, static, prompts, params):
    want, got = asyncio.run(eager.generate(prompts, params)), asyncio.run(static.generate(prompts, params))
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
    return got


def test_buckets_pad_rows_to_powers_of_two_and_length_to_128():
    assert [buckets(r, 1)[0] for r in (1, 2, 3, 5, 8, 9, 64, 65, 128, 129, 300)] == \
        [1, 2, 4, 8, 8, 16, 64, 128, 128, 256, 384]
    assert [buckets(1, n)[1] for n in (1, 128, 129, 300)] == [128, 128, 256, 384]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_tokens_equal_the_eager_engine_with_early_eos_and_padding_rows(arch, tmp_path):
    model, tok = _model(tmp_path, arch)
    prompts = _prompts(5, len(tok))  # 5 rows: bucket 8, three padding rows
    params = [SamplingParams(max_new_tokens=m, temperature=0.0) for m in (3, 14, 9, 14, 6)]
    free = asyncio.run(HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=[len(tok) + 7],
                                hf_decode="eager").generate(prompts, params))
    eos = free[1].token_ids[4]  # a token greedy decoding reaches mid-way: rows stop there
    eager, static = _engines(model, tok, [eos])
    assert eager.graphs is None and isinstance(static.graphs, GraphDecoder) and not static.graphs.graphs  # CPU
    got = _assert_same(eager, static, prompts, params)
    assert got[1].finish_reason == "stop" and len(got[1].token_ids) <= 5
    assert any(o.finish_reason == "length" for o in got)
    assert list(static.graphs.steps) == [(8, 128)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_seeded_sampling_and_shared_prompts_equal_the_eager_engine(arch, tmp_path):
    model, tok = _model(tmp_path, arch)
    kinds = [dict(temperature=1.0), dict(temperature=0.8, top_k=5), dict(temperature=1.2, top_p=0.7),
             dict(temperature=0.0)]
    base = _prompts(3, len(tok), seed=1)
    prompts = [p for p in base for _ in range(4)]  # GRPO groups of 4: one prefill per prompt
    params = [SamplingParams(max_new_tokens=[4, 11][i % 2], seed=50 + i, **kinds[i % 4]) for i in range(12)]
    eager, static = _engines(model, tok, [len(tok) + 7])
    got = _assert_same(eager, static, prompts, params)
    assert [len(o.token_ids) for o in got] == [p.max_new_tokens for p in params]


def test_a_bucket_is_reused_across_batches_and_follows_a_weight_sync(tmp_path):
    model, tok = _model(tmp_path, "llama")
    eager, static = _engines(model, tok, [len(tok) + 7])
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    before = _assert_same(eager, static, _prompts(3, len(tok), seed=2), params)
    step = static.graphs.steps[(4, 128)]
    _assert_same(eager, static, _prompts(4, len(tok), seed=3), params)  # another batch of the same bucket
    assert list(static.graphs.steps) == [(4, 128)] and static.graphs.steps[(4, 128)] is step
    g = torch.Generator().manual_seed(9)
    new = {k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    static.update_weights(new)  # the two engines share `model`: the eager one decodes with the new weights too
    after = _assert_same(eager, static, _prompts(3, len(tok), seed=2), params)
    assert [o.token_ids for o in after] != [o.token_ids for o in before]  # the sync changed what greedy picks
    assert static.graphs.steps[(4, 128)] is step  # weights copied in place: the same buffers (and graph) serve


def test_concurrent_generations_from_threads_keep_their_own_tokens(tmp_path):
    """The agent layer's generation pool calls generate_sync from several threads: one batch holds the static
    buffers, a concurrent one takes the eager loop; every output is still the eager engine's."""
    from concurrent.futures import ThreadPoolExecutor

    model, tok = _model(tmp_path, "qwen3")
    eager, static = _engines(model, tok, [len(tok) + 7])
    batches = [_prompts(4, len(tok), seed=s) for s in range(6)]
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    want = [eager.generate_sync(b, params) for b in batches]
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda b: static.generate_sync(b, params), batches))
    for w, g in zip(want, got):
        assert [o.token_ids for o in w] == [o.token_ids for o in g]


def test_buckets_kept_hold_at_most_the_new_buckets_bytes_again(tmp_path):
    model, tok = _model(tmp_path, "llama")  # 2 layers, 2 KV heads of 32, fp32: 2 x 2 x 2 x 32 x 4 = 1 KiB a token
    dec = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, hf_decode="graphs").graphs
    assert dec.kv_bytes(4, 128) == 4 * 128 * 1024
    dec.step_for(3, 100), dec.step_for(3, 200)  # 0.5 MiB, then 1 MiB: both kept
    assert list(dec.steps) == [(4, 128), (4, 256)]
    dec.step_for(8, 100)  # 1 MiB: the oldest (0.5) goes, 1 MiB stays
    assert list(dec.steps) == [(4, 256), (8, 128)]
    dec.step_for(3, 1)  # 0.5 MiB: both larger ones go
    assert list(dec.steps) == [(4, 128)]


def test_unsupported_choices_are_refused_naming_the_flag(tmp_path):
    model, tok = _model(tmp_path, "phi3", kv_heads=4)  # fused projections: no lean step
    kw = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    with pytest.raises(ValueError, match="--rollout.hf_decode graphs: Phi3ForCausalLM is not supported"):
        HFEngine(model, hf_decode="graphs", **kw)
    assert HFEngine(model, hf_decode="auto", **kw).graphs is None  # auto: the eager loop
    with pytest.raises(ValueError, match="--rollout.hf_decode must be one of auto, graphs, eager, got 'fast'"):
        HFEngine(model, hf_decode="fast", **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_graph_replay_equals_the_static_step_run_eagerly(arch, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model, tok = _model(tmp_path, arch)
    model = model.cuda()
    eager = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=[len(tok) + 7], hf_decode="eager")
    auto = HFEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=[len(tok) + 7])  # auto: graphs on CUDA
    assert auto.graphs is not None and auto.graphs.graphs
    k = auto.graphs.kv_heads
    captured = StaticStep(auto.graphs.fast, 4, 128, k, torch.float32, model.device, graphs=True)
    plain = StaticStep(auto.graphs.fast, 4, 128, k, torch.float32, model.device, graphs=False)
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [(torch.randn(4, k, 9, p["head_dim"], device="cuda", generator=g),
               torch.randn(4, k, 9, p["head_dim"], device="cuda", generator=g)) for p in auto.graphs.fast.layers]
    attn = torch.ones(4, 9, dtype=torch.long, device="cuda")
    attn[0, :3] = 0
    for s in (captured, plain):
        s.load(layers, 9, attn, None)
    for t in range(1, 6):
        tokens = torch.randint(5, len(tok), (4,), device="cuda", generator=g)
        a = captured(tokens, torch.arange(4, device="cuda") + 9 + t, 9 + t - 1).clone()
        b = plain(tokens, torch.arange(4, device="cuda") + 9 + t, 9 + t - 1)
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    _assert_same(eager, auto, _prompts(6, len(tok)), params)


def test_the_rl_command_refuses_graphs_for_an_unsupported_model_at_start_up(tmp_path, capsys):
    from rlhforge.cli.train_ppo_ray import main as rl_main

    path = build_tiny_model(tmp_path / "phi3", TinyModelSpec(num_key_value_heads=4), seed=0, arch="phi3")
    argv = ["--actor.model_name_or_path", str(path), "--data.prompt_dataset", "builtin:arithmetic?n=8",
            "--data.input_key", "prompt",
            "--reward.remote_url", "builtin:arithmetic", "--rollout.batch_size", "2", "--train.batch_size", "2",
            "--rollout.max_new_tokens", "4", "--train.max_steps", "1", "--ckpt.output_dir", str(tmp_path / "run"),
            "--ckpt.path", str(tmp_path / "run" / "ckpts"), "--rollout.hf_decode", "graphs"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        rl_main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err
    assert "--rollout.hf_decode graphs: Phi3ForCausalLM is not supported" in err


def test_the_rl_command_generates_with_the_graphs_loop(tmp_path, monkeypatch):
    """``--rollout.hf_decode graphs`` reaches the trainer's engine: two GRPO steps (a weight sync between them)
    generate every rollout through the static loop."""
    from rlhforge.cli.train_ppo_ray import main as rl_main

    calls = []
    real = GraphDecoder._generate

    def spy(self, prompts, *args):
        calls.append(len(prompts))
        return real(self, prompts, *args)

    monkeypatch.setattr(GraphDecoder, "_generate", spy)
    path = build_tiny_model(tmp_path / "llama", TinyModelSpec(), seed=0, arch="llama")
    argv = ["--actor.model_name_or_path", str(path), "--data.prompt_dataset", "builtin:arithmetic?n=8",
            "--data.input_key", "prompt", "--data.label_key", "answer", "--reward.remote_url", "builtin:arithmetic",
            "--rollout.batch_size", "2",
            "--rollout.n_samples_per_prompt", "2", "--train.batch_size", "4", "--rollout.max_new_tokens", "6",
            "--train.max_steps", "2", "--algo.advantage.estimator", "group_norm", "--ds.param_dtype", "fp32",
            "--ckpt.output_dir", str(tmp_path / "run"), "--ckpt.path", str(tmp_path / "run" / "ckpts"),
            "--rollout.hf_decode", "graphs"]
    assert rl_main(argv) == 0
    assert calls == [4, 4]  # 2 prompts x 2 samples per step

