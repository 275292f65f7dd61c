"""The tool sandbox: every way model-written code can misbehave is contained and reported.

Security tests run in the strongest isolation this machine offers (``auto``) and again in the
interposition-only ``basic`` mode, so both layers are checked wherever the suite runs.
"""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import threading
import time

import pytest

from rlhforge.agents.sandbox import (
    Sandbox,
    SandboxConfig,
    SandboxResult,
    extract_code_blocks,
    format_feedback,
)

MODES = ["auto", "basic"]
_SANDBOXES: dict = {}


def sandbox(mode: str, **overrides) -> Sandbox:
    """One sandbox per (mode, limits), reused across tests (the mode probe runs once)."""
    key = (mode, tuple(sorted(overrides.items())))
    if key not in _SANDBOXES:
        cfg = dict(timeout_s=5.0, memory_bytes=512 << 20, concurrency=4, isolation=mode)
        cfg.update(overrides)
        _SANDBOXES[key] = Sandbox(SandboxConfig(**cfg))
    return _SANDBOXES[key]


def run(sb: Sandbox, code: str, **kw) -> SandboxResult:
    return asyncio.run(sb.run(code, **kw))


def sandbox_processes() -> int:
    """Processes on this machine that belong to a sandbox call (marker in the command line)."""
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"#rlhforge-sandbox" in f.read():
                    n += 1
        except OSError:
            continue
    return n


def no_sandbox_processes_left(wait_s: float = 0.0) -> bool:
    deadline = time.monotonic() + wait_s
    while sandbox_processes():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_isolation_mode_reported():
    sb = sandbox("auto")
    mode = asyncio.run(sb.start())
    print(f"isolation: {mode}; layers: {sb.layers}")
    assert mode in ("namespaces", "userns", "basic")
    assert "rlimit(" in sb.layers
    if mode in ("namespaces", "userns"):
        assert "network-namespace" in sb.layers and "pid-namespace" in sb.layers


@pytest.mark.parametrize("mode", MODES)
def test_normal_code_prints_result(mode, monkeypatch):
    monkeypatch.setenv("RLHFORGE_TEST_SECRET", "do-not-leak")
    r = run(sandbox(mode), "import os, math\nprint(sum(i * i for i in range(10)), math.comb(10, 3))\n"
                           "print(os.environ.get('RLHFORGE_TEST_SECRET'))")
    assert r.ok and r.exit_code == 0, r
    assert r.stdout == "285 120\nNone\n"
    assert not (r.timed_out or r.memory_exceeded or r.truncated)
    assert r.isolation == sandbox(mode).isolation
    assert format_feedback(r) == "285 120\nNone"


def test_infinite_loop_times_out_and_kills_everything():
    sb = sandbox("auto")
    # a busy loop, plus a daemonised grandchild that would outlive a plain kill of the child
    code = ("import os, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid() if hasattr(os, 'setsid') else None\n"
            "    while True: time.sleep(1)\n"
            "while True: pass\n")
    t0 = time.monotonic()
    r = run(sb, code, timeout_s=1.0)
    assert r.timed_out and not r.ok, r
    assert r.exit_code is not None and r.exit_code < 0
    assert time.monotonic() - t0 < 4.0
    fb = format_feedback(r, config=sb.config)
    assert "TimeoutError" in fb and "time limit" in fb
    # namespace modes: gone when run() returns; basic: the process group was killed
    assert no_sandbox_processes_left(0.0 if r.isolation != "basic" else 2.0)


def test_huge_output_is_truncated_with_bounded_parent_memory():
    sb = sandbox("auto", max_output_bytes=4096, kill_output_bytes=None)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    r = run(sb, "import sys\nchunk = 'x' * 1023 + '\\n'\nfor _ in range(64 * 1024): sys.stdout.write(chunk)\n"
                "print('the end')")
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert r.ok, r
    assert r.truncated and r.stdout_bytes == 64 * 1024 * 1024 + len("the end\n")
    assert len(r.stdout) < 4096 + 100
    assert r.stdout.startswith("xxx") and r.stdout.endswith("the end\n") and "bytes omitted" in r.stdout
    assert grown_mib < 32, f"parent grew by {grown_mib:.0f} MiB reading 64 MiB of output"
    fb = format_feedback(r)
    assert "output truncated" in fb and len(fb) < 2300


