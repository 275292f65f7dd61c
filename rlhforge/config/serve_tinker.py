"""Configuration of ``rlhforge serve-tinker``: a local server for the ``tinker`` SDK (Thinking Machines'
training API). See docs/tinker.md.

The SDK talks to it with only ``TINKER_BASE_URL=http://127.0.0.1:PORT`` and ``TINKER_API_KEY=tml-...`` set.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rlhforge.config.parsing import ConfigError

KEY_ENV = "RLHFORGE_TINKER_API_KEY"
SDK_KEY_ENV = "TINKER_API_KEY"
_NAME = re.compile(r"^[^=\s]+$")
_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


def read_keys_file(path: str) -> dict[str, str]:
    """``--api_keys_file``: key -> tenant name. One key a line, ``KEY`` or ``NAME KEY`` (``NAME``: letters, digits,
    ``_.-``; default: ``key-`` + the first 12 hex digits of the key's SHA-256); blank lines and ``#`` comments
    are skipped. ConfigError naming the file and line for anything else."""
    import hashlib

    try:
        text = Path(path).expanduser().read_text()
    except OSError as err:
        raise ConfigError(f"--api_keys_file {path}: cannot read it ({err.strerror or err})") from None
    keys: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"--api_keys_file {path}, line {number}"
        if len(words) > 2:
            raise ConfigError(f"{where}: expected 'KEY' or 'NAME KEY' (got {len(words)} words)")
        key = words[-1]
        name = words[0] if len(words) == 2 else "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
        if not key.startswith("tml-") or len(key) < 8:
            raise ConfigError(f"{where}: keys must have the SDK's form 'tml-' + at least 4 characters")
        if not _TENANT.match(name):
            raise ConfigError(f"{where}: tenant name {name[:70]!r} must be letters, digits and _.- (at most 64)")
        if key in keys:
            raise ConfigError(f"{where}: this key is already listed (tenant {keys[key]!r})")
        if name in keys.values():
            raise ConfigError(f"{where}: tenant name {name!r} is used twice")
        keys[key] = name
    if not keys:
        raise ConfigError(f"--api_keys_file {path}: no keys in it")
    return keys


@dataclass(frozen=True)
class ServeTinkerConfig:
    """Serve the Tinker training API (``tinker`` SDK 0.38) over rlhforge's models, strategies and engines:
    LoRA training with ``forward_backward`` / ``optim_step`` (AdamW), checkpoints on disk, sampling with
    token log-probs. Base models are local folders (or names mapped to them with ``--model_map``)."""

    host: str = "127.0.0.1"
    """Address to bind (loopback by default; ``0.0.0.0`` exposes the server: keep the API key secret)."""
    port: int = 8000
    """TCP port."""
    api_key: tuple[str, ...] = ()
    """Accepted API keys, in the SDK's form (``tml-`` followed by anything). Default: the
    ``RLHFORGE_TINKER_API_KEY`` environment variable (comma-separated), else ``TINKER_API_KEY`` (the SDK's own
    variable, so one export serves both), else a random key printed at start-up. Requests without an accepted
    ``X-API-Key`` get HTTP 401 (``/api/v1/healthz`` excepted)."""
    api_keys_file: str | None = None
    """A file of further keys, one a line (``KEY`` or ``NAME KEY``), each a tenant of its own: its sessions,
    models, checkpoints (in ``CHECKPOINT_DIR/tenant-NAME``), samplers and futures are invisible to every other
    key (404). The ``--api_key`` keys share the default tenant. docs/security.md."""
    model_map: tuple[str, ...] = ()
    """``NAME=FOLDER`` entries: a ``base_model`` name the client sends (``Qwen/Qwen3-8B``) -> a local HF folder.
    A ``base_model`` that is an existing folder needs no entry."""
    checkpoint_dir: str = "./tinker_checkpoints"
    """Where ``save_weights`` / ``save_weights_for_sampler`` write (``tinker://RUN/weights/NAME`` ->
    ``CHECKPOINT_DIR/RUN/weights/NAME``); checkpoints survive a restart of the server."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Training and sampling device (``auto``: CUDA when present)."""
    param_dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Training precision (fp32 master weights; ``auto``: bf16 on GPU, fp32 on CPU)."""
    lora_alpha: int = 32
    """LoRA alpha of every model (the SDK sends only the rank)."""
    default_max_tokens: int = 256
    """``max_tokens`` of a sample request that gives none."""
    max_request_bytes: int = 256 * 2**20
    """Largest request body (bytes, after zstd decompression); a longer one gets HTTP 413."""
    max_zstd_ratio: float = 1000.0
    """A zstd body may decompress to at most this many times its compressed size (and at most
    ``--max_request_bytes``); more gets HTTP 413 as soon as the output passes the bound, so a small frame that
    expands to gigabytes costs at most ``ratio x its size`` of memory. The SDK's bodies (token ids and floats)
    compress far less."""
    header_timeout_s: float = 10.0
    """Seconds a client has to send a request's headers (a connection that sends nothing, or trickles, gets
    HTTP 408 and is closed)."""
    body_timeout_s: float = 120.0
    """Seconds a client has to send a request's body once the server starts reading it; HTTP 408 after."""
    retrieve_wait_s: float = 20.0
    """``retrieve_future`` long-polls up to this long before answering ``try_again`` (the SDK polls again at once)."""
    seq_window: int = 256
    """A request's ``seq_id`` must be below the model's next expected one + this (else HTTP 400 at once)."""
    expose_base_folders: Literal["auto", "on", "off"] = "auto"
    """Whether ``get_info``'s ``tokenizer_id`` is a base model's folder on this machine (the SDK's
    ``get_tokenizer()`` then loads it from disk, offline) or the ``base_model`` name the client sent (a hub id,
    a ``--model_map`` name, or a folder the client named itself). ``auto``: the folder only when bound to
    loopback (the client is on this machine, the one place a folder path is of use); from another machine a
    server folder is of no use and is not shown."""
    seq_gap_timeout_s: float = 120.0
    """A model's requests run in ``seq_id`` order; a request waiting this long for a missing earlier ``seq_id``
    runs anyway (logged), so a lost request never blocks a model forever."""
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "warning"
    """uvicorn log level."""

    @property
    def resolved_api_keys(self) -> tuple[str, ...]:
        if self.api_key:
            return tuple(self.api_key)
        env = os.environ.get(KEY_ENV) or os.environ.get(SDK_KEY_ENV) or ""
        return tuple(k.strip() for k in env.split(",") if k.strip())

    @property
    def shows_base_folders(self) -> bool:
        if self.expose_base_folders == "auto":
            return self.host in ("127.0.0.1", "localhost", "::1")
        return self.expose_base_folders == "on"

    @property
    def model_table(self) -> dict[str, str]:
        return dict(entry.split("=", 1) for entry in self.model_map)

    def validate(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port must be in 1..65535 (got {self.port})")
        for key in self.resolved_api_keys:
            if not key.startswith("tml-") or len(key) < 8:
                raise ConfigError(f"--api_key: keys must have the SDK's form 'tml-' + at least 4 characters "
                                  f"(got {key[:4]!r}...); the tinker SDK refuses other keys")
        for entry in self.model_map:
            name, sep, folder = entry.partition("=")
            if not sep or not _NAME.match(name) or not folder:
                raise ConfigError(f"--model_map: expected NAME=FOLDER (got {entry!r})")
            if not Path(folder).expanduser().is_dir():
                raise ConfigError(f"--model_map: {name}={folder}: folder not found")
        if self.lora_alpha < 1:
            raise ConfigError(f"--lora_alpha must be >= 1 (got {self.lora_alpha})")
        if self.default_max_tokens < 1:
            raise ConfigError(f"--default_max_tokens must be >= 1 (got {self.default_max_tokens})")
        if self.max_request_bytes < 1024:
            raise ConfigError(f"--max_request_bytes must be >= 1024 (got {self.max_request_bytes})")
        if not 0 < self.retrieve_wait_s <= 40:
            raise ConfigError(f"--retrieve_wait_s must be in (0, 40] (the SDK times a poll out at 45 s; got "
                              f"{self.retrieve_wait_s})")
        if self.seq_window < 1:
            raise ConfigError(f"--seq_window must be >= 1 (got {self.seq_window})")
        if self.api_keys_file is not None:
            tenants = read_keys_file(self.api_keys_file)
            shared = set(tenants) & set(self.resolved_api_keys)
            if shared:
                raise ConfigError(f"--api_keys_file {self.api_keys_file}: a key is also given by --api_key (or the "
                                  "environment); each key belongs to one tenant")
        for name in ("max_zstd_ratio", "header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name} must be > 0 (got {getattr(self, name)})")
        if self.seq_gap_timeout_s <= 0:
            raise ConfigError(f"--seq_gap_timeout_s must be > 0 (got {self.seq_gap_timeout_s})")
