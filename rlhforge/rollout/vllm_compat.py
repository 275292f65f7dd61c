"""What rlhforge needs from vLLM and from torch's CUDA IPC, as plain checks and conversions.

- **the version seam** (:func:`vllm_features`): where the supported vLLM versions (0.26 on CUDA: the last on
  torch 2.11; 0.32: CI's CPU build) differ in a way rlhforge must act on, one record per version says how;
  the engine reads it, nothing else compares versions
  (``../shared/reference/vllm-026-vs-032.md``: every other API rlhforge uses is the same in both).
- **version and API check** (:func:`check_vllm_api`): a :class:`~rlhforge.rollout.vllm_engine.VLLMEngine`
  refuses to start on a vLLM outside :data:`SUPPORTED_VLLM` or whose methods lack a parameter the weight
  sync passes by name (``reload_weights(weights_iterator=)``, ``load_weights(weights=)``,
  ``collective_rpc(args=, timeout=)``, ``wake_up(tags=)``, ...), naming the version or the parameter,
  instead of failing at the first sync. ``RLHFORGE_ALLOW_VLLM_VERSION=1`` lets an untested version through
  (the signatures are still checked).
- **CUDA-IPC handles on the wire** (:func:`ipc_handle_to_wire` / :func:`ipc_handle_from_wire`): what
  ``torch.multiprocessing.reductions.reduce_tensor`` returns for a CUDA tensor is ``(rebuild_cuda_tensor,
  args)`` with a function, classes and a ``torch.dtype`` in it. vLLM's msgpack serializer (the LLM ->
  engine-core hop of ``collective_rpc`` when the engine core is its own process, TP > 1) refuses those, so
  the handle travels as a dict of ints, strings and bytes and the engine worker rebuilds the tensor itself
  with its own device index. The bucket layout likewise (:func:`entries_to_wire`).
- **which handle a worker loads** (:func:`handles_by_gpu`, :func:`handle_for_gpu`): by GPU UUID, as vLLM,
  veRL and OpenRLHF do, never by rank or bundle index (those differ across nodes and placements).
- **the end of every weight sync** (:func:`reset_after_sync`): prefix cache and encoder cache dropped.

Nothing here imports vLLM at module import time.
"""

from __future__ import annotations

import inspect
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

__all__ = ["SUPPORTED_VLLM", "REQUIRED_PARAMS", "VLLMFeatures", "vllm_features", "supported_text", "check_vllm_api", "vllm_api_signatures", "parse_version",
           "ipc_handle_to_wire", "ipc_handle_from_wire", "entries_to_wire", "entries_from_wire", "handles_by_gpu",
           "handle_for_gpu", "gpu_uuid", "load_ipc_payload", "reset_after_sync"]

SUPPORTED_VLLM = (((0, 26), (0, 27)), ((0, 32), (0, 33)))
"""vLLM versions rlhforge supports, as ``[lo, hi)`` (major, minor) ranges: 0.26 (the CUDA build on torch 2.11,
the GPU check's; reviewed API by API against 0.32, not run in CI) and 0.32 (the CPU build CI runs)."""


@dataclass(frozen=True)
class VLLMFeatures:
    """What differs between the supported vLLM versions and changes what rlhforge does (the version seam)."""

    routing_runner: str
    """Which GPU model runner records routed experts (routing replay): ``"v1"`` on 0.26 (V2 lists it as
    unsupported and refuses), ``"v2"`` on 0.32 (only V2's AuxOutput connector records them)."""
    routing_needs_prefix_caching: bool
    """0.32 refuses routed-experts capture without prefix caching at config time; 0.26 does not need it."""
    wake_empties_torch_cache: bool
    """0.32's allocator empties torch's cache before it maps memory back at a wake; 0.26's does not, so an
    engine in the caller's process empties it first (else the wake can run out of memory)."""


def vllm_features(version: str) -> VLLMFeatures:
    """The seam's record for a vLLM ``version`` (versions past 0.32 get 0.32's, earlier ones 0.26's)."""
    newer = parse_version(version)[:2] >= (0, 32)
    return VLLMFeatures(routing_runner="v2" if newer else "v1", routing_needs_prefix_caching=newer,
                        wake_empties_torch_cache=newer)


def supported_text() -> str:
    return " or ".join(f"{lo[0]}.{lo[1]}.x" for lo, _ in SUPPORTED_VLLM)

REQUIRED_PARAMS: dict[str, tuple[str, ...]] = {
    "LLM.__init__": ("model",),
    "LLM.generate": ("use_tqdm",),
    "LLM.collective_rpc": ("method", "timeout", "args"),
    "LLM.reset_prefix_cache": (),
    "LLM.sleep": ("level",),
    "LLM.wake_up": ("tags",),
    "LLMEngine.reset_encoder_cache": (),
    "EngineArgs": ("worker_extension_cls", "logprobs_mode", "enable_sleep_mode", "kv_cache_memory_bytes"),
    "SamplingParams": ("seed", "stop_token_ids", "logprobs", "detokenize", "skip_special_tokens", "bad_words"),
    # checked inside the engine's workers, after start-up (rlhforge_api_signatures):
    "model_runner.reload_weights": ("weights_iterator",),
    "model.load_weights": ("weights",),
}
"""Parameter names the sync and the engine pass to vLLM, per callable (keyword or positional-by-name)."""


