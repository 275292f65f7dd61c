"""Configuration of ``rlhforge serve-rm`` / ``python -m rlhforge.cli.serve_rm`` (HTTP reward server).

Accepts OpenRLHF's ``serve_rm`` flags (``--reward.model_name_or_path``, ``--reward.normalize_enable``,
``--ds.value_head_prefix``, ``--data.max_len``, ``--port``, ``--host``, ``--batch_size`` ...).
One deliberate difference: ``--host`` defaults to ``127.0.0.1`` (OpenRLHF: ``0.0.0.0``), so a
server is not reachable from other machines unless asked for.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from rlhforge.config.parsing import ConfigError


@dataclass(frozen=True)
class ServeRewardConfig:
    """The reward model to serve."""

    model_name_or_path: str | None = None
    """Reward model folder (``rlhforge rm`` output or any one-label ``AutoModelForSequenceClassification``)."""
    normalize_enable: bool = False
    """Return ``(r - reward_mean) / reward_std`` using the statistics stored in the model's config.json
    (``reward_mean``/``reward_std``, or OpenRLHF's ``mean``/``std``)."""


@dataclass(frozen=True)
class ServeDSConfig:
    """Model loading and forward layout."""

    value_head_prefix: str = "score"
    """Attribute name of the value head (``score`` for HF sequence-classification models)."""
    param_dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Inference precision. ``auto`` (our default; OpenRLHF's is bf16): bf16 on GPU, fp32 on CPU."""
    attn_implementation: str = "auto"
    """HF attention implementation (``auto``: flash_attention_2 if available on CUDA, else sdpa)."""
    packing_samples: bool = False
    """Run each batch padding-free (samples concatenated into one row)."""
    load_in_4bit: bool = False
    """Load the model in 4 bits (bitsandbytes, CUDA only)."""
    experts_implementation: str | None = None
    """Not supported yet: MoE experts implementation."""


@dataclass(frozen=True)
class ServeDataConfig:
    """Tokenisation of the queries."""

    max_len: int = 2048
    """Truncate each query to this many tokens (keeping its start; the last token becomes EOS)."""
    disable_fast_tokenizer: bool = False
    """Load the slow (Python) tokenizer."""


@dataclass(frozen=True)
class ServeRMConfig:
    """Serve a reward model over HTTP with OpenRLHF's protocol: POST ``/get_reward`` with
    ``{"query": [...], "prompts": [...], "labels": [...]}`` returns ``{"rewards": [...], "scores":
    [...], "extra_logs": {...}}``; GET ``/health``. Concurrent requests are batched."""

    reward: ServeRewardConfig = field(default_factory=ServeRewardConfig)
    ds: ServeDSConfig = field(default_factory=ServeDSConfig)
    data: ServeDataConfig = field(default_factory=ServeDataConfig)
    host: str = "127.0.0.1"
    """Address to bind. Our default is loopback only (OpenRLHF binds 0.0.0.0); pass ``--host 0.0.0.0``
    to accept connections from other machines (and consider ``--api_key``)."""
    port: int = 5000
    """TCP port."""
    batch_size: int | None = None
    """Most queries per forward pass (None: 32). Queries of concurrent requests are pooled into batches."""
    batch_tokens: int = 16384
    """Most padded tokens per forward pass (rows x the longest row): a long query runs with fewer others, so
    one text near ``--data.max_len`` does not pad ``--batch_size`` short ones to its length. rlhforge-specific."""
    max_wait_ms: float = 5.0
    """How long the batcher waits for more requests before running a partial batch. rlhforge-specific."""
    api_key: str | None = None
    """Require ``Authorization: Bearer KEY`` (or ``X-API-Key: KEY``) on /get_reward. Default: the
    ``RLHFORGE_RM_API_KEY`` environment variable if set, else no key. rlhforge-specific."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device: ``auto`` uses CUDA when present. rlhforge-specific."""
    max_request_bytes: int = 32 * 2**20
    """Largest request body accepted (bytes; default 32 MiB); a longer one gets HTTP 413 without being
    parsed. Queries themselves are cut to ``--data.max_len`` tokens. rlhforge-specific."""
    header_timeout_s: float = 10.0
    """Seconds a client has to send a request's headers (a connection that sends nothing, or trickles, gets
    HTTP 408 and is closed). rlhforge-specific."""
    body_timeout_s: float = 60.0
    """Seconds a client has to send a request's body once the server starts reading it; HTTP 408 after.
    rlhforge-specific."""
    max_queue: int = 256
    """Most requests admitted and not yet answered; one more gets HTTP 503 with a ``Retry-After``
    header (seconds, estimated from the backlog). rlhforge-specific."""
    graceful_shutdown_s: float = 30.0
    """On SIGTERM/SIGINT: stop accepting connections and wait up to this many seconds for the requests
    already received to be answered, then exit 0. rlhforge-specific."""
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    """uvicorn log level."""
    use_ms: bool = False
    """Not supported: ModelScope downloads."""

    @property
    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get("RLHFORGE_RM_API_KEY") or None

    @property
    def resolved_batch_size(self) -> int:
        return self.batch_size or 32

    def validate(self) -> None:
        if self.reward.model_name_or_path is None:
            raise ConfigError("--reward.model_name_or_path is required (a reward model folder)")
        if self.use_ms:
            raise ConfigError("--use_ms (ModelScope) is not supported; download the model and pass a local folder")
        if self.ds.experts_implementation is not None:
            raise ConfigError(
                f"--ds.experts_implementation {self.ds.experts_implementation} is not supported by rlhforge yet"
            )
        if self.batch_tokens < 1:
            raise ConfigError(f"--batch_tokens must be >= 1 (got {self.batch_tokens})")
        if self.batch_size is not None and self.batch_size < 1:
            raise ConfigError(f"--batch_size must be >= 1 (got {self.batch_size})")
        if self.data.max_len < 2:
            raise ConfigError(f"--data.max_len must be >= 2 (got {self.data.max_len})")
        if self.ds.load_in_4bit:
            from rlhforge.config.validation import check_load_in_4bit

            check_load_in_4bit(self.device)
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port must be in 1..65535 (got {self.port})")
        if self.max_wait_ms < 0:
            raise ConfigError(f"--max_wait_ms must be >= 0 (got {self.max_wait_ms})")
        if self.max_request_bytes < 1024:
            raise ConfigError(f"--max_request_bytes must be >= 1024 (got {self.max_request_bytes})")
        if self.max_queue < 1:
            raise ConfigError(f"--max_queue must be >= 1 (got {self.max_queue})")
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name} must be > 0 (got {getattr(self, name)})")
        if not self.graceful_shutdown_s >= 0:
            raise ConfigError(f"--graceful_shutdown_s must be >= 0 (got {self.graceful_shutdown_s})")
