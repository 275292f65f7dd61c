"""The JSON request bodies the Tinker SDK 0.38 posts, as lenient pydantic models (unknown fields ignored, so a
newer SDK's additions do not break the server). :func:`parse` turns any problem into a
:class:`~rlhforge.tinker_server.codec.PayloadError` naming the field."""

from __future__ import annotations

from typing import Any, Optional, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rlhforge.net.errors import BadRequest
from rlhforge.net.payload import parse_json
from rlhforge.tinker_server.codec import PayloadError

T = TypeVar("T", bound=BaseModel)


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class CreateSession(_Req):
    tags: list[str] = []
    sdk_version: str = ""


class SessionRef(_Req):
    session_id: str


class LoraIn(_Req):
    rank: int = Field(ge=1, le=1024)
    seed: Optional[int] = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfigIn(_Req):
    model_config = ConfigDict(extra="allow")
    type: str = "adamw"


class CreateModel(_Req):
    session_id: str
    model_seq_id: int = Field(ge=0)
    base_model: str
    lora_config: Optional[LoraIn] = None
    optimizer_config: OptimizerConfigIn = OptimizerConfigIn()


class ModelRef(_Req):
    model_id: str


class AdamIn(_Req):
    model_config = ConfigDict(extra="forbid")
    learning_rate: float = Field(default=1e-4, ge=0, allow_inf_nan=False)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-12, gt=0, allow_inf_nan=False)
    weight_decay: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    grad_clip_norm: float = Field(default=0.0, ge=0, allow_inf_nan=False)


class OptimStep(_Req):
    model_id: str
    seq_id: int
    adam_params: Optional[Any] = None
    """Checked against :class:`AdamIn` once the seq_id is known (a refused step still takes its seq_id)."""
    optimizer_params: Optional[Any] = None
    optim_params: Optional[Any] = None


class SaveWeights(_Req):
    model_id: str
    seq_id: int
    path: Optional[str] = None


class SaveForSampler(_Req):
    model_id: str
    seq_id: int
    path: Optional[str] = None
    sampling_session_seq_id: Optional[int] = Field(default=None, ge=0)


class LoadWeights(_Req):
    model_id: Optional[str] = None
    seq_id: Optional[int] = None
    session_id: Optional[str] = None
    model_seq_id: Optional[int] = Field(default=None, ge=0)
    base_model: Optional[str] = None
    path: str
    optimizer: bool
    optimizer_config: Optional[OptimizerConfigIn] = None


class CreateSamplingSession(_Req):
    session_id: str
    sampling_session_seq_id: int = Field(ge=0)
    base_model: Optional[str] = None
    model_path: Optional[str] = None


class Chunk(_Req):
    type: str = "encoded_text"
    tokens: list[int] = []


class ModelInputIn(_Req):
    chunks: list[Chunk]


class SamplingParamsIn(_Req):
    max_tokens: Optional[int] = Field(default=None, ge=1)
    seed: Optional[int] = None
    stop: Union[str, list[int], list[str], None] = None
    temperature: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    top_k: int = -1
    top_p: float = Field(default=1.0, gt=0, le=1)


class Sample(_Req):
    num_samples: int = Field(default=1, ge=1, le=1024)
    prompt: ModelInputIn
    sampling_params: SamplingParamsIn
    base_model: Optional[str] = None
    model_path: Optional[str] = None
    sampling_session_id: Optional[str] = None
    seq_id: Optional[int] = None
    prompt_logprobs: Optional[bool] = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: Optional[Any] = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: Optional[int] = Field(default=None, ge=1)


class RetrieveFuture(_Req):
    request_id: str
    allow_metadata_only: bool = False


def validate(cls: type[T], raw: Any, prefix: str = "") -> T:
    """``raw`` (a decoded JSON value) as ``cls``; PayloadError naming the first bad field under ``prefix``."""
    if not isinstance(raw, dict):
        raise PayloadError(prefix or "body", f"must be a JSON object (got {type(raw).__name__})")
    try:
        return cls.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join([prefix] * bool(prefix) + [str(p) for p in first["loc"]]) or "body"
        more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
        raise PayloadError(where, f"{first['msg']}{more}") from None


def parse(cls: type[T], body: bytes) -> T:
    try:  # every kind of broken JSON (depth, huge integers, NaN, lone surrogates, ...) is a 400 with its reason
        raw = parse_json(body, empty={})
    except BadRequest as err:
        raise PayloadError("body", str(err)) from None
    if not isinstance(raw, dict):
        raise PayloadError("body", "must be a JSON object")
    return validate(cls, raw)
