"""First half of the bootstrap program run inside the sandbox (as source text): notes, limits,
spawn accounting and the ``basic`` mode's in-process guards. See :mod:`.runner`."""

BOOT_GUARDS = r'''
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


'''