def test_output_flood_is_stopped_early():
    sb = sandbox("auto", max_output_bytes=1024, kill_output_bytes=1 << 20, timeout_s=20.0)
    r = run(sb, "while True: print('spam' * 100)")
    assert r.output_limit_hit and not r.timed_out and r.truncated, r
    assert r.duration < 10
    assert "printed too much" in format_feedback(r)


@pytest.mark.parametrize("mode", MODES)
def test_network_is_blocked(mode):
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    try:
        code = ("import socket\n"
                "try:\n"
                f"    socket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'leak')\n"
                "    print('CONNECTED')\n"
                "except OSError as e:\n"
                "    print('BLOCKED', type(e).__name__, e)\n")
        r = run(sandbox(mode), code)
        assert r.ok, r
        assert r.stdout.startswith("BLOCKED"), r.stdout
        with pytest.raises(socket.timeout):
            listener.accept()  # nothing ever reached the listener
    finally:
        listener.close()


@pytest.mark.parametrize("mode", MODES)
def test_writes_outside_scratch_do_not_land(mode, tmp_path):
    target = tmp_path / "outside" / "pwned.txt"
    target.parent.mkdir()
    code = ("import os\n"
            f"target = {str(target)!r}\n"
            "for attempt in (lambda: os.makedirs(os.path.dirname(target), exist_ok=True),\n"
            "                lambda: open(target, 'w').write('pwned'),\n"
            "                lambda: open('/etc/rlhforge-sandbox-test', 'w').write('pwned'),\n"
            "                lambda: os.open('dir_fd.txt', os.O_CREAT | os.O_WRONLY,\n"
            "                                dir_fd=os.open(os.path.dirname(target), os.O_RDONLY))):\n"
            "    try:\n"
            "        attempt()\n"
            "    except OSError as e:\n"
            "        print('refused:', type(e).__name__)\n"
            "open('scratch.txt', 'w').write('fine')\n"
            "print('scratch:', open('scratch.txt').read(), os.getcwd() != os.path.dirname(target))\n")
    r = run(sandbox(mode), code)
    assert r.ok, r
    assert "scratch: fine True" in r.stdout
    assert not target.exists() and list(target.parent.iterdir()) == []
    assert not os.path.exists("/etc/rlhforge-sandbox-test")
    # /etc is read-only (or refused); the test's own path is refused in basic mode, and in the
    # namespace modes it resolves inside the call's private /tmp, which vanishes with the call
    assert r.stdout.count("refused:") >= (3 if r.isolation == "basic" else 1)


@pytest.mark.parametrize("mode", MODES)
def test_fork_bomb_is_bounded_and_reported(mode):
    limit = 8
    sb = sandbox(mode, max_processes=limit, timeout_s=1.0)
    asyncio.run(sb.start())
    code = ("import os, time\n"
            "while True:\n"
            "    try:\n"
            "        os.fork()\n"
            "    except OSError:\n"
            "        time.sleep(0.01)\n")
    peak, stop = [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], sandbox_processes())
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        r = run(sb, code)
    finally:
        stop.set()
        watcher.join()
    assert r.timed_out and r.process_limit_hit, r
    # the code's processes, plus the sandbox's own outer process and namespace init
    assert 1 <= peak[0] <= limit + 2, f"peak {peak[0]} sandbox processes (limit {limit})"
    assert "too many processes" in format_feedback(r, config=sb.config)
    assert no_sandbox_processes_left(0.0 if r.isolation != "basic" else 2.0)


@pytest.mark.parametrize("mode", MODES)
def test_memory_hog_is_reported(mode):
    sb = sandbox(mode, memory_bytes=256 << 20)
    r = run(sb, "x = bytearray(2 * 1024 ** 3)\nprint('allocated')")
    assert r.memory_exceeded and r.exit_code == 1 and "allocated" not in r.stdout, r
    fb = format_feedback(r, config=sb.config)
    assert fb.startswith("MemoryError: the code exceeded the memory limit (256 MiB)")
    # gradual growth is caught as well
    r = run(sb, "blocks = []\nwhile True: blocks.append(bytearray(8 << 20))")
    assert r.memory_exceeded, r


def test_many_concurrent_runs_are_correct_and_bounded():
    sb = sandbox("auto", concurrency=4)
    code = "import time\ntime.sleep(0.15)\nprint({i} * {i})"

    async def main():
        t0 = time.monotonic()
        results = await asyncio.gather(*(sb.run(code.format(i=i)) for i in range(16)))
        return results, time.monotonic() - t0

    results, elapsed = asyncio.run(main())
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(16)]
    assert all(r.ok for r in results)
    assert elapsed >= 4 * 0.15  # 16 calls, at most 4 at once


