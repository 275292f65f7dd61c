"""The Tinker SDK's wire formats: the protobuf ``ForwardBackwardRequest`` it posts (zstd-compressed when the
server's client config asks for it), and the protobuf ``ForwardBackwardOutput`` / ``SampleResponse`` it reads
back from ``retrieve_future`` (``Accept: application/x-protobuf``).

The message schema is the SDK's own (``tinker.proto.tinker_public_pb2``, tinker 0.38), imported here so the two
sides cannot drift apart. Every decoding problem is a :class:`PayloadError` naming the field (HTTP 400).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["PayloadError", "Datum", "FwdBwdRequest", "decode_forward_backward", "encode_forward_backward_output",
           "encode_sample_response", "json_forward_backward_output", "json_sample_response", "pb"]


class PayloadError(ValueError):
    """A request the server refuses (HTTP 400, or a failed future of category ``user``): ``field`` names
    where, the message says why."""

    def __init__(self, field_name: str, message: str, status: int = 400):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.status = status


def pb():
    """The SDK's protobuf module (``tinker`` must be installed; the CLI checks this at start-up)."""
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


@dataclass
class Datum:
    tokens: np.ndarray
    """The model input, int64 [T]."""
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    """``loss_fn_inputs`` by name (``target_tokens`` int64, ``weights`` / ``logprobs`` / ``advantages`` float32)."""


@dataclass
class FwdBwdRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    forward_only: bool
    config: dict[str, float | str]
    data: list[Datum]


_INT_DTYPES = {"DTYPE_INT64": np.int64, "DTYPE_INT32": np.int32}
_FLOAT_DTYPES = {"DTYPE_FLOAT32": np.float32}


def _array(buf: bytes, dtype, where: str) -> np.ndarray:
    size = np.dtype(dtype).itemsize
    if len(buf) % size:
        raise PayloadError(where, f"{len(buf)} bytes is not a whole number of {np.dtype(dtype).name} values")
    return np.frombuffer(buf, dtype=dtype)


def _tensor(msg, where: str) -> np.ndarray:
    p = pb()
    name = p.DType.Name(msg.dtype) if msg.dtype in p.DType.values() else str(msg.dtype)
    dtype = {**_INT_DTYPES, **_FLOAT_DTYPES}.get(name)
    if dtype is None:
        raise PayloadError(f"{where}.dtype", f"unsupported dtype {name} (float32, int64, int32 are)")
    shape = [int(s) for s in msg.shape]
    kind = msg.WhichOneof("encoding")
    if kind == "sparse_csr":
        csr = msg.sparse_csr
        values = _array(csr.values, dtype, f"{where}.sparse_csr.values")
        crow = _array(csr.crow_indices, np.int64, f"{where}.sparse_csr.crow_indices")
        col = _array(csr.col_indices, np.int64, f"{where}.sparse_csr.col_indices")
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values):
            raise PayloadError(where, f"inconsistent sparse CSR tensor (shape {shape}, {len(crow)} row pointers, "
                                      f"{len(col)} columns, {len(values)} values)")
        dense = np.zeros(shape, dtype=dtype)
        for r in range(shape[0]):
            lo, hi = int(crow[r]), int(crow[r + 1])
            cols = col[lo:hi] if 0 <= lo <= hi <= len(col) else None
            if cols is None or (cols.size and (cols.min() < 0 or cols.max() >= shape[1])):
                raise PayloadError(where, f"sparse CSR row {r} is out of range")
            dense[r, cols] = values[lo:hi]
        return dense
    arr = _array(msg.dense, dtype, f"{where}.dense")
    if shape:
        if int(np.prod(shape)) != arr.size:
            raise PayloadError(f"{where}.shape", f"shape {shape} holds {int(np.prod(shape))} values, the data {arr.size}")
        arr = arr.reshape(shape)
    return arr.astype(np.int64 if dtype in (np.int64, np.int32) else np.float32)


def decode_forward_backward(body: bytes) -> FwdBwdRequest:
    """Parse the SDK's protobuf ``ForwardBackwardRequest`` (already zstd-decompressed)."""
    from google.protobuf.message import DecodeError

    msg = pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except DecodeError as err:
        raise PayloadError("body", f"not a ForwardBackwardRequest protobuf ({err})") from None
    if not msg.model_id:
        raise PayloadError("model_id", "missing")
    if not msg.data:
        raise PayloadError("data", "no datums")
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    data = []
    for i, d in enumerate(msg.data):
        parts = []
        for j, chunk in enumerate(d.model_input):
            kind = chunk.WhichOneof("chunk")
            where = f"data[{i}].model_input[{j}]"
            if kind != "encoded_text":
                raise PayloadError(where, f"{kind or 'empty'} chunks are not supported (text tokens only)")
            parts.append(_array(chunk.encoded_text.tokens, np.int32, f"{where}.encoded_text.tokens"))
        tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        if tokens.size == 0:
            raise PayloadError(f"data[{i}].model_input", "no tokens")
        inputs = {name: _tensor(t, f"data[{i}].loss_fn_inputs.{name}") for name, t in d.loss_fn_inputs.items()}
        data.append(Datum(tokens=tokens, inputs=inputs))
    return FwdBwdRequest(model_id=msg.model_id, seq_id=int(msg.seq_id), loss_fn=msg.loss_fn,
                         forward_only=bool(msg.forward_only), config=config, data=data)


def _batched(arrays: list[np.ndarray]):
    p = pb()
    flat = [np.ascontiguousarray(a, dtype=np.float32).reshape(-1) for a in arrays]
    offsets = np.zeros(len(flat) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([a.nbytes for a in flat])
    data = b"".join(a.tobytes() for a in flat)
    return p.BatchedTensor(data=data, offsets=offsets.tobytes(), dtype=p.DTYPE_FLOAT32)


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """``outputs``: one dict of float32 1-D arrays per datum (the same names in each)."""
    p = pb()
    msg = p.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = msg.loss_fn_outputs.add(num_datums=len(outputs))
    for name in (outputs[0] if outputs else {}):
        record.fields[name].CopyFrom(_batched([o[name] for o in outputs]))
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    return msg.SerializeToString()


def json_forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> dict:
    return {"loss_fn_output_type": "ArrayRecord", "metrics": {k: float(v) for k, v in metrics.items()},
            "loss_fn_outputs": [{name: {"data": a.astype(float).tolist(), "dtype": "float32", "shape": list(a.shape)}
                                 for name, a in o.items()} for o in outputs]}


def encode_sample_response(sequences: list[dict], prompt_logprobs: np.ndarray | None) -> bytes:
    """``sequences``: dicts with ``tokens`` (ints), ``logprobs`` (floats), ``stop_reason`` (stop | length)."""
    p = pb()
    msg = p.SampleResponse()
    for s in sequences:
        seq = msg.sequences.add()
        seq.stop_reason = p.STOP_REASON_STOP if s["stop_reason"] == "stop" else p.STOP_REASON_LENGTH
        seq.tokens = np.asarray(s["tokens"], dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s["logprobs"], dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()


def json_sample_response(sequences: list[dict], prompt_logprobs: np.ndarray | None) -> dict:
    out = {"type": "sample", "sequences": [{"tokens": list(map(int, s["tokens"])),
                                            "logprobs": [float(x) for x in s["logprobs"]],
                                            "stop_reason": s["stop_reason"]} for s in sequences]}
    if prompt_logprobs is not None:
        out["prompt_logprobs"] = [None if np.isnan(x) else float(x) for x in prompt_logprobs]
    return out
