"""Issue 39, point 3: a weight sync is bucketed on every path, counted on CPU for a tiny model.

The count of transfers per sync must follow the buckets that :func:`plan_buckets` plans for the state dict
and ``--vllm.sync_bucket_mb`` (several tensors per transfer), never the number of parameters (OpenRLHF 0.11
sends one parameter per RPC and per broadcast). Paths:

- the gloo group (actor rank 0's :class:`SyncGroup` -> the driver's :class:`DriverReceiver`; the engine
  actors' group is the same ``broadcast_state`` / ``receive_state``): per bucket one payload broadcast
  plus two small ones (the header's length, the header), on both members;
- the vLLM RPC path (an engine in another process): one ``rlhforge_stage_bucket`` RPC per bucket, then one
  ``rlhforge_load_staged``;
- the in-process vLLM engine: one RPC for the whole state dict (the tensors are not copied).
"""

import threading

import pytest
import torch

from rlhforge.backend import collective
from rlhforge.backend.collective import SyncGroup, free_port, plan_buckets


def _tiny_state(tiny_model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = load_file(str(tiny_model_dir / "model.safetensors"))
    return {k: (v * 1.5 if v.dim() == 2 else v) for k, v in state.items()}  # other weights than the engine's


def _layout(state) -> list:
    return [(k, v.dtype, tuple(v.shape)) for k, v in state.items()]


def _gloo_sync(state, bucket_bytes, monkeypatch) -> tuple[dict, dict, int]:
    """One sync over a two-member gloo group, sender SyncGroup (rank 0) -> DriverReceiver (rank 1), each in its
    own thread. Returns ({member: [bytes of each broadcast]}, what the receiver got, what send() returned)."""
    from rlhforge.workers.weight_sync import DriverReceiver

    sizes: dict[str, list[int]] = {"sender": [], "receiver": []}
    real = collective._broadcast

    def counting(pg, tensor, deadline_s=None):
        sizes[threading.current_thread().name].append(tensor.numel() * tensor.element_size())
        return real(pg, tensor, deadline_s)

    monkeypatch.setattr(collective, "_broadcast", counting)
    port = free_port()
    receiver = DriverReceiver("127.0.0.1", port)
    box: dict = {}

    def receive():
        receiver.connect()
        box["got"] = receiver.receive()

    t = threading.Thread(target=receive, name="receiver")
    t.start()
    sent = {}
    s = threading.Thread(target=lambda: sent.update(n=SyncGroup("127.0.0.1", port, 0, 2).send(state, bucket_bytes)),
                         name="sender")
    s.start()
    s.join(timeout=120)
    t.join(timeout=120)
    assert "n" in sent and "got" in box, "the sync did not finish"
    return sizes, box["got"], sent["n"]


@pytest.mark.parametrize("bucket_bytes", [512 << 10, 1], ids=["512KiB", "per_tensor"])
def test_gloo_sync_makes_one_payload_broadcast_per_planned_bucket(tiny_model_dir, monkeypatch, bucket_bytes):
    state = _tiny_state(tiny_model_dir)
    planned = plan_buckets(_layout(state), bucket_bytes)
    sizes, got, sent = _gloo_sync(state, bucket_bytes, monkeypatch)
    assert sent == len(planned)
    sizes_of = [v.numel() * v.element_size() for v in state.values()]
    payload = [sum(sizes_of[i] for i in b) for b in planned]
    for member in ("sender", "receiver"):
        n = sizes[member]
        assert len(n) == 3 * len(planned), (member, len(n), len(planned))  # length, header, payload per bucket
        assert n[2::3] == payload  # the payload broadcasts are the planned buckets, byte for byte
        assert n[0::3] == [8] * len(planned)  # one int64: the header's length
    assert list(got) == list(state) and all(torch.equal(got[k], state[k]) for k in state)
    if bucket_bytes == 1:
        assert len(planned) == len(state)  # the per-parameter baseline: one transfer per tensor
    else:
        assert 1 < len(planned) <= len(state) // 4  # several tensors per transfer


def _count_rpcs(engine) -> list[str]:
    calls: list[str] = []
    rpc = engine.llm.collective_rpc
    engine.llm.collective_rpc = lambda method, *a, **k: calls.append(method) or rpc(method, *a, **k)
    return calls


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.usefixtures("vllm")
def test_vllm_rpc_sync_stages_one_rpc_per_planned_bucket(tiny_model_dir):
    """An engine in another process (vLLM's multiprocess mode): the bucket size is ``bucket_mb``
    (``--vllm.sync_bucket_mb``); the RPCs per sync are the planned buckets + one reload, and the
    engine uses the weights (its checksum is the state's)."""
    from transformers import AutoTokenizer

    from rlhforge.rollout.vllm_engine import VLLMEngine

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    state = _tiny_state(tiny_model_dir)
    engine = VLLMEngine.from_tokenizer(str(tiny_model_dir), tok, max_model_len=128, in_process=False,
                                       bucket_mb=0.5)
    try:
        assert engine.bucket_bytes == 512 << 10
        from safetensors.torch import load_file

        base = load_file(str(tiny_model_dir / "model.safetensors"))  # what the engine started with
        before = engine.checksum()
        calls = _count_rpcs(engine)
        sums = []
        for bucket_bytes, weights in ((1, state), (512 << 10, base), (512 << 10, state)):
            engine.bucket_bytes = bucket_bytes
            calls.clear()
            planned = plan_buckets(_layout(weights), bucket_bytes)
            engine.update_weights(weights)
            assert calls.count("rlhforge_stage_bucket") == len(planned), (bucket_bytes, calls)
            assert calls.count("rlhforge_load_staged") == 1
            assert len(calls) == len(planned) + 1  # nothing else per tensor
            assert (len(planned) == len(state)) if bucket_bytes == 1 else (1 < len(planned) <= len(state) // 4)
            sums.append(engine.checksum())
        # the weights took effect: the per-parameter and the bucketed sync of one state load the same values,
        # and syncing the start-up weights back restores the start-up checksum
        assert sums[0] == sums[2] != before and sums[1] == pytest.approx(before, abs=1e-4)
    finally:
        engine.close()


@pytest.mark.usefixtures("vllm")
@pytest.mark.timeout(300)
def test_in_process_vllm_sync_is_one_rpc(tiny_model_dir):
    """The in-process engine (vLLM's CPU default): the whole state dict in one call, whatever its size."""
    from transformers import AutoTokenizer

    from rlhforge.rollout.vllm_engine import VLLMEngine

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    state = _tiny_state(tiny_model_dir)
    engine = VLLMEngine.from_tokenizer(str(tiny_model_dir), tok, max_model_len=128, bucket_mb=0.5)
    assert engine.in_process
    calls = _count_rpcs(engine)
    engine.update_weights(state)
    assert calls == ["rlhforge_load_tensors"]