def test_syntax_error_and_exceptions_become_feedback():
    sb = sandbox("auto")
    r = run(sb, "def f(:\n    return 1\n")
    assert r.exit_code == 1 and not r.timed_out
    fb = format_feedback(r)
    assert "SyntaxError" in fb and 'File "main.py", line 1' in fb
    r = run(sb, "print('before')\nx = {}\nx['missing']\n")
    fb = format_feedback(r)
    assert "KeyError: 'missing'" in fb and "before" in fb and "rlhforge-sandbox" not in fb
    assert "x['missing']" in fb  # the offending source line is shown
    r = run(sb, "import sys\nsys.exit(3)")
    assert r.exit_code == 3 and "status 3" in format_feedback(r)


def test_cpu_time_limit():
    sb = sandbox("auto", cpu_time_s=1.0, timeout_s=10.0)
    r = run(sb, "while True: pass")
    assert r.cpu_time_exceeded and not r.timed_out and r.signal_name == "SIGXCPU", r
    assert "CPU-time limit" in format_feedback(r)


def test_caller_errors_raise_but_oversized_code_does_not():
    sb = sandbox("auto", max_code_bytes=1000)
    with pytest.raises(TypeError):
        run(sb, b"print(1)")  # type: ignore[arg-type]
    r = run(sb, "x = 1\n" * 1000)
    assert r.error is not None and r.exit_code is None and "could not be run" in format_feedback(r)
    with pytest.raises(ValueError, match="memory_bytes"):
        SandboxConfig(memory_bytes=1 << 20)


def test_format_feedback_on_made_up_results():
    base = dict(stdout="", stderr="", exit_code=0, timed_out=False, memory_exceeded=False, truncated=False,
                duration=0.1)
    assert format_feedback(SandboxResult(**base)).startswith("(no output")
    long = SandboxResult(**{**base, "stdout": "a" * 5000 + "END"})
    fb = format_feedback(long, max_chars=500)
    assert len(fb) < 600 and fb.startswith("aaa") and fb.endswith("END")
    crash = SandboxResult(**{**base, "exit_code": -11, "stdout": "partial"})
    fb = format_feedback(crash)
    assert "SIGSEGV" in fb and "partial" in fb
    tb = "Traceback (most recent call last):\n" + "  frame\n" * 2000 + "ValueError: bad"
    fb = format_feedback(SandboxResult(**{**base, "exit_code": 1, "stderr": tb}), max_chars=400)
    assert fb.endswith("ValueError: bad") and len(fb) < 500


def test_extract_code_blocks():
    text = ("Let me compute.\n```python\nx = 2\nprint(x ** 10)\n```\nSo 1024. Also\n"
            "```py title\nprint(1)\n```\nnot this:\n```bash\nls\n```\n"
            "  - indented:\n    ```Python\n    print('i')\n    ```\n"
            "inline ```python print(0)``` is not a block\n"
            "```python\nunfinished = True\n")
    assert extract_code_blocks(text) == ["x = 2\nprint(x ** 10)\n", "print(1)\n", "print('i')\n"]
    assert extract_code_blocks(text, include_unclosed=True)[-1] == "unfinished = True\n"
    assert extract_code_blocks("no code here") == []
    assert extract_code_blocks("````python\na = '```'\n````") == ["a = '```'\n"]


def test_cancelled_call_leaves_nothing_behind():
    sb = sandbox("auto")

    async def main():
        task = asyncio.ensure_future(sb.run("import os\nos.fork()\nwhile True: pass", timeout_s=30))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert no_sandbox_processes_left(0.0 if sb.isolation != "basic" else 2.0)


def test_namespace_filesystem_view(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "numbers.txt").write_text("1 2 3\n")
    sb = sandbox("auto", read_only_paths=(str(data),))
    if asyncio.run(sb.start()) == "basic":
        pytest.skip("namespace isolation is not available here")
    here = os.path.abspath(__file__)
    code = ("import os\n"
            f"print(sum(map(int, open({str(data / 'numbers.txt')!r}).read().split())))\n"
            f"print(os.path.exists({here!r}), os.path.exists('/root/.bashrc'), os.getcwd())\n"
            "try:\n"
            f"    open({str(data / 'new.txt')!r}, 'w')\n"
            "except OSError as e:\n"
            "    print(e.strerror)\n")
    r = run(sb, code)
    assert r.ok, r
    assert r.stdout.splitlines() == ["6", "False False /tmp", "Read-only file system"]
    assert not (data / "new.txt").exists()


