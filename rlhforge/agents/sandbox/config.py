"""Sandbox settings, results and the constants the parent and the bootstrap share."""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Literal


Isolation = Literal["auto", "namespaces", "userns", "basic"]

_MIB = 1 << 20
_MARKER = "rlhforge-sandbox"
"""Appears in every sandbox process's command line (``ps``), so they can be found."""
_BOOT_NAME = f"<{_MARKER}>"
_LOADER = (f"#{_MARKER}\nimport sys,marshal;b=sys.stdin.buffer;k=b.read(1);d=b.read(int(b.readline()));"
           f"exec(marshal.loads(d) if k==b'm' else compile(d,'{_BOOT_NAME}','exec'))")
"""Runs the bootstrap sent on stdin: compiled (``m``, same interpreter as the parent: saves the
compile, tens of ms per call) or as source (``s``, another interpreter)."""
_EXIT_SETUP = 125
"""Exit code of a sandbox whose isolation could not be set up (details on the status pipe)."""
_EXIT_INIT = 126
"""Exit code of the namespace init when the code was killed by a signal (the signal is on the
status pipe) or vanished."""



class SandboxUnavailableError(RuntimeError):
    """The isolation mode asked for cannot be set up here (the message says why)."""


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and isolation of one :class:`Sandbox` (every call gets a fresh process)."""

    timeout_s: float = 10.0
    """Wall-clock limit per call; on expiry every process of the call is killed."""
    cpu_time_s: float | None = None
    """CPU-time limit per process (``RLIMIT_CPU``; None: ``timeout_s``). Exceeding it kills the
    process with SIGXCPU."""
    memory_bytes: int = 1024 * _MIB
    """Address-space limit per process (``RLIMIT_AS`` and ``RLIMIT_DATA``)."""
    max_processes: int = 16
    """Processes *and threads* the code may have at once, itself included (``RLIMIT_NPROC`` in
    the namespace modes; a budget of forks in ``basic`` mode)."""
    max_output_bytes: int = 16 * 1024
    """Bytes kept of stdout and of stderr each (first part and last part); the rest is counted
    and dropped while it is read, so any amount of output costs bounded memory."""
    kill_output_bytes: int | None = 16 * _MIB
    """Stop the call once stdout + stderr exceed this many bytes (None: read until it exits)."""
    max_file_bytes: int = 16 * _MIB
    """Largest file the code may write (``RLIMIT_FSIZE``)."""
    scratch_bytes: int = 64 * _MIB
    """Size of the scratch tmpfs (``/tmp``) in the namespace modes."""
    shm_bytes: int = 16 * _MIB
    """Size of the call's private ``/dev/shm`` tmpfs in the namespace modes (multiprocessing)."""
    max_open_files: int = 256
    max_code_bytes: int = 1 * _MIB
    """Longer code is not run (the result says so)."""
    concurrency: int = 4
    """Calls running at once per event loop; more wait their turn."""
    isolation: Isolation = "auto"
    """``auto``: the strongest mode that works here; a named mode that cannot be set up raises
    :class:`SandboxUnavailableError` at first use."""
    python: str | None = None
    """Interpreter for the code (None: this one, ``sys.executable``). Its standard library and
    site-packages are what the code can import (``.pth`` files are not processed)."""
    read_only_paths: tuple[str, ...] = ()
    """Extra host paths visible read-only inside the namespace modes (e.g. a data folder)."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment variables; the parent's environment is never passed on."""
    uid_base: int | None = None
    """First uid of the per-call uids when run as root (None: one derived from the pid above
    2e9, unlikely to belong to anyone)."""
    tmp_root: str | None = None
    """Where the per-call directories are created on the host (None: ``tempfile.gettempdir()``)."""

    def __post_init__(self):
        if self.timeout_s <= 0:
            raise ValueError(f"SandboxConfig.timeout_s must be > 0 (got {self.timeout_s})")
        if self.cpu_time_s is not None and self.cpu_time_s <= 0:
            raise ValueError(f"SandboxConfig.cpu_time_s must be > 0 or None (got {self.cpu_time_s})")
        if self.memory_bytes < 32 * _MIB:
            raise ValueError(f"SandboxConfig.memory_bytes must be >= 32 MiB for Python to start "
                             f"(got {self.memory_bytes})")
        if self.max_processes < 1:
            raise ValueError(f"SandboxConfig.max_processes must be >= 1 (got {self.max_processes})")
        if self.max_output_bytes < 256:
            raise ValueError(f"SandboxConfig.max_output_bytes must be >= 256 (got {self.max_output_bytes})")
        if self.kill_output_bytes is not None and self.kill_output_bytes < self.max_output_bytes:
            raise ValueError(
                f"SandboxConfig.kill_output_bytes ({self.kill_output_bytes}) must be >= max_output_bytes "
                f"({self.max_output_bytes}) or None")
        if self.concurrency < 1:
            raise ValueError(f"SandboxConfig.concurrency must be >= 1 (got {self.concurrency})")
        if self.isolation not in ("auto", "namespaces", "userns", "basic"):
            raise ValueError(f"SandboxConfig.isolation must be one of auto, namespaces, userns, basic "
                             f"(got {self.isolation!r})")


