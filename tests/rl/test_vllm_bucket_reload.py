"""Weights loaded bucket by bucket into a real vLLM engine (CPU build, in-process) go through vLLM's
layerwise reload (review F2), a sync that stops partway leaves no half-built reload behind (F10), and
every reload runs with the worker's vLLM config current (F11).

The CUDA-IPC path's GPU-only step (rebuilding the bucket from its CUDA handle,
``WeightSyncExtension._rlhforge_ipc_buffer``) is replaced by one that hands over a CPU bucket packed by the
sender's own ``stream_buckets``; everything after it (unpacking, the layerwise reload across buckets and
RPCs, ``rlhforge_ipc_done``) is the code a GPU engine runs. The CPU build repacks linear weights after
loading, as GPU layers that post-process do (FlashInfer MoE on Blackwell, quantised layers), so a bare
``model.load_weights`` per bucket does not reach the kernels here either.

"New weights" are those of a second tiny model (same shapes, another seed); "a fresh engine" is one
started from a folder holding the weights in question.
"""

import asyncio

import pytest
import torch

from rlhforge.backend.collective import SyncTimeout, stream_buckets
from rlhforge.rollout.engine import SamplingParams
from rlhforge.rollout.vllm_compat import entries_to_wire
from rlhforge.rollout.vllm_engine import VLLMEngine
from rlhforge.rollout.vllm_worker import WeightSyncExtension

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("vllm")]

TEXTS = ["What is 3 + 4?", "hello world", "sort 3 1 2", "x", "abc def", "Reverse: xyz", "12 * 7 =", "the cat sat"]
BUCKET_BYTES = 48 * 1024  # several tensors per bucket, q/k/v and gate/up split across buckets


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def new_dir(tmp_path_factory):
    from rlhforge.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_new") / "model", seed=1)


def _state(model_dir) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return {k: v.detach().clone() for k, v in AutoModelForCausalLM.from_pretrained(model_dir).state_dict().items()}


def _engine(model_dir, tok) -> VLLMEngine:
    return VLLMEngine.from_tokenizer(str(model_dir), tok, max_model_len=64)


def _greedy(engine, prompts) -> list[list[int]]:
    outs = asyncio.run(engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0.0)))
    return [list(o.token_ids) for o in outs]


def _fresh_tokens(model_dir, tok, prompts) -> list[list[int]]:
    engine = _engine(model_dir, tok)
    try:
        return _greedy(engine, prompts)
    finally:
        engine.close()


@pytest.fixture
def cpu_ipc(monkeypatch):
    """The GPU-only rebuild replaced: the "handle" of GPU ``cpu`` carries the CPU bucket itself."""
    monkeypatch.setattr(WeightSyncExtension, "_rlhforge_ipc_buffer", lambda self, handles: handles["cpu"]["buffer"],
                        raising=False)


def _ipc_buckets(state: dict, stop_after: int | None = None):
    """(wire entries, handles, last) per bucket of ``state`` as ``ipc_sync.stream_ipc`` sends them;
    ``stop_after``: only the first buckets (the sender died), never the last."""
    out = []
    for entries, buf, last in stream_buckets(state, BUCKET_BYTES, "cpu"):
        out.append((entries_to_wire(entries), {"cpu": {"buffer": buf}}, last))
    assert len(out) >= 4 and sum(len(e) for e, _, _ in out) == len(state)
    return out if stop_after is None else out[:stop_after]


def _ipc_sync(engine, state: dict, stop_after: int | None = None) -> int:
    n = 0
    for wire, handles, last in _ipc_buckets(state, stop_after):
        n += engine.load_ipc(wire, handles, last=last and stop_after is None)
    return n


# -- F2 ------------------------------------------------------------------------------------------------
def test_ipc_buckets_load_like_reload_weights_and_bare_load_weights_does_not(tiny_model_dir, new_dir, tok, prompts,
                                                                           cpu_ipc):
    old, new = _state(tiny_model_dir), _state(new_dir)
    engine = _engine(tiny_model_dir, tok)
    try:
        t_old = _greedy(engine, prompts)

        # the defect class on CPU: model.load_weights per bucket, no layerwise reload (the old IPC receiver)
        def bare(worker, pairs):
            worker.model_runner.model.load_weights(weights=pairs)

        bare_error = None
        try:
            for entries, _, _ in stream_buckets(new, BUCKET_BYTES, "cpu"):
                engine.llm.collective_rpc(bare, args=([(e[0], new[e[0]]) for e in entries],))
        except AttributeError as err:  # the repacked linear weight is a plain Parameter without a loader
            bare_error = err
        t_bare = _greedy(engine, prompts)

        engine.update_weights(old)  # reload_weights: back to the start
        assert _greedy(engine, prompts) == t_old

        assert _ipc_sync(engine, new) == len(new)
        t_ipc = _greedy(engine, prompts)
        [report] = engine.sync_report()
        assert report["tensors"] == len(new) and report["params_changed"]

        engine.update_weights(old)
        assert _greedy(engine, prompts) == t_old
        engine.update_weights(new)  # the reference: one reload_weights over the same weights
        t_reload = _greedy(engine, prompts)
    finally:
        engine.close()
    assert t_reload != t_old
    assert t_ipc == t_reload
    assert t_bare != t_reload, f"bare load_weights reached the kernels (error: {bare_error})"