def test_unprivileged_user_namespace_mode():
    """As a non-root user (uid 65534), ``auto`` isolation is the user-namespace mode."""
    import shutil
    import subprocess

    python = "/usr/bin/python3"
    if os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists(python):
        pytest.skip("needs root (to switch to an unprivileged user), setpriv and a system python")
    package = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "rlhforge", "agents", "sandbox"))
    script = (  # the sandbox package alone (no torch in the system python), loaded from its folder
        "import asyncio, importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('sbx', {package + '/__init__.py'!r}, "
        f"submodule_search_locations=[{package!r}])\n"
        "S = importlib.util.module_from_spec(spec); sys.modules['sbx'] = S; spec.loader.exec_module(S)\n"
        "async def main():\n"
        "    sb = S.Sandbox(S.SandboxConfig(timeout_s=3, memory_bytes=256 << 20, max_processes=6))\n"
        "    print('MODE', await sb.start())\n"
        "    net = await sb.run(\"import socket\\ntry:\\n socket.create_connection(('127.0.0.1', 9), 1)\\n"
        "except OSError as e: print(e.errno)\")\n"
        "    fs = await sb.run(\"open('/etc/x', 'w')\")\n"
        "    bomb = await sb.run('import os, time\\nwhile True:\\n try: os.fork()\\n except OSError: time.sleep(0.01)',"
        " timeout_s=1)\n"
        "    print('NET', net.stdout.strip(), 'FS', 'Read-only' in fs.stderr, 'BOMB', bomb.process_limit_hit)\n"
        "asyncio.run(main())\n")
    out = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", python, "-c", script],
                         capture_output=True, text=True, timeout=60, cwd="/")
    assert "Traceback" not in out.stderr, out.stderr[-2000:]  # a broken import is a failure, not a skip
    if "MODE userns" not in out.stdout:
        pytest.skip(f"unprivileged user namespaces unavailable here: {out.stdout} {out.stderr[-500:]}")
    assert "NET 101 FS True BOMB True" in out.stdout, out.stdout + out.stderr


def test_per_call_limits_override_the_config_for_one_call():
    from rlhforge.agents.sandbox import PER_CALL_LIMITS

    sb = sandbox("auto")  # 512 MiB, 5 s
    hog = "b = bytearray(300 << 20)\nprint(len(b))"
    r = run(sb, hog, limits={"memory_bytes": 128 << 20})
    assert r.memory_exceeded and r.stdout == ""
    assert run(sb, hog).stdout == f"{300 << 20}\n"  # the next call has the config's limit again
    r = run(sb, "print('y' * 5000)", limits={"max_output_bytes": 1024})
    assert r.truncated and r.stdout_bytes == 5001 and len(r.stdout) < 1200
    r = run(sb, "while True: pass", limits={"timeout_s": 0.5})
    assert r.timed_out and r.time_limit_s == 0.5
    with pytest.raises(ValueError, match="'isolation'.*cannot be set per call"):
        run(sb, "print(1)", limits={"isolation": "basic"})
    with pytest.raises(ValueError, match="max_output_bytes must be >= 256"):
        run(sb, "print(1)", limits={"max_output_bytes": 10})
    assert "isolation" not in PER_CALL_LIMITS and "memory_bytes" in PER_CALL_LIMITS


def test_clamp_limits_and_result_round_trip():
    from rlhforge.agents.sandbox.config import clamp_limits, result_from_dict, result_to_dict

    ceiling = SandboxConfig(timeout_s=10, memory_bytes=512 << 20, kill_output_bytes=None)
    got = clamp_limits({"timeout_s": 60, "memory_bytes": 64 << 20, "cpu_time_s": 99, "kill_output_bytes": 1 << 30,
                        "max_processes": None}, ceiling)
    # lowered to the ceiling, kept when below it, unbounded stays unbounded; None: the ceiling's value
    assert got == {"timeout_s": 10.0, "memory_bytes": 64 << 20, "cpu_time_s": 10.0, "kill_output_bytes": 1 << 30}
    with pytest.raises(ValueError, match="must be a number"):
        clamp_limits({"timeout_s": "5"}, ceiling)
    with pytest.raises(ValueError, match="cannot be set per call"):
        clamp_limits({"python": 1}, ceiling)
    r = run(sandbox("auto"), "print(7)")
    assert result_from_dict({**result_to_dict(r), "from_a_newer_server": 1}) == r
    with pytest.raises(ValueError, match="missing"):
        result_from_dict({"stdout": ""})
