"""The parent side: starts sandboxed interpreters, feeds them the bootstrap and the code, and
collects bounded output and the outcome."""

from __future__ import annotations

import asyncio
import functools
import logging
import marshal
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import replace
from typing import Any, Mapping

from .boot_guards import BOOT_GUARDS
from .boot_main import BOOT_MAIN
from .config import (_BOOT_NAME, _EXIT_INIT, _EXIT_SETUP, _LOADER, _MARKER, PER_CALL_LIMITS, SandboxConfig,
                     SandboxResult, SandboxUnavailableError)

# --------------------------------------------------------------------------------------------
# The bootstrap: runs in the sandbox's interpreter (``python -I -S``), reads its config and the
# code from stdin, sets up the isolation, then runs the code. It is sent over stdin rather than
# on the command line so ``ps`` stays readable. Only builtin modules are imported before the
# code runs (startup time is the cost of every call).
# --------------------------------------------------------------------------------------------
_BOOT = BOOT_GUARDS + BOOT_MAIN

logger = logging.getLogger("rlhforge.agents.sandbox")



# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------
class _Capture:
    """Keeps the first and the last bytes of a stream, counts the rest (bounded memory)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.tail_keep = min(limit // 4, 4096)
        self.head = bytearray()
        self.overflow = bytearray()
        self.total = 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.limit - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.overflow += chunk
            if len(self.overflow) > 2 * self.tail_keep:
                del self.overflow[: len(self.overflow) - self.tail_keep]

    @property
    def truncated(self) -> bool:
        return self.total > self.limit

    def text(self) -> str:
        if not self.truncated:
            return self.head.decode("utf-8", "replace")
        keep_head = self.limit - self.tail_keep
        if self.total - self.limit <= len(self.overflow):
            data = bytes(self.head) + bytes(self.overflow)
            tail = data[len(data) - self.tail_keep:]
        else:
            tail = bytes(self.overflow[-self.tail_keep:])
        omitted = self.total - keep_head - len(tail)
        return (self.head[:keep_head].decode("utf-8", "replace")
                + f"\n... [{omitted} bytes omitted] ...\n" + tail.decode("utf-8", "replace"))


class _LoopState:
    def __init__(self, concurrency: int):
        self.semaphore = asyncio.Semaphore(concurrency)
        self.probe_lock = asyncio.Lock()


_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_BASE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
    "MPLBACKEND": "Agg",
}


class Sandbox:
    """Runs code in confined processes; see the module docstring. Safe to share between
    coroutines and between event loops (each loop gets its own concurrency limit)."""

    def __init__(self, config: SandboxConfig | None = None, **overrides):
        if config is None:
            config = SandboxConfig(**overrides)
        elif overrides:
            config = replace(config, **overrides)
        self.config = config
        self.python = config.python or sys.executable
        self._mode: str | None = None
        self._layers: str = ""
        self._loops: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._slots: set[int] = set()
        self._slot_lock = threading.Lock()
        base = config.uid_base if config.uid_base is not None else 2_000_000_000 + (os.getpid() % 1_000_000) * 256
        self._uid_base = base
        same_python = os.path.realpath(self.python) == os.path.realpath(sys.executable)
        self._boot_payload = (b"m" + _frame(_compiled_boot()) if same_python
                              else b"s" + _frame(_BOOT.encode()))

    # ---- public -------------------------------------------------------------------------
    @property
    def isolation(self) -> str | None:
        """The mode in use (None until the first call or :meth:`start`)."""
        return self._mode

    @property
    def layers(self) -> str:
        """The isolation layers the last probe reported (comma-separated)."""
        return self._layers

    async def start(self) -> str:
        """Pick the isolation mode now (otherwise done by the first call); returns it."""
        await self._ensure_mode(self._state())
        return self._mode

    async def run(self, code: str, *, timeout_s: float | None = None,
                  limits: Mapping[str, Any] | None = None) -> SandboxResult:
        """Run ``code`` as a fresh ``__main__`` module; never raises for what the code does.

        ``limits``: this call's values of some of :data:`PER_CALL_LIMITS` (``memory_bytes``,
        ``max_output_bytes``...) instead of the config's; an invalid combination raises ValueError."""
        if not isinstance(code, str):
            raise TypeError(f"Sandbox.run(code): code must be str, got {type(code).__name__}")
        cfg = self.config
        if limits:
            unknown = sorted(set(limits) - set(PER_CALL_LIMITS))
            if unknown:
                raise ValueError(f"Sandbox.run(limits=...): {unknown} cannot be set per call "
                                 f"(choose from {', '.join(PER_CALL_LIMITS)})")
            cfg = replace(cfg, **limits)  # SandboxConfig validates the values
        state = self._state()
        await self._ensure_mode(state)
        data = code.encode("utf-8", "surrogatepass")
        if len(data) > cfg.max_code_bytes:
            return self._error_result(f"code is {len(data)} bytes; the sandbox runs at most "
                                      f"{cfg.max_code_bytes} bytes", 0.0)
        async with state.semaphore:
            return await self._run_once(data, self._mode, timeout_s or cfg.timeout_s, cfg)

    def run_sync(self, code: str, *, timeout_s: float | None = None,
                 limits: Mapping[str, Any] | None = None) -> SandboxResult:
        """:meth:`run` for code without an event loop (do not call from inside one)."""
        return asyncio.run(self.run(code, timeout_s=timeout_s, limits=limits))

    # ---- mode selection -------------------------------------------------------------------
    def _state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        state = self._loops.get(loop)
        if state is None:
            state = self._loops[loop] = _LoopState(self.config.concurrency)
        return state

    async def _ensure_mode(self, state: _LoopState) -> None:
        if self._mode is not None:
            return
        async with state.probe_lock:
            if self._mode is not None:
                return
            wanted = self.config.isolation
            if wanted == "auto":
                if not sys.platform.startswith("linux"):
                    candidates = ["basic"]
                elif os.geteuid() == 0:
                    # root inside a container's user namespace may lack the uids "namespaces" uses
                    candidates = ["namespaces"] + ([] if _real_root() else ["userns"]) + ["basic"]
                else:
                    candidates = ["userns", "basic"]
            else:
                candidates = [wanted]
                if wanted == "userns" and _real_root():
                    raise SandboxUnavailableError(
                        "sandbox isolation 'userns' does not limit processes when run by the real root "
                        "(the kernel exempts uid 0 from RLIMIT_NPROC); use 'namespaces' or 'auto'")
            failures = []
            for mode in candidates:
                result = await self._run_once(b"print('ok')", mode, max(10.0, self.config.timeout_s))
                if result.ok and result.stdout == "ok\n":
                    self._mode, self._layers = mode, self._probe_layers
                    if failures:
                        logger.warning("sandbox: using isolation %r; stronger modes failed here: %s", mode,
                                       "; ".join(failures))
                    else:
                        logger.info("sandbox: isolation %r (%s)", mode, self._layers)
                    return
                failures.append(f"{mode}: {result.error or result.stderr.strip() or result.exit_code}")
            raise SandboxUnavailableError(f"sandbox isolation {wanted!r} is not available here: " + "; ".join(failures))

    _probe_layers = ""

    # ---- one call ----------------------------------------------------------------------------
    def _take_slot(self) -> int:
        with self._slot_lock:
            slot = 0
            while slot in self._slots:
                slot += 1
            self._slots.add(slot)
            return slot

    def _release_slot(self, slot: int) -> None:
        with self._slot_lock:
            self._slots.discard(slot)

    def _error_result(self, message: str, duration: float) -> SandboxResult:
        return SandboxResult(stdout="", stderr="", exit_code=None, timed_out=False, memory_exceeded=False,
                             truncated=False, duration=duration, error=message, isolation=self._mode or "")

    async def _run_once(self, code: bytes, mode: str, timeout_s: float,
                        cfg: SandboxConfig | None = None) -> SandboxResult:
        cfg = cfg or self.config
        start = time.monotonic()
        slot = self._take_slot()
        status_r = status_w = -1
        workdir = None
        proc = call = None
        try:
            workdir = tempfile.mkdtemp(prefix=f"{_MARKER}-", dir=cfg.tmp_root)
            os.chmod(workdir, 0o700)
            status_r, status_w = os.pipe()
            os.set_blocking(status_r, False)
            boot_cfg = {
                "mode": mode,
                "status_fd": status_w,
                "root_dir": workdir,
                "uid": (self._uid_base + slot % 256) & 0xFFFFFFFF,
                "memory_bytes": int(cfg.memory_bytes),
                "cpu_seconds": int(math.ceil(cfg.cpu_time_s if cfg.cpu_time_s is not None else timeout_s)),
                "max_file_bytes": int(cfg.max_file_bytes),
                "max_open_files": int(cfg.max_open_files),
                "max_processes": int(cfg.max_processes),
                "scratch_bytes": int(cfg.scratch_bytes),
                "shm_bytes": int(cfg.shm_bytes),
                "system_paths": list(_SYSTEM_PATHS),
                "read_only_paths": [os.path.abspath(p) for p in cfg.read_only_paths],
            }
            env = dict(_BASE_ENV)
            home = "/tmp" if mode != "basic" else workdir
            env.update(HOME=home, TMPDIR=home, USER="sandbox", LOGNAME="sandbox")
            env.update(dict(cfg.env))
            payload = self._boot_payload + _frame(marshal.dumps(boot_cfg, 4)) + _frame(code)
            try:
                proc = await asyncio.create_subprocess_exec(
                    self.python, "-I", "-S", "-c", _LOADER,
                    stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                    pass_fds=(status_w,), start_new_session=True, env=env,
                    cwd=workdir if mode == "basic" else "/")
            except OSError as err:
                return self._error_result(f"could not start {self.python}: {err}", time.monotonic() - start)
            finally:
                os.close(status_w)
                status_w = -1
            call = _Call(proc, status_r, mode)
            return await self._supervise(call, payload, timeout_s, start, cfg)
        except BaseException:  # cancelled (or a bug): kill the call and reap it before passing it on
            if proc is not None:
                try:
                    await asyncio.shield((call or _Call(proc, status_r, mode)).stop())
                except BaseException:  # noqa: BLE001
                    pass
            raise
        finally:
            for fd in (status_r, status_w):
                if fd >= 0:
                    os.close(fd)
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)
            self._release_slot(slot)

    async def _supervise(self, call: "_Call", payload: bytes, timeout_s: float, start: float,
                         cfg: SandboxConfig) -> SandboxResult:
        proc, mode = call.proc, call.mode
        out, err = _Capture(cfg.max_output_bytes), _Capture(cfg.max_output_bytes)
        flood = {"hit": False}

        async def pump(stream, cap):
            while True:
                chunk = await stream.read(65536)
                if not chunk:
                    return
                cap.feed(chunk)
                if (cfg.kill_output_bytes is not None and not flood["hit"]
                        and out.total + err.total > cfg.kill_output_bytes):
                    flood["hit"] = True
                    call.kill()

        async def feed_stdin():
            try:
                proc.stdin.write(payload)
                await proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError):
                pass
            finally:
                try:
                    proc.stdin.close()
                except Exception:  # noqa: BLE001
                    pass

        tasks = [asyncio.ensure_future(pump(proc.stdout, out)), asyncio.ensure_future(pump(proc.stderr, err)),
                 asyncio.ensure_future(feed_stdin())]
        timed_out = False
        try:
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except asyncio.TimeoutError:
                timed_out = True
                await call.stop()
            if mode == "basic":  # stragglers that kept the process group (the namespace modes have none)
                _kill_group(proc.pid)
            await asyncio.wait(tasks, timeout=2.0)
        finally:  # also on cancellation of the caller: nothing of the call may survive it
            if proc.returncode is None:
                call.kill()
            for task in tasks:
                if not task.done():
                    task.cancel()
                elif not task.cancelled() and task.exception() is not None:
                    logger.debug("sandbox stream task failed: %r", task.exception())
        duration = time.monotonic() - start

        notes = call.notes()
        exit_code = proc.returncode
        if "X" in notes:
            try:
                exit_code = int(notes["X"][-1])
            except ValueError:
                pass
        if "L" in notes:
            self._probe_layers = notes["L"][-1]
        error = None
        if "E" in notes:
            error = f"sandbox setup failed ({mode}): {notes['E'][-1]}"
            exit_code = None
            logger.warning("%s", error)
        elif exit_code == _EXIT_SETUP and not notes.get("L"):
            error = f"sandbox setup failed ({mode}) with exit status {exit_code}: {err.text()[-500:]}"
            exit_code = None
        if timed_out or flood["hit"]:
            # the process group was killed by us: report the kill, not the exit status of init
            exit_code = -signal.SIGKILL if exit_code is None or exit_code >= 0 or exit_code == _EXIT_INIT else exit_code
        return SandboxResult(
            stdout=out.text(),
            stderr=err.text(),
            exit_code=exit_code,
            timed_out=timed_out,
            memory_exceeded="M" in notes,
            truncated=out.truncated or err.truncated,
            duration=duration,
            cpu_time_exceeded=exit_code == -signal.SIGXCPU,
            process_limit_hit="P" in notes,
            output_limit_hit=flood["hit"],
            error=error,
            isolation=mode,
            stdout_bytes=out.total,
            stderr_bytes=err.total,
            time_limit_s=timeout_s,
        )