def test_moe_ipc_buckets_match_a_fresh_engine(tmp_path, cpu_ipc):
    """An MoE model (fused experts renamed to per-expert checkpoint names, the CPU experts prepacked again
    at the end of the sync): after an IPC sync of another model's weights, the greedy tokens of a fresh
    engine started from that model."""
    from transformers import AutoTokenizer

    from rlhforge.models.tiny import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                         moe_intermediate_size=64, tie_word_embeddings=False)
    old_dir = build_tiny_model(tmp_path / "old", spec, arch="qwen3_moe", seed=0)
    new_dir = build_tiny_model(tmp_path / "new", spec, arch="qwen3_moe", seed=1)
    tok = AutoTokenizer.from_pretrained(old_dir)
    prompts = [tok.encode(t) for t in TEXTS]
    t_new_fresh = _fresh_tokens(new_dir, tok, prompts)
    engine = _engine(old_dir, tok)
    try:
        t_old = _greedy(engine, prompts)
        new = _state(new_dir)
        assert _ipc_sync(engine, new) == len(new)
        assert _greedy(engine, prompts) == t_new_fresh != t_old
    finally:
        engine.close()


# -- F10 -----------------------------------------------------------------------------------------------
class _Group:
    """A sync group's receive side; ``dies_after``: the broadcast stops with SyncTimeout after that many
    tensors (rank 0 died)."""

    def __init__(self, state: dict, dies_after: int | None = None):
        self.pairs, self.n = list(state.items()), dies_after

    def receive(self):
        yield from self.pairs[: self.n]
        if self.n is not None:
            raise SyncTimeout("weight sync: no progress within 1.0 s (a member died or hung)")


def _set_group(wrapper, group):
    """(collective_rpc with a function: ``wrapper`` is vLLM's worker wrapper, which reads through to the worker)"""
    wrapper.worker._rlhforge_group = group


def test_a_receive_that_times_out_midway_leaves_whole_layers_and_a_full_sync_then_works(
        tiny_model_dir, new_dir, tok, prompts, tmp_path):
    from transformers import AutoModelForCausalLM

    old, new = _state(tiny_model_dir), _state(new_dir)
    names = list(new)
    # the broadcast dies after the embedding, all of layer 0 and layer 1's q_proj (its fused qkv_proj never
    # gets k and v)
    assert names[10] == "model.layers.1.self_attn.q_proj.weight" and names[1].startswith("model.layers.0.")
    assert all(n.startswith("model.layers.0.") for n in names[1:10])
    # whole layers: what arrived complete is new, the rest old, layer 1's qkv_proj included; vLLM's lm_head is
    # a layer of its own (tied storage, repacked on CPU) that received nothing, so it keeps the old embedding
    mixed = dict(old, **{n: new[n] for n in names[:10]})
    mixed["lm_head.weight"] = old["model.embed_tokens.weight"].clone()
    mixed_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, tie_word_embeddings=False)
    mixed_model.load_state_dict(mixed)
    mixed_model.save_pretrained(tmp_path / "mixed")
    tok.save_pretrained(tmp_path / "mixed")
    t_new_fresh = _fresh_tokens(new_dir, tok, prompts)
    t_mixed_fresh = _fresh_tokens(tmp_path / "mixed", tok, prompts)
    assert t_mixed_fresh != t_new_fresh

    engine = _engine(tiny_model_dir, tok)
    try:
        t_old = _greedy(engine, prompts)
        assert t_mixed_fresh != t_old
        engine.llm.collective_rpc(_set_group, args=(_Group(new, dies_after=11),))
        with pytest.raises(SyncTimeout):
            engine.receive_weights()
        assert _greedy(engine, prompts) == t_mixed_fresh  # no layer half-loaded, none left on the meta device
        engine.update_weights(new)  # the driver's reload after a failed sync
        assert _greedy(engine, prompts) == t_new_fresh
    finally:
        engine.close()


def test_an_ipc_sync_whose_sender_stopped_is_ended_by_the_next_sync(tiny_model_dir, new_dir, tok, prompts, cpu_ipc):
    old, new = _state(tiny_model_dir), _state(new_dir)
    t_new_fresh = _fresh_tokens(new_dir, tok, prompts)
    engine = _engine(tiny_model_dir, tok)
    try:
        t_old = _greedy(engine, prompts)
        _ipc_sync(engine, new, stop_after=2)  # no last bucket, no rlhforge_ipc_done
        _ipc_sync(engine, new)  # the next IPC sync starts over (its first name was already loaded)
        assert _greedy(engine, prompts) == t_new_fresh

        _ipc_sync(engine, old, stop_after=3)
        engine.update_weights(old)  # another path after a broken IPC sync
        assert _greedy(engine, prompts) == t_old
    finally:
        engine.close()


# -- F11 -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["tensors", "receive", "ipc"])
def test_the_vllm_config_is_current_while_weights_load(tiny_model_dir, tok, path, monkeypatch, cpu_ipc):
    """A layer that looks the config up while it loads or post-processes (``get_current_vllm_config()``
    asserts outside ``set_current_vllm_config``) finds this worker's config, on every path."""
    import rlhforge.models.moe as moe
    from vllm.config import get_current_vllm_config

    seen = []
    plain = moe.checkpoint_names

    def looking_up(named, skeleton):
        for name, t in plain(named, skeleton):
            seen.append(get_current_vllm_config())
            yield name, t

    monkeypatch.setattr(moe, "checkpoint_names", looking_up)
    state = {k: v + 0.01 for k, v in _state(tiny_model_dir).items()}
    engine = _engine(tiny_model_dir, tok)
    try:
        if path == "tensors":
            engine.update_weights(state)
        elif path == "receive":
            engine.llm.collective_rpc(_set_group, args=(_Group(state),))
            engine.receive_weights()
        else:
            assert _ipc_sync(engine, state) == len(state)
        [is_workers] = engine.llm.collective_rpc(lambda w: all(c is w.vllm_config for c in seen))
        assert len(seen) == len(state) and is_workers
        [report] = engine.sync_report()
        assert report["tensors"] == len(state) and report["params_changed"]
    finally:
        engine.close()
