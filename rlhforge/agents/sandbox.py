"""Run model-written Python in a separate, confined process (the tool of tool-integrated reasoning).

::

    sandbox = Sandbox(SandboxConfig(timeout_s=5, memory_bytes=512 << 20, concurrency=8))
    result = await sandbox.run("print(2 ** 10)")
    result.stdout                    # '1024\\n'
    format_feedback(result)          # text to append to the conversation for the model

``run()`` never raises for anything the code does (crash, hang, memory hog, fork bomb, output
flood, network or file access): every outcome is a :class:`SandboxResult`. It only raises for
mistakes of the caller (``code`` not a ``str``; an isolation mode that was explicitly asked for
but cannot be set up on this machine).

Isolation, strongest mode first (``SandboxConfig.isolation="auto"`` picks the first that works
and says which in :attr:`Sandbox.isolation` / :attr:`SandboxResult.isolation`; details and the
exact guarantees are in ``docs/sandbox.md``):

``namespaces`` (Linux, run as root)
    Fresh PID, network, mount, IPC and UTS namespaces. The process sees a new read-only root
    built from bind mounts of the system directories (``/usr``, ``/etc``, ``/lib*``...) and of
    the interpreter's prefixes only; ``/tmp`` is a size-limited tmpfs that is also the working
    directory and, with a small private ``/dev/shm``, the only writable place; both disappear
    with the call. The code runs as an otherwise unused uid (one per concurrent call) with
    ``no_new_privs``, all capabilities dropped and resource limits (``RLIMIT_AS``/``RLIMIT_DATA``
    memory, ``RLIMIT_CPU``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``, ``RLIMIT_NPROC`` - which the
    kernel enforces for a non-root uid). The network namespace has no interface but a down loopback, so every
    connection fails. When the call ends or times out the PID namespace is torn down, which
    kills every process the code started, daemonised or not.
``userns`` (Linux, not root, unprivileged user namespaces allowed)
    The same, inside a new user namespace (the code is "root" of that namespace with every
    capability dropped); ``RLIMIT_NPROC`` is counted per user namespace, so it bounds this
    call's processes only.
``basic`` (anything else, or on request)
    Resource limits plus in-process interposition (Python audit hooks and wrappers installed
    before the code runs) that refuse sockets, writes outside the scratch directory, running
    other programs, ``ctypes`` calls and signals to processes outside the call, with a budget
    of forks. Interposition is best effort: it stops ordinary model-written code, not a
    determined attacker with a C extension.

Helpers: :func:`format_feedback` (result -> concise text for the model) and
:func:`extract_code_blocks` (```` ```python ```` fenced blocks of a completion).
"""

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
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "Sandbox",
    "SandboxConfig",
    "SandboxResult",
    "SandboxUnavailableError",
    "format_feedback",
    "extract_code_blocks",
]

logger = logging.getLogger(__name__)

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