def parse_version(version: str) -> tuple[int, int, int]:
    """``"0.32.1+cpu"`` -> (0, 32, 1); ValueError when there is no leading ``major.minor``."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(version))
    if m is None:
        raise ValueError(f"cannot read a vLLM version from {version!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def _params(obj: Any) -> tuple[set[str], bool] | None:
    """(parameter names, takes **kwargs) of a callable, an inspect.Signature, a list of names, or a worker's
    ``{"params": [...], "var_keyword": bool}`` (``rlhforge_api_signatures``)."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return set(obj["params"]), bool(obj.get("var_keyword", False))
    if isinstance(obj, (list, tuple, set, frozenset)):
        return set(obj), False
    sig = obj if isinstance(obj, inspect.Signature) else inspect.signature(obj)
    names = {p.name for p in sig.parameters.values()}
    return names, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())


def check_vllm_api(version: str, signatures: Mapping[str, Any], *, allow_other_version: bool | None = None,
                   required: Mapping[str, Sequence[str]] = REQUIRED_PARAMS) -> None:
    """Refuse (RuntimeError) a vLLM ``version`` outside :data:`SUPPORTED_VLLM`, or a callable of
    ``signatures`` (name -> callable / inspect.Signature / parameter names; None: missing) without a
    parameter of ``required``. Names in ``required`` that ``signatures`` does not list are not checked
    (the worker-side ones are checked after start-up)."""
    supported = f"vLLM {supported_text()}"
    if allow_other_version is None:
        allow_other_version = os.environ.get("RLHFORGE_ALLOW_VLLM_VERSION") == "1"
    if not allow_other_version:
        try:
            v = parse_version(version)
        except ValueError as err:
            raise RuntimeError(f"{err}; rlhforge's weight sync supports {supported}") from None
        if not any(lo <= v[:2] < hi for lo, hi in SUPPORTED_VLLM):
            raise RuntimeError(f"vLLM {version} is not supported: rlhforge's weight sync supports {supported} (0.26 on "
                               "CUDA with torch 2.11, 0.32 as CI's CPU build; install one of them, or set "
                               "RLHFORGE_ALLOW_VLLM_VERSION=1 to try this one: signatures are still checked)")
    for name, needed in required.items():
        if name not in signatures:
            continue
        got = _params(signatures[name])
        if got is None:
            raise RuntimeError(f"vLLM {version}: {name} does not exist; rlhforge needs it (supported: {supported})")
        names, var_kw = got
        missing = [p for p in needed if p not in names and not var_kw]  # **kwargs takes any keyword
        if missing:
            raise RuntimeError(f"vLLM {version}: {name} has no parameter {missing[0]!r} (rlhforge passes "
                               f"{', '.join(needed)}); supported: {supported}")