@dataclass(frozen=True)
class SandboxResult:
    """What one call did. ``stdout``/``stderr`` are at most ``max_output_bytes`` each (plus a
    marker where the middle was dropped); ``*_bytes`` are the full sizes."""

    stdout: str
    stderr: str
    exit_code: int | None
    """Exit status of the code; negative: killed by that signal; None: it never ran (``error``)."""
    timed_out: bool
    memory_exceeded: bool
    truncated: bool
    """Some of stdout or stderr was dropped."""
    duration: float
    """Seconds from start to the last process of the call gone."""
    cpu_time_exceeded: bool = False
    process_limit_hit: bool = False
    """The code tried to start more processes/threads than ``max_processes``."""
    output_limit_hit: bool = False
    """Stopped because stdout + stderr exceeded ``kill_output_bytes``."""
    error: str | None = None
    """The sandbox itself failed (could not start, code too long); the code did not run."""
    isolation: str = ""
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    time_limit_s: float | None = None
    """The wall-time limit the call ran under."""

    @property
    def ok(self) -> bool:
        """The code ran to completion with exit status 0."""
        return self.exit_code == 0 and not self.timed_out and self.error is None

    @property
    def signal_name(self) -> str | None:
        if self.exit_code is None or self.exit_code >= 0:
            return None
        try:
            return signal.Signals(-self.exit_code).name
        except ValueError:
            return f"signal {-self.exit_code}"


# ---------------------------------------------------------------------------------- per call / wire

PER_CALL_LIMITS: tuple[str, ...] = (
    "timeout_s", "cpu_time_s", "memory_bytes", "max_processes", "max_output_bytes", "kill_output_bytes",
    "max_file_bytes", "max_open_files", "scratch_bytes", "shm_bytes")
"""The :class:`SandboxConfig` fields one call may set (``Sandbox.run(limits=...)``, the service's
``limits``); isolation, interpreter, paths and environment belong to the sandbox."""


def clamp_limits(requested: dict, ceiling: SandboxConfig) -> dict:
    """``requested`` per-call limits, each lowered to ``ceiling``'s value (the service's maxima).
    None (or a missing key) means the ceiling's value. Unknown names or non-numbers raise ValueError."""
    out = {}
    for key, value in requested.items():
        if key not in PER_CALL_LIMITS:
            raise ValueError(f"limit {key!r} cannot be set per call (choose from {', '.join(PER_CALL_LIMITS)})")
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"limit {key!r} must be a number (got {value!r})")
        cap = getattr(ceiling, key)
        if key == "cpu_time_s" and cap is None:
            cap = ceiling.timeout_s
        value = value if cap is None else min(value, cap)
        out[key] = float(value) if key in ("timeout_s", "cpu_time_s") else int(value)
    return out


def result_to_dict(result: SandboxResult) -> dict:
    """JSON-ready fields of ``result`` (the sandbox service's answer)."""
    from dataclasses import asdict

    return asdict(result)


def result_from_dict(data: dict) -> SandboxResult:
    """A :class:`SandboxResult` from :func:`result_to_dict`'s output (unknown keys are ignored, so
    a newer server's extra fields do not break an older client)."""
    from dataclasses import fields

    names = {f.name for f in fields(SandboxResult)}
    missing = {"stdout", "stderr", "exit_code", "timed_out", "memory_exceeded", "truncated", "duration"} - set(data)
    if missing:
        raise ValueError(f"not a sandbox result: missing {sorted(missing)}")
    return SandboxResult(**{k: v for k, v in data.items() if k in names})
