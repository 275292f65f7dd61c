"""Every weight-sync path of a real vLLM engine (CPU build) ends in the same reset: the prefix cache
and the encoder cache (a vision model's image embeddings of the old weights) are dropped.

The CUDA-IPC path's closing call (``load_ipc([], ..., last=True)``: no bucket, the sync ends) runs on CPU;
its buckets need a GPU. The encoder cache is vLLM's own (the scheduler's encoder-cache manager): an
entry standing for an image embedding computed before the sync must be gone after it."""

import pytest
import torch

from rlhforge.rollout.vllm_engine import VLLMEngine

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("vllm")]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from transformers import AutoTokenizer

    engine = VLLMEngine.from_tokenizer(str(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir),
                                       max_model_len=64)
    yield engine
    engine.close()


def _encoder_cache(engine):
    core = engine.llm.llm_engine.engine_core.engine_core  # in-process engine core
    return core.scheduler.encoder_cache_manager


def _stale_embedding(engine) -> None:
    """Make the engine's encoder cache hold one image embedding (as after serving an image)."""
    cache = _encoder_cache(engine)
    if hasattr(cache, "cached"):
        cache.cached["image-hash-of-the-old-weights"] = {"req-0"}
        cache.num_free_slots -= 1
    else:
        cache.allocated.add("image-hash-of-the-old-weights")
        cache.num_free_slots -= 1
    assert _holds_stale(engine)


def _holds_stale(engine) -> bool:
    cache = _encoder_cache(engine)
    held = cache.cached if hasattr(cache, "cached") else cache.allocated
    return "image-hash-of-the-old-weights" in held or cache.num_free_slots != cache.cache_size


def test_the_ipc_path_end_resets_the_encoder_cache(engine):
    _stale_embedding(engine)
    assert engine.load_ipc([], {}, fingerprint=False, last=True) == 0  # the closing call of an IPC sync
    assert not _holds_stale(engine)


def test_the_in_process_and_rpc_paths_end_the_same_way(engine):
    from safetensors.torch import load_file

    state = load_file(engine.llm.llm_engine.model_config.model + "/model.safetensors")
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    before = engine.checksum()
    _stale_embedding(engine)
    engine.update_weights({k: v.to(torch.float32) for k, v in state.items()})
    assert not _holds_stale(engine)
    assert engine.checksum() == pytest.approx(before, rel=1e-6)  # the same weights were loaded
