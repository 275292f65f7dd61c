"""Configuration of ``rlhforge serve-sandbox`` / ``python -m rlhforge.cli.serve_sandbox`` (the code
sandbox over HTTP; docs/sandbox.md "Sandbox service")."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from rlhforge.config.parsing import ConfigError, secret

_MIB = 1 << 20


@dataclass(frozen=True)
class ServeSandboxConfig:
    """Serve the tool sandbox over HTTP: POST ``/run`` with ``{"code": "...", "limits": {...}}``
    returns ``{"result": {stdout, stderr, exit_code, timed_out, ...}, "limits": {...}}``; GET
    ``/health``. The limits below are maxima: a call may ask for less, never for more."""

    host: str = "127.0.0.1"
    """Address to bind (loopback only by default; ``0.0.0.0`` for other machines, with ``--api_key``)."""
    port: int = 10003
    """TCP port (the agentic fork's ``COMPILE_SERVER_PORT``)."""
    api_key: str | None = secret()
    """Require ``Authorization: Bearer KEY`` (or ``X-API-Key: KEY``) on /run. Default: the
    ``RLHFORGE_SANDBOX_API_KEY`` environment variable if set, else no key."""
    concurrency: int | None = None
    """Calls running at once (None: the number of CPU cores this process may use)."""
    max_queue: int | None = None
    """Calls waiting for a slot beyond ``concurrency`` (None: 4 x concurrency); more get HTTP 503 with
    ``Retry-After``."""
    retry_after_s: int = 1
    """Seconds a 503 answer's ``Retry-After`` header suggests."""
    timeout_s: float = 10.0
    """Most wall-clock seconds per call (also the time limit of a call that asks for none)."""
    cpu_time_s: float | None = None
    """Most CPU seconds per process (None: = the call's time limit)."""
    memory_mb: int = 1024
    """Most address space per process, MiB."""
    max_processes: int = 16
    """Most processes and threads of one call."""
    max_output_bytes: int = 16 * 1024
    """Most bytes of stdout and of stderr kept per call (the rest is counted and dropped)."""
    kill_output_mb: int = 16
    """A call is stopped once its output exceeds this many MiB."""
    max_code_bytes: int = 1 * _MIB
    """Longest code accepted."""
    header_timeout_s: float = 10.0
    """Seconds a client has to send a request's headers (a connection that sends nothing, or trickles, gets
    HTTP 408 and is closed)."""
    body_timeout_s: float = 60.0
    """Seconds a client has to send a request's body once the server starts reading it; HTTP 408 after."""
    isolation: Literal["auto", "namespaces", "userns", "basic"] = "auto"
    """Isolation mode (docs/sandbox.md); a named mode that cannot be set up here fails the start-up."""
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    """uvicorn log level."""

    @property
    def resolved_api_key(self) -> str | None:
        return self.api_key or os.environ.get("RLHFORGE_SANDBOX_API_KEY") or None

    @property
    def resolved_concurrency(self) -> int:
        if self.concurrency is not None:
            return self.concurrency
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # not Linux
            return max(1, os.cpu_count() or 1)

    @property
    def resolved_max_queue(self) -> int:
        return self.max_queue if self.max_queue is not None else 4 * self.resolved_concurrency

    def sandbox_kwargs(self) -> dict:
        """Keyword arguments of the served ``SandboxConfig`` (the per-call maxima)."""
        return dict(timeout_s=self.timeout_s, cpu_time_s=self.cpu_time_s, memory_bytes=self.memory_mb * _MIB,
                    max_processes=self.max_processes, max_output_bytes=self.max_output_bytes,
                    kill_output_bytes=self.kill_output_mb * _MIB, max_code_bytes=self.max_code_bytes,
                    concurrency=self.resolved_concurrency, isolation=self.isolation)

    def validate(self) -> None:
        if not 0 < self.port < 65536:
            raise ConfigError(f"--port must be in 1..65535 (got {self.port})")
        if self.concurrency is not None and self.concurrency < 1:
            raise ConfigError(f"--concurrency must be >= 1 (got {self.concurrency})")
        if self.max_queue is not None and self.max_queue < 0:
            raise ConfigError(f"--max_queue must be >= 0 (got {self.max_queue})")
        if self.retry_after_s < 0:
            raise ConfigError(f"--retry_after_s must be >= 0 (got {self.retry_after_s})")
        if self.memory_mb < 32:
            raise ConfigError(f"--memory_mb must be >= 32 for Python to start (got {self.memory_mb})")
        if self.kill_output_mb * _MIB < self.max_output_bytes:
            raise ConfigError(f"--kill_output_mb {self.kill_output_mb} (= {self.kill_output_mb * _MIB} bytes) must be "
                              f">= --max_output_bytes {self.max_output_bytes}")
        for name in ("timeout_s", "max_processes", "max_code_bytes", "header_timeout_s", "body_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name} must be > 0 (got {getattr(self, name)})")
        if self.cpu_time_s is not None and self.cpu_time_s <= 0:
            raise ConfigError(f"--cpu_time_s must be > 0 (got {self.cpu_time_s})")
        if self.max_output_bytes < 256:
            raise ConfigError(f"--max_output_bytes must be >= 256 (got {self.max_output_bytes})")