def _real_root() -> bool:
    """Root of the initial user namespace (exempt from RLIMIT_NPROC even inside a new one)."""
    if os.geteuid() != 0:
        return False
    try:
        with open("/proc/self/uid_map") as f:
            return f.read().split() == ["0", "0", "4294967295"]
    except OSError:
        return True


@functools.lru_cache(maxsize=1)
def _compiled_boot() -> bytes:
    return marshal.dumps(compile(_BOOT, _BOOT_NAME, "exec"))


def _frame(data: bytes) -> bytes:
    return b"%d\n" % len(data) + data


class _Call:
    """One running sandbox process tree, and how to stop it.

    In the namespace modes the outer process (the one we started) waits for the namespace's
    init, and init's exit makes the kernel kill and reap every process of the namespace before
    the outer process is told. So killing *init* (its host pid is on the status pipe) and then
    waiting for the outer process means that when ``stop()`` returns, nothing of the call is left.
    Without namespaces (or before init exists) the process group is killed.
    """

    def __init__(self, proc, status_fd: int, mode: str):
        self.proc, self.status_fd, self.mode = proc, status_fd, mode
        self._data = bytearray()

    def notes(self) -> dict[str, list[str]]:
        """Status lines received so far, by tag (reads what is available; never blocks)."""
        while len(self._data) < 65536:
            try:
                chunk = os.read(self.status_fd, 65536)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            self._data += chunk
        notes: dict[str, list[str]] = {}
        for line in self._data.decode("utf-8", "replace").splitlines():
            if line:
                notes.setdefault(line[0], []).append(line[1:])
        return notes

    def kill(self) -> None:
        if self.mode != "basic" and self.proc.returncode is None:
            init = self.notes().get("I")
            if init:
                try:
                    os.kill(int(init[-1]), signal.SIGKILL)  # still our (unreaped) grandchild: pid valid
                    return
                except (ProcessLookupError, ValueError):
                    pass
        _kill_group(self.proc.pid)

    async def stop(self) -> None:
        """Kill the call and wait until its processes are gone (the group as a fallback)."""
        if self.proc.returncode is None:
            self.kill()
            try:
                await asyncio.wait_for(self.proc.wait(), 5.0)
                return
            except asyncio.TimeoutError:
                pass
        _kill_group(self.proc.pid)
        await self.proc.wait()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