def vllm_api_signatures() -> dict[str, Any]:
    """The installed vLLM's callables of :data:`REQUIRED_PARAMS` (driver side; None where missing)."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    def get(owner, attr):
        return getattr(owner, attr, None)

    return {"LLM.__init__": vllm.LLM.__init__, "LLM.generate": get(vllm.LLM, "generate"),
            "LLM.collective_rpc": get(vllm.LLM, "collective_rpc"),
            "LLM.reset_prefix_cache": get(vllm.LLM, "reset_prefix_cache"), "LLM.sleep": get(vllm.LLM, "sleep"),
            "LLM.wake_up": get(vllm.LLM, "wake_up"),
            "LLMEngine.reset_encoder_cache": get(LLMEngine, "reset_encoder_cache"),
            "EngineArgs": EngineArgs, "SamplingParams": list(vllm.SamplingParams.__struct_fields__)}


# -- CUDA IPC on the wire -------------------------------------------------------------------------
_TENSOR_CLS = {"Tensor": torch.Tensor, "Parameter": torch.nn.Parameter}
_STORAGE_CLS = {"TypedStorage": torch.storage.TypedStorage, "UntypedStorage": torch.UntypedStorage}
_WIRE_FIELDS = ("tensor_cls", "size", "stride", "tensor_offset", "storage_cls", "dtype", "storage_handle",
                "storage_size_bytes", "storage_offset_bytes", "requires_grad", "ref_counter_handle",
                "ref_counter_offset", "event_handle", "event_sync_required")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight sync: unknown dtype {name!r}")
    return dtype


def ipc_handle_to_wire(handle: tuple[Callable, tuple]) -> dict[str, Any]:
    """``reduce_tensor(cuda_tensor)`` -> a dict of ints, strings, bytes, bools and int lists (msgpack-safe;
    the sender's device index is dropped: the receiver uses its own)."""
    rebuild, args = handle
    if getattr(rebuild, "__name__", "") != "rebuild_cuda_tensor" or len(args) != 15:
        raise ValueError(f"not a CUDA tensor's IPC handle: {getattr(rebuild, '__name__', rebuild)!r} with "
                         f"{len(args)} arguments (expected rebuild_cuda_tensor with 15)")
    (tensor_cls, size, stride, tensor_offset, storage_cls, dtype, _device, storage_handle, storage_size_bytes,
     storage_offset_bytes, requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
     event_sync_required) = args
    cls_name = next((k for k, v in _TENSOR_CLS.items() if tensor_cls is v), None)
    storage_name = next((k for k, v in _STORAGE_CLS.items() if storage_cls is v), None)
    if cls_name is None or storage_name is None:
        raise ValueError(f"CUDA IPC handle of a {tensor_cls!r} on a {storage_cls!r}: only plain tensors are synced")
    values = (cls_name, [int(s) for s in size], [int(s) for s in stride], int(tensor_offset), storage_name,
              _dtype_name(dtype), bytes(storage_handle), int(storage_size_bytes), int(storage_offset_bytes),
              bool(requires_grad), bytes(ref_counter_handle), int(ref_counter_offset),
              None if event_handle is None else bytes(event_handle), bool(event_sync_required))
    return dict(zip(_WIRE_FIELDS, values))


def ipc_handle_from_wire(wire: Mapping[str, Any], device_index: int) -> tuple:
    """The arguments of ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` for this process's
    ``device_index`` (the GPU the handle was made on, as this process numbers it)."""
    w = dict(wire)
    return (_TENSOR_CLS[w["tensor_cls"]], torch.Size(w["size"]), tuple(w["stride"]), int(w["tensor_offset"]),
            _STORAGE_CLS[w["storage_cls"]], _dtype(w["dtype"]), int(device_index), bytes(w["storage_handle"]),
            int(w["storage_size_bytes"]), int(w["storage_offset_bytes"]), bool(w["requires_grad"]),
            bytes(w["ref_counter_handle"]), int(w["ref_counter_offset"]),
            None if w["event_handle"] is None else bytes(w["event_handle"]), bool(w["event_sync_required"]))


def entries_to_wire(entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[list]:
    """A bucket's layout [(name, dtype, shape)] -> [[name, "dtype", [shape]]] (msgpack-safe)."""
    return [[str(n), _dtype_name(d), [int(s) for s in shape]] for n, d, shape in entries]


def entries_from_wire(wire: Sequence) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return [(str(n), _dtype(d), tuple(int(s) for s in shape)) for n, d, shape in wire]


def load_ipc_payload(entries: Sequence, handles_by_gpu: Mapping[str, Any], fingerprint: bool = False) -> tuple:
    """The ``args`` of ``collective_rpc("rlhforge_load_ipc", args=...)``: the bucket layout and every GPU's
    handle in their msgpack-safe forms (handles given as ``reduce_tensor`` tuples are converted; those
    already converted pass through)."""
    wire_entries = [e if isinstance(e[1], str) else entries_to_wire([e])[0] for e in entries]
    handles = {str(uuid): h if isinstance(h, Mapping) else ipc_handle_to_wire(h) for uuid, h in handles_by_gpu.items()}
    return wire_entries, handles, bool(fingerprint)


# -- which actor rank's handle an engine worker loads ---------------------------------------------
def handles_by_gpu(sent: Sequence[tuple[str, Any] | None]) -> dict[str, Any]:
    """Per actor rank (rank order) its ``(GPU UUID, handle)`` (None: nothing sent) -> ``{uuid: handle}``
    (two ranks on one GPU: the lower rank's; they hold the same bucket)."""
    out: dict[str, Any] = {}
    for item in sent:
        if item is not None and item[1] is not None:
            out.setdefault(str(item[0]), item[1])
    return out


def handle_for_gpu(handles: Mapping[str, Any], uuid: str, who: str = "this engine worker") -> Any:
    """The handle made on GPU ``uuid``; RuntimeError naming the GPUs when no actor rank sent one from it."""
    try:
        return handles[str(uuid)]
    except KeyError:
        raise RuntimeError(f"CUDA-IPC weight sync: {who} is on GPU {uuid}, but no actor rank sent a handle from it "
                           f"(actor ranks' GPUs: {', '.join(sorted(handles)) or 'none'}). Colocated engines "
                           "(--train.colocate_all) must sit on GPUs the actor's ranks use; otherwise use the "
                           "NCCL sync (no --train.colocate_all)") from None


def gpu_uuid(device: torch.device | str | int) -> str:
    """The UUID of a CUDA device (the same physical GPU gives the same string in every process)."""
    return str(torch.cuda.get_device_properties(torch.device(device) if not isinstance(device, int)
                                                else device).uuid)


def reset_after_sync(llm) -> None:
    """End of every weight sync into a ``vllm.LLM``: drop its prefix cache (KV blocks of the old weights)
    and its encoder cache (a vision model's image embeddings computed with the old weights)."""
    llm.reset_prefix_cache()
    llm.llm_engine.reset_encoder_cache()
