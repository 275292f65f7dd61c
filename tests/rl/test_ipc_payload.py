"""CUDA-IPC weight sync on CPU: what ``VLLMEngine.load_ipc`` sends passes vLLM 0.32's own msgpack
serializer (the LLM -> engine-core hop when the engine core is its own process: TP > 1), the worker
side gets the same ``rebuild_cuda_tensor`` arguments back (with its own device index), and each
engine worker picks the handle made on its own GPU by UUID.

The handle is built with the exact types ``torch.multiprocessing.reductions.reduce_tensor`` returns for
a CUDA tensor (no CUDA here: the fields come from a CPU tensor of the same shape, the byte handles are
made up). Rebuilding the tensor itself needs a GPU (the GPU check)."""

import uuid as uuidlib

import pytest
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from rlhforge.rollout.vllm_compat import (entries_from_wire, handle_for_gpu, handles_by_gpu, ipc_handle_from_wire,
                                          ipc_handle_to_wire, load_ipc_payload)

pytestmark = pytest.mark.usefixtures("vllm")


def _cuda_handle(nbytes=4096, device_index=3, seed=1):
    """``reduce_tensor(cuda_uint8_buffer)`` as torch builds it (reductions.py): (rebuild_cuda_tensor, 15 args)."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    return (rebuild_cuda_tensor, (
        type(buf), buf.size(), buf.stride(), buf.storage_offset(), type(buf._typed_storage()), buf.dtype,
        device_index,  # the sender's device index
        bytes([seed]) * 64,  # cudaIpcMemHandle
        nbytes + 512,  # storage_size_bytes
        1024,  # storage_offset_bytes
        False,  # requires_grad
        bytes([seed + 1]) * 40,  # ref_counter_handle
        7,  # ref_counter_offset
        bytes([seed + 2]) * 64,  # event_handle
        True,  # event_sync_required
    ))


ENTRIES = [("model.embed_tokens.weight", torch.bfloat16, (128, 16)), ("lm_head.bias", torch.float32, (128,)),
           ("model.norm.weight", torch.float16, (16,))]


def _utility_request(args):
    """What ``LLM.collective_rpc("rlhforge_load_ipc", args=args)`` hands to vLLM's encoder (core_client.call_utility)."""
    return (0, 12345, "collective_rpc", ("rlhforge_load_ipc", None, args, None))


def test_the_old_payload_fails_vllms_msgpack_encoder(monkeypatch):
    from vllm.v1.serial_utils import MsgpackEncoder

    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    old = (ENTRIES, {0: _cuda_handle()}, False)  # what load_ipc sent before: dtypes, classes, a function
    with pytest.raises(TypeError, match="not serializable"):
        MsgpackEncoder().encode(_utility_request(old))
    with pytest.raises(TypeError, match="not serializable"):  # the entries alone (torch.dtype) fail too
        MsgpackEncoder().encode(_utility_request((ENTRIES, {}, False)))


def test_the_ipc_payload_round_trips_vllms_msgpack_and_rebuilds_the_same_arguments(monkeypatch):
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    handles = {"GPU-aaaa": _cuda_handle(seed=1), "GPU-bbbb": _cuda_handle(nbytes=8192, device_index=1, seed=9)}
    args = load_ipc_payload(ENTRIES, handles, fingerprint=True)  # exactly what VLLMEngine.load_ipc sends
    frames = MsgpackEncoder().encode(_utility_request(args))
    _, call_id, method, (rpc, timeout, got, kwargs) = MsgpackDecoder().decode(frames)  # the engine core's side
    assert (call_id, method, rpc, timeout, kwargs) == (12345, "collective_rpc", "rlhforge_load_ipc", None, None)
    entries, by_gpu, fingerprint = got
    assert fingerprint is True
    assert entries_from_wire(entries) == ENTRIES  # names, torch dtypes, shapes as tuples
    for gpu, (fn, original) in handles.items():
        rebuilt = ipc_handle_from_wire(handle_for_gpu(by_gpu, gpu), device_index=5)  # the worker's own index
        assert fn is rebuild_cuda_tensor
        assert rebuilt[:6] == original[:6] and rebuilt[7:] == original[7:]  # every field as reduce_tensor gave it
        assert rebuilt[6] == 5
        assert rebuilt[0] is torch.Tensor and rebuilt[4] is torch.storage.TypedStorage
        assert isinstance(rebuilt[1], torch.Size) and rebuilt[5] is torch.uint8
        assert [type(a) for a in rebuilt[7:]] == [type(a) for a in original[7:]]


def test_a_handle_that_is_not_a_cuda_tensors_is_refused():
    with pytest.raises(ValueError, match="rebuild_cuda_tensor"):
        ipc_handle_to_wire((print, (1, 2)))
    fn, args = _cuda_handle()
    with pytest.raises(ValueError, match="plain tensors"):
        ipc_handle_to_wire((fn, (dict, *args[1:])))


# -- which handle each engine worker takes: by GPU UUID ---------------------------------------------
def _fake_uuid(node: str, index: int) -> str:
    return str(uuidlib.uuid5(uuidlib.NAMESPACE_DNS, f"{node}/gpu{index}"))


def test_two_nodes_with_the_same_local_indices_pair_by_gpu():
    # actor ranks 0-1 on node A GPUs 0-1, ranks 2-3 on node B GPUs 0-1 (same local indices)
    sent = [(_fake_uuid(n, i), f"handle of rank {r}") for r, (n, i) in enumerate([("A", 0), ("A", 1), ("B", 0), ("B", 1)])]
    handles = handles_by_gpu(sent)
    assert len(handles) == 4
    # an engine with TP 2 on node B: its worker on B's GPU 0 takes rank 2's, not rank 0's
    assert handle_for_gpu(handles, _fake_uuid("B", 0)) == "handle of rank 2"
    assert handle_for_gpu(handles, _fake_uuid("B", 1)) == "handle of rank 3"
    assert handle_for_gpu(handles, _fake_uuid("A", 1)) == "handle of rank 1"


def test_an_engine_on_more_gpus_than_the_actor_names_the_gpu_without_a_sender():
    sent = [(_fake_uuid("A", 0), "h0"), (_fake_uuid("A", 1), "h1")]  # 2 actor ranks
    handles = handles_by_gpu(sent)
    engine_gpus = [_fake_uuid("A", i) for i in range(4)]  # one engine, TP 4
    assert [handle_for_gpu(handles, g) for g in engine_gpus[:2]] == ["h0", "h1"]
    with pytest.raises(RuntimeError) as err:
        handle_for_gpu(handles, engine_gpus[2], "engine worker rank 2")
    msg = str(err.value)
    assert engine_gpus[2] in msg and "engine worker rank 2" in msg
    assert _fake_uuid("A", 0) in msg and _fake_uuid("A", 1) in msg  # the GPUs that did send


def test_ranks_without_a_bucket_and_two_ranks_on_one_gpu():
    gpu = _fake_uuid("A", 0)
    assert handles_by_gpu([(gpu, None), None, (_fake_uuid("A", 1), "h1")]) == {_fake_uuid("A", 1): "h1"}
    assert handles_by_gpu([(gpu, "rank0"), (gpu, "rank1")]) == {gpu: "rank0"}  # the lower rank's
    with pytest.raises(RuntimeError, match="none"):
        handle_for_gpu({}, gpu)
