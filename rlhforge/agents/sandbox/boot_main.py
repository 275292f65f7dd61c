"""Second half of the bootstrap program: capabilities, the read-only root, running the code and
the namespace / basic entry points (``_main()``). See :mod:`.runner`."""

BOOT_MAIN = r'''
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