# --------------------------------------------------------------------------------------------
# The bootstrap: runs in the sandbox's interpreter (``python -I -S``), reads its config and the
# code from stdin, sets up the isolation, then runs the code. It is sent over stdin rather than
# on the command line so ``ps`` stays readable. Only builtin modules are imported before the
# code runs (startup time is the cost of every call).
# --------------------------------------------------------------------------------------------
_BOOT = r'''
import os, sys, marshal

_SENT = set()
_CODE_NAME = "main.py"


def _note(tag, text=""):
    """One line on the status pipe to the parent (never blocks, never raises)."""
    if tag in ("M", "P"):
        if tag in _SENT:
            return
        _SENT.add(tag)
    try:
        os.write(_ST, (tag + str(text).replace("\n", " ")[:400] + "\n").encode("utf-8", "replace"))
    except Exception:
        pass


def _site_setup():
    """What ``site`` would add for a venv, without processing .pth files (-S is much faster)."""
    exe_dir = os.path.dirname(os.path.abspath(sys.executable))
    venv = None
    for cand in (exe_dir, os.path.dirname(exe_dir)):
        if os.path.isfile(os.path.join(cand, "pyvenv.cfg")):
            venv = os.path.dirname(exe_dir)
            cfg_path = os.path.join(cand, "pyvenv.cfg")
            break
    ver = "python%d.%d" % sys.version_info[:2]
    libdirs = [sys.platlibdir] + (["lib"] if sys.platlibdir != "lib" else [])
    prefixes = []
    if venv is not None:
        prefixes.append(venv)
        system = False
        try:
            for line in open(cfg_path, encoding="utf-8"):
                key, _, value = line.partition("=")
                if key.strip().lower() == "include-system-site-packages":
                    system = value.strip().lower() == "true"
        except OSError:
            pass
        if system:
            prefixes.append(sys.base_prefix)
    else:
        prefixes.append(sys.base_prefix)
    for prefix in prefixes:
        for lib in libdirs:
            path = os.path.join(prefix, lib, ver, "site-packages")
            if os.path.isdir(path) and path not in sys.path:
                sys.path.append(path)
    if venv is not None:
        sys.prefix = sys.exec_prefix = venv
    return venv


def _set_limits(cfg, nproc):
    import resource
    done = []

    def lim(name, soft, hard=None):
        res = getattr(resource, name, None)
        if res is None or soft is None:
            return
        hard = soft if hard is None else hard
        cur_soft, cur_hard = resource.getrlimit(res)
        if cur_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, cur_hard), min(hard, cur_hard)
        resource.setrlimit(res, (soft, hard))
        done.append(name[7:].lower())

    mem = cfg["memory_bytes"]
    lim("RLIMIT_AS", mem)
    lim("RLIMIT_DATA", mem)
    lim("RLIMIT_CPU", cfg["cpu_seconds"], cfg["cpu_seconds"] + 1)
    lim("RLIMIT_FSIZE", cfg["max_file_bytes"])
    lim("RLIMIT_NOFILE", cfg["max_open_files"])
    lim("RLIMIT_CORE", 0)
    lim("RLIMIT_MEMLOCK", 0)
    if nproc is not None:
        lim("RLIMIT_NPROC", nproc)
    return "rlimit(" + ",".join(done) + ")"


def _user_tasks(uid):
    """Tasks (threads) this uid has now: what RLIMIT_NPROC counts outside a namespace."""
    n = 0
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat("/proc/" + name).st_uid != uid:
                continue
            with open("/proc/" + name + "/stat", "rb") as f:
                stat = f.read()
            n += int(stat[stat.rindex(b")") + 2:].split()[17])
        except (OSError, ValueError, IndexError):
            continue
    return n


def _report_spawn_failures():
    """Wrap process/thread creation so that hitting the process limit is reported."""
    import errno
    import _thread

    def wrap(fn):
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except OSError as err:
                if err.errno == errno.EAGAIN:
                    _note("P")
                raise
        wrapper.__name__ = getattr(fn, "__name__", "wrapper")
        wrapper.__doc__ = getattr(fn, "__doc__", None)
        return wrapper

    import posix
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            wrapped = wrap(getattr(os, name))
            setattr(os, name, wrapped)
            setattr(posix, name, wrapped)
    try:
        import _posixsubprocess
        _posixsubprocess.fork_exec = wrap(_posixsubprocess.fork_exec)
    except ImportError:
        pass
    start = _thread.start_new_thread

    def start_new_thread(*args, **kwargs):
        try:
            return start(*args, **kwargs)
        except RuntimeError as err:
            if "can't start new thread" in str(err):
                _note("P")
            raise
    _thread.start_new_thread = _thread.start_new = start_new_thread
    if "threading" in sys.modules:
        sys.modules["threading"]._start_new_thread = start_new_thread


def _basic_guards(scratch, budget_fd):
    """Interposition for ``basic`` mode: audit hooks + wrappers (best effort, see the docs)."""
    import errno
    real = os.path.realpath
    scratch = real(scratch)
    sid = os.getsid(0)
    WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    ALLOWED_WRITE = ("/dev/null", "/dev/stdout", "/dev/stderr")

    def resolve(path, dir_fd=None):
        if isinstance(path, int):
            return None
        path = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(path):
            path = os.path.join(os.readlink("/proc/self/fd/%d" % dir_fd), path)
        return real(path)

    def inside(path, dir_fd=None):
        if isinstance(path, int):
            return True
        if os.fsdecode(path) in ALLOWED_WRITE:
            return True
        p = resolve(path, dir_fd)
        return p == scratch or p.startswith(scratch + os.sep)

    def deny(what):
        raise PermissionError(13, "sandbox: %s is not allowed" % what)

    def check_write(path, dir_fd=None):
        if not inside(path, dir_fd):
            deny("writing %s (only the working directory is writable)" % os.fsdecode(path))

    def check_read(path):
        if isinstance(path, int):
            return
        p = resolve(path)
        if p.startswith("/proc/"):
            part = p.split("/")[2]
            if part.isdigit() and int(part) != os.getpid():
                deny("reading other processes' /proc entries")

    path_events = {  # event -> indices of written paths, index of dir_fd (or None)
        "os.remove": ((0,), 1), "os.rmdir": ((0,), 1), "os.mkdir": ((0,), 2), "os.chmod": ((0,), 2),
        "os.chown": ((0,), 3), "os.utime": ((0,), 3), "os.truncate": ((0,), None),
        "os.setxattr": ((0,), None), "os.removexattr": ((0,), None), "os.chflags": ((0,), None),
        "os.lchflags": ((0,), None), "os.lchmod": ((0,), None), "os.symlink": ((1,), 2),
        "os.link": ((1,), 3),
    }
    refused = ("os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen", "os.startfile",
               "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.call_function", "ctypes.cdata",
               "socket.connect", "socket.bind",
               "socket.sendto", "socket.sendmsg", "socket.getaddrinfo", "socket.gethostbyname",
               "socket.gethostbyaddr", "socket.gethostbyname_ex", "sys._debugmallocstats")

    def hook(event, args):
        if event == "open":
            path, mode, flags = args[0], args[1], args[2]
            writes = (isinstance(flags, int) and flags & WRITE) or (
                isinstance(mode, str) and any(c in mode for c in "wax+"))
            if writes:
                check_write(path)
            else:
                check_read(path)
        elif event == "os.rename":  # also os.replace: (src, dst, src_dir_fd, dst_dir_fd)
            check_write(args[0], args[2] if isinstance(args[2], int) else None)
            check_write(args[1], args[3] if isinstance(args[3], int) else None)
        elif event in path_events:
            idx, dfd = path_events[event]
            dir_fd = args[dfd] if dfd is not None and dfd < len(args) else None
            for i in idx:
                check_write(args[i], dir_fd if isinstance(dir_fd, int) else None)
        elif event == "socket.__new__":
            if args[1] != 1:  # AF_UNIX (socketpair; connect/bind/send are refused below)
                deny("network access")
        elif event in refused:
            if event.startswith("socket."):
                deny("network access")
            if event.startswith("ctypes."):
                deny("calling C functions or reading raw memory through ctypes")
            deny("running other programs")
        elif event in ("os.fork", "os.forkpty"):
            try:  # one token of the budget pipe per fork; the pipe is shared with the children
                ok = os.read(budget_fd, 1)
            except BlockingIOError:
                ok = b""
            if not ok:
                _note("P")
                raise BlockingIOError(errno.EAGAIN, "process limit of the sandbox reached")
        elif event in ("os.kill", "os.killpg", "signal.pthread_kill"):
            pid = args[0]
            if event == "signal.pthread_kill":
                return
            if event == "os.killpg":
                if pid not in (0, os.getpgrp()):
                    deny("signalling processes outside the sandbox")
                return
            if pid in (0, os.getpid(), -os.getpgrp()):
                return
            try:
                ok = pid > 0 and os.getsid(pid) == sid
            except OSError:
                ok = True  # no such process: let the call fail by itself
            if not ok:
                deny("signalling processes outside the sandbox")

    sys.addaudithook(hook)

    real_open = os.open

    def guarded_open(path, flags, mode=0o777, *, dir_fd=None):
        if dir_fd is not None:
            if flags & WRITE:
                check_write(path, dir_fd)
        return real_open(path, flags, mode, dir_fd=dir_fd)
    import posix
    os.open = posix.open = guarded_open  # the "open" audit event does not carry dir_fd
    for name in ("mkfifo", "mknod"):
        fn = getattr(os, name, None)
        if fn is not None:
            def make(fn=fn, name=name):
                def guarded(path, *a, dir_fd=None, **k):
                    check_write(path, dir_fd)
                    return fn(path, *a, dir_fd=dir_fd, **k)
                return guarded
            setattr(os, name, make())
    for name in ("setsid", "setpgid", "setpgrp"):
        if hasattr(os, name):
            def refuse(*a, name=name, **k):
                deny("os.%s (leaving the sandbox's process group)" % name)
            setattr(os, name, refuse)
    _report_spawn_failures()
    return "audit-hooks(files,network,exec,ctypes,signals),fork-budget"


def _drop_capabilities(libc):
    import ctypes
    PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 28, 47, 4
    for cap in range(64):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL past the last cap: ignored
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    # NOROOT(+locked), NO_SETUID_FIXUP(+locked), KEEP_CAPS locked off, NO_CAP_AMBIENT_RAISE(+locked)
    libc.prctl(PR_SET_SECUREBITS, 0xEF, 0, 0, 0)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    hdr, data = Header(0x20080522, 0), (Data * 2)()
    _check(libc, libc.capset(ctypes.byref(hdr), data), "capset")
    hdr, data = Header(0x20080522, 0), (Data * 2)()
    _check(libc, libc.capget(ctypes.byref(hdr), data), "capget")
    if any(d.effective or d.permitted for d in data):
        raise OSError("capabilities are still held after dropping them")


def _check(libc, ret, what):
    if ret != 0:
        import ctypes
        err = ctypes.get_errno()
        raise OSError(err, "%s: %s" % (what, os.strerror(err)))


def _mount(libc, src, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(libc, libc.mount(enc(src), enc(target), enc(fstype), flags, enc(data)),
           "mount %s on %s" % (src or fstype or "", target))


MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21


def _readonly_tree(libc, root):
    """Make every mount under root read-only, nosuid, nodev (mount_setattr, or one by one)."""
    import ctypes

    class MountAttr(ctypes.Structure):
        _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                    ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]

    attr = MountAttr(0x1 | 0x2 | 0x4, 0, 0, 0)  # MOUNT_ATTR_RDONLY | NOSUID | NODEV
    libc.syscall.restype = ctypes.c_long
    ret = libc.syscall(ctypes.c_long(442), ctypes.c_int(-100), ctypes.c_char_p(root.encode()),
                       ctypes.c_uint(0x8000), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
    if ret == 0:
        return
    mounts = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            point = parts[4].encode().decode("unicode_escape")
            if point == root or point.startswith(root + "/"):
                mounts.append((point, parts[5].split(",")))
    for point, opts in mounts:
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
        for opt, bit in (("noexec", MS_NOEXEC), ("noatime", MS_NOATIME), ("nodiratime", MS_NODIRATIME),
                         ("relatime", MS_RELATIME)):
            if opt in opts:
                flags |= bit
        _mount(libc, None, point, None, flags)


def _make_root(libc, cfg, scratch_uid, scratch_gid):
    """In the new mount namespace: build the read-only root and switch into it."""
    root = cfg["root_dir"]
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    _mount(libc, "tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=0755")
    for d in ("dev", "proc", "tmp"):
        os.mkdir(root + "/" + d, 0o755)
    # the scratch first, so that read-only paths under /tmp are mounted on top of it, not hidden
    _mount(libc, "tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
           "size=%d,mode=0700,uid=%d,gid=%d" % (cfg["scratch_bytes"], scratch_uid, scratch_gid))
    bound = []

    def under_bound(p):
        return any(p == b or p.startswith(b + "/") for b in bound)

    def mkdirs(p):  # p absolute host path; create root + p as plain dirs, refusing to leave root
        cur = root
        for part in p.strip("/").split("/")[:-1]:
            cur = cur + "/" + part
            if os.path.islink(cur) or under_bound(cur[len(root):]):
                return False
            if not os.path.isdir(cur):
                os.mkdir(cur, 0o755)
        return True

    queue = sorted(set(os.path.abspath(p) for p in list(cfg["system_paths"]) + list(cfg["python_paths"])
                       + list(cfg["read_only_paths"])), key=len)
    seen = set()
    while queue:
        p = os.path.abspath(queue.pop(0))
        if p in seen or p == "/" or not os.path.lexists(p):
            continue
        seen.add(p)
        if under_bound(p) or not mkdirs(p):
            continue
        dst = root + p
        if os.path.islink(p):
            if not os.path.lexists(dst):
                os.symlink(os.readlink(p), dst)
            queue.append(os.path.realpath(p))
            continue
        if os.path.isdir(p):
            if not os.path.isdir(dst):
                os.mkdir(dst, 0o755)
        elif not os.path.exists(dst):
            os.close(os.open(dst, os.O_CREAT | os.O_WRONLY, 0o644))
        _mount(libc, p, dst, None, MS_BIND | MS_REC)
        bound.append(p)
    _readonly_tree(libc, root)
    _mount(libc, None, root + "/tmp", None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV)  # writable again

    dev = root + "/dev"
    _mount(libc, "tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for name in ("null", "zero", "full", "random", "urandom"):
        if os.path.exists("/dev/" + name):
            os.close(os.open(dev + "/" + name, os.O_CREAT | os.O_WRONLY, 0o666))
            _mount(libc, "/dev/" + name, dev + "/" + name, None, MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, dev + "/" + name)
    os.mkdir(dev + "/shm", 0o755)  # private POSIX shared memory (multiprocessing's semaphores)
    _mount(libc, "tmpfs", dev + "/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
           "size=%d,mode=1777" % cfg["shm_bytes"])
    _mount(libc, None, dev, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NOEXEC)
    layers = []
    try:
        _mount(libc, "proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
    except OSError:
        layers.append("no-/proc")  # e.g. a user namespace inside a container: go without

    os.chdir(root)
    nr = {"x86_64": 155, "aarch64": 41, "arm64": 41, "riscv64": 41, "ppc64le": 203, "ppc64": 203,
          "s390x": 217}.get(os.uname().machine)
    if nr is not None:
        import ctypes
        libc.syscall.restype = ctypes.c_long
        _check(libc, libc.syscall(ctypes.c_long(nr), b".", b"."), "pivot_root")
        _check(libc, libc.umount2(b".", 2), "umount old root")  # MNT_DETACH
    else:
        os.chroot(".")
        layers.append("chroot")
    os.chdir("/")
    return layers


def _run_code(code, cfg):
    """Run the code in this process; never returns."""
    import builtins
    reserve = bytes(4 << 20)  # noqa: F841 - freed on MemoryError to print the traceback (calloc: untouched)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.reconfigure(encoding="utf-8", errors="backslashreplace", line_buffering=True)
        except Exception:
            pass
    sys.argv = [_CODE_NAME]
    sys.path.insert(0, os.getcwd())
    g = {"__name__": "__main__", "__builtins__": builtins, "__file__": _CODE_NAME, "__doc__": None}
    rc = 0
    try:
        exec(compile(code, _CODE_NAME, "exec"), g)
    except SystemExit as e:
        if e.code is None:
            rc = 0
        elif isinstance(e.code, int):
            rc = e.code
        else:
            try:
                print(e.code, file=sys.stderr)
            except Exception:
                pass
            rc = 1
    except BaseException as e:
        if isinstance(e, MemoryError):
            del reserve
            _note("M")
        _print_exception(e, code)
        rc = 1
    _finish(rc)


def _print_exception(e, code):
    try:
        import linecache
        import traceback
        text = code.decode("utf-8", "replace")
        linecache.cache[_CODE_NAME] = (len(text), None, text.splitlines(True), _CODE_NAME)
        te = traceback.TracebackException(type(e), e, e.__traceback__, compact=True)
        seen = set()

        def strip(t):  # drop the sandbox's own frames (bootstrap, audit hooks) everywhere
            if t is None or id(t) in seen:
                return
            seen.add(id(t))
            t.stack[:] = [f for f in t.stack if not f.filename.startswith("<rlhforge-sandbox")]
            strip(t.__cause__)
            strip(t.__context__)
            for sub in getattr(t, "exceptions", None) or ():
                strip(sub)
        strip(te)
        sys.stderr.write("".join(te.format()))
    except BaseException:
        try:
            os.write(2, ("%s: %s\n" % (type(e).__name__, e)).encode("utf-8", "replace"))
        except BaseException:
            os.write(2, b"error\n")


def _finish(rc):
    try:
        if "threading" in sys.modules:
            import threading
            for t in threading.enumerate():
                if t is not threading.current_thread() and not t.daemon:
                    t.join()
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(rc & 0xFF)


def _namespaced(cfg, code, userns):
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
    CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x20000, 0x4000000, 0x8000000
    CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    if userns:
        flags |= CLONE_NEWUSER
    _check(libc, libc.unshare(flags), "unshare")
    if userns:
        for name, text in (("setgroups", "deny"), ("uid_map", "0 %d 1" % uid), ("gid_map", "0 %d 1" % gid)):
            with open("/proc/self/" + name, "w") as f:
                f.write(text)
    init = os.fork()
    if init:  # outside the namespaces: wait for the namespace's init, pass its status on
        _note("I", init)  # the parent stops the call by killing init (see _Call in the parent)
        _, status = os.waitpid(init, 0)
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF if os.WIFEXITED(status) else _EXIT_INIT)
    # PID 1 of the new namespace: build the filesystem, start the worker, reap, exit with it
    libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
    run_uid, run_gid = (0, 0) if userns else (cfg["uid"], cfg["uid"])
    layers = _make_root(libc, cfg, run_uid, run_gid)
    libc.sethostname(b"sandbox", 7)
    worker = os.fork()
    if worker == 0:
        libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
        os.chdir("/tmp")
        # RLIMIT_NPROC counts per (user namespace, uid): with a user namespace the outer process
        # and init count too; as root they stay root and the code's own uid counts only itself
        limits = _set_limits(cfg, cfg["max_processes"] + (2 if userns else 0))
        if userns:
            _drop_capabilities(libc)
            who = "user-namespace(uid 0 -> %d),capabilities-dropped" % uid
        else:
            PR_CAPBSET_DROP = 24
            for cap in range(64):
                libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
            os.setgroups([])
            os.setresgid(run_gid, run_gid, run_gid)
            os.setresuid(run_uid, run_uid, run_uid)
            who = "uid %d" % run_uid
        _check(libc, libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        _note("L", ",".join(["pid-namespace", "network-namespace",
                             "mount-namespace(read-only root,tmpfs /tmp+/dev/shm)", "ipc+uts-namespace", who,
                             "no-new-privs", limits] + layers))
        _report_spawn_failures()
        _run_code(code, cfg)
    status = None
    while True:
        try:
            pid, st = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid == worker:
            status = st
            break
    if status is None:
        os._exit(_EXIT_INIT)
    _note("X", os.waitstatus_to_exitcode(status))
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF if os.WIFEXITED(status) else _EXIT_INIT)


def _basic(cfg, code):
    os.chdir(cfg["root_dir"])
    nproc = None
    if sys.platform.startswith("linux") and os.getuid() != 0:
        nproc = _user_tasks(os.getuid()) + cfg["max_processes"]
    limits = _set_limits(cfg, nproc)
    r, w = os.pipe()
    os.write(w, b"x" * max(0, cfg["max_processes"] - 1))
    os.close(w)
    os.set_blocking(r, False)
    os.set_inheritable(r, False)
    guards = _basic_guards(cfg["root_dir"], r)
    _note("L", ",".join(["process-group", limits, guards]))
    _run_code(code, cfg)


_EXIT_INIT = 126

def _main():
    global _ST
    inp = sys.stdin.buffer
    cfg = marshal.loads(inp.read(int(inp.readline())))
    code = inp.read(int(inp.readline()))
    _ST = cfg["status_fd"]
    os.set_inheritable(_ST, False)
    os.set_blocking(_ST, False)
    fd = os.open("/dev/null", os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    try:
        venv = _site_setup()
        cfg["python_paths"] = [p for p in {venv, sys.base_prefix, sys.base_exec_prefix,
                                           os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}
                               if p]
        if cfg["mode"] == "basic":
            _basic(cfg, code)
        else:
            _namespaced(cfg, code, cfg["mode"] == "userns")
    except BaseException as e:
        _note("E", "%s: %s" % (type(e).__name__, e))
        os._exit(_EXIT_SETUP)


_ST = -1
_EXIT_SETUP = 125
_main()
'''


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
            from dataclasses import replace

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

    async def run(self, code: str, *, timeout_s: float | None = None) -> SandboxResult:
        """Run ``code`` as a fresh ``__main__`` module; never raises for what the code does."""
        if not isinstance(code, str):
            raise TypeError(f"Sandbox.run(code): code must be str, got {type(code).__name__}")
        state = self._state()
        await self._ensure_mode(state)
        data = code.encode("utf-8", "surrogatepass")
        if len(data) > self.config.max_code_bytes:
            return self._error_result(f"code is {len(data)} bytes; the sandbox runs at most "
                                      f"{self.config.max_code_bytes} bytes", 0.0)
        async with state.semaphore:
            return await self._run_once(data, self._mode, timeout_s or self.config.timeout_s)

    def run_sync(self, code: str, *, timeout_s: float | None = None) -> SandboxResult:
        """:meth:`run` for code without an event loop (do not call from inside one)."""
        return asyncio.run(self.run(code, timeout_s=timeout_s))

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

    async def _run_once(self, code: bytes, mode: str, timeout_s: float) -> SandboxResult:
        cfg = self.config
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
            return await self._supervise(call, payload, timeout_s, start)
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

    async def _supervise(self, call: "_Call", payload: bytes, timeout_s: float, start: float) -> SandboxResult:
        cfg, proc, mode = self.config, call.proc, call.mode
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


# --------------------------------------------------------------------------------------------
# Feedback text and code extraction
# --------------------------------------------------------------------------------------------
def _clip(text: str, max_chars: int, keep: Literal["head", "tail", "both"] = "both") -> str:
    if len(text) <= max_chars:
        return text
    if keep == "tail":
        return "[...]\n" + text[-max_chars:]
    if keep == "head":
        return text[:max_chars] + "\n[...]"
    half = max_chars // 2
    return text[:half] + "\n[...]\n" + text[-(max_chars - half):]


def _fmt_bytes(n: int) -> str:
    if n >= _MIB:
        return f"{n / _MIB:.0f} MiB"
    if n >= 1024:
        return f"{n / 1024:.0f} KiB"
    return f"{n} bytes"


def format_feedback(result: SandboxResult, *, max_chars: int = 2000, config: SandboxConfig | None = None) -> str:
    """Concise text telling the model what its code did, whatever happened.

    Success: the output (or a note that there was none). Failure: what went wrong in one line
    (time limit, memory limit, process limit, crash signal), then the end of stderr (where a
    traceback's message is) and any output printed before it. At most ``max_chars`` characters
    plus a short notice; ``config`` (optional) lets the notices quote the limits.
    """
    if result.error is not None:
        return _clip(f"Error: the code could not be run ({result.error}).", max_chars)
    out, err = result.stdout.rstrip("\n"), result.stderr.rstrip("\n")
    problems = []
    if result.timed_out:
        limit = result.time_limit_s if result.time_limit_s is not None else (config.timeout_s if config else None)
        limit = "" if limit is None else f" of {limit:g} s"
        problems.append(f"TimeoutError: the code did not finish within the time limit{limit} and was stopped.")
    if result.memory_exceeded:
        limit = "" if config is None else f" ({_fmt_bytes(config.memory_bytes)})"
        problems.append(f"MemoryError: the code exceeded the memory limit{limit}.")
    if result.cpu_time_exceeded:
        problems.append("Error: the code exceeded the CPU-time limit and was stopped.")
    completed = result.exit_code == 0 and not result.timed_out
    notes = []
    if result.process_limit_hit:
        limit = "" if config is None else f" (at most {config.max_processes} processes and threads)"
        text = f"the code tried to start too many processes or threads{limit}."
        (notes if completed else problems).append(f"[note: {text}]" if completed else f"Error: {text}")
    if result.output_limit_hit:
        problems.append(f"Error: the code printed too much ({_fmt_bytes(result.stdout_bytes + result.stderr_bytes)}"
                        " and counting) and was stopped.")
    sig = result.signal_name
    if sig and not (result.timed_out or result.output_limit_hit or result.cpu_time_exceeded):
        problems.append(f"Error: the process was killed by {sig}.")
    if result.truncated:
        notes.append(f"[output truncated: stdout {_fmt_bytes(result.stdout_bytes)}, stderr "
                     f"{_fmt_bytes(result.stderr_bytes)}; middle part omitted]")
    failed = bool(problems) or (result.exit_code not in (0, None))
    if not failed:
        body = out if out else "(no output; use print() to show results)"
        if err:
            room = max(200, max_chars // 3)
            body = _clip(body, max_chars - min(len(err), room)) + "\n[stderr]\n" + _clip(err, room, "tail")
        else:
            body = _clip(body, max_chars)
        return "\n".join([body] + notes)
    parts = list(problems)
    budget = max(200, max_chars - sum(len(p) for p in parts))
    if err:
        err_room = budget if not out else max(budget // 2, budget - len(out))
        parts.append(_clip(err, err_room, "tail"))
        budget -= min(len(err), err_room)
    if out:
        parts.insert(len(problems), "[stdout]\n" + _clip(out, max(100, budget)))
    if not err and not problems:
        parts.append(f"Error: the code exited with status {result.exit_code}.")
    return "\n".join(parts + notes)


def extract_code_blocks(text: str, languages: tuple[str, ...] = ("python", "py", "python3"), *,
                        include_unclosed: bool = False) -> list[str]:
    """Contents of the fenced code blocks of ``text`` in one of ``languages`` (case-insensitive).

    A block opens with a line of three or more backticks followed by the language name (extra
    words after it are allowed) and closes with a line of at least as many backticks. Indented
    fences (e.g. inside a list) are handled and their indentation removed. An unclosed last block
    (generation stopped at the closing fence) is returned only with ``include_unclosed=True``.
    """
    import textwrap

    langs = {lang.lower() for lang in languages}
    blocks: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        ticks = len(stripped) - len(stripped.lstrip("`"))
        info = stripped[ticks:].strip().split()
        if ticks >= 3 and info and info[0].lower() in langs and "`" not in stripped[ticks:]:
            body = []
            j = i + 1
            closed = False
            while j < len(lines):
                s = lines[j].strip()
                if s.startswith("`" * ticks) and not s.strip("`"):
                    closed = True
                    break
                body.append(lines[j])
                j += 1
            if closed or include_unclosed:
                blocks.append(textwrap.dedent("\n".join(body)).strip("\n") + ("\n" if body else ""))
            i = j + 1
            continue
        i += 1
    return blocks
