"""The remote sandbox service (``rlhforge serve-sandbox``) and its client under faults: dead, busy
and moved servers, wrong keys, limits a caller may not raise, clients that leave.

Every server is real (uvicorn on a free 127.0.0.1 port, in a thread; the CLI test in a subprocess).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import pytest

from rlhforge.agents.sandbox import Sandbox, SandboxClient, SandboxConfig, format_feedback
from rlhforge.agents.sandbox.server import create_app, start_service_thread

KEY = "test-key"
LIMITS = dict(timeout_s=2.0, memory_bytes=256 << 20, max_output_bytes=4096)
AUTH = {"Authorization": f"Bearer {KEY}"}


def start(concurrency=2, max_queue=2, api_key=KEY, **limits):
    sandbox = Sandbox(SandboxConfig(**{**LIMITS, **limits}, concurrency=concurrency))
    return start_service_thread(create_app(sandbox, api_key=api_key, concurrency=concurrency, max_queue=max_queue))


def health(handle) -> dict:
    return httpx.get(f"{handle.base_url}/health", timeout=10).json()


def dead_url() -> str:
    """A 127.0.0.1 address nobody listens on (connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def write_endpoints(path: Path, urls: list[str]) -> None:
    """Atomic replace, as docs/sandbox.md asks (a reader never sees half a file)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("# sandbox servers\n" + "\n".join(urls) + "\n")
    os.replace(tmp, path)


def wait_until(predicate, what: str, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server():
    with start() as handle:
        yield handle


@pytest.fixture(scope="module")
def server_b():
    with start() as handle:
        yield handle


CODES = [
    "print(2 ** 10)",
    "import sys\nprint('out'); print('err', file=sys.stderr); sys.exit(3)",
    "def f(x):\n    return 1 / x\nprint('before')\nf(0)",
    "print('unclosed'",
    "print('x' * 100000)",  # truncated to max_output_bytes
]


@pytest.mark.parametrize("code", CODES)
def test_remote_result_equals_local(server, code):
    local = Sandbox(SandboxConfig(**LIMITS)).run_sync(code)
    remote = SandboxClient(server.base_url, api_key=KEY).run_sync(code, timeout_s=LIMITS["timeout_s"])
    a, b = asdict(local), asdict(remote)
    a.pop("duration"), b.pop("duration")
    assert b == a
    assert format_feedback(remote) == format_feedback(local)


def test_infinite_loop_gets_the_limit_and_the_server_caps_it(server):
    client = SandboxClient(server.base_url, api_key=KEY)
    r = client.run_sync("while True:\n    pass", timeout_s=1.0)
    assert r.timed_out and not r.ok and r.time_limit_s == 1.0
    assert format_feedback(r).startswith("TimeoutError: the code did not finish within the time limit of 1 s")
    # asking for more than the server allows gets the server's maxima
    answer = httpx.post(server.url, headers=AUTH, timeout=30, json={
        "code": "while True:\n    pass", "limits": {"timeout_s": 100, "memory_bytes": 1 << 40}}).json()
    assert answer["result"]["timed_out"] and answer["result"]["time_limit_s"] == LIMITS["timeout_s"]
    assert answer["limits"]["timeout_s"] == LIMITS["timeout_s"]
    assert answer["limits"]["memory_bytes"] == LIMITS["memory_bytes"]
    # a lower memory limit than the server's is applied
    hog = client.run_sync("b = bytearray(200 << 20)\nprint(len(b))", limits={"memory_bytes": 64 << 20})
    assert hog.memory_exceeded and hog.stdout == ""
    assert client.run_sync("b = bytearray(100 << 20)\nprint(len(b))").stdout == f"{100 << 20}\n"


def test_bad_requests_and_keys(server):
    code = {"code": "print(1)"}
    assert httpx.post(server.url, json=code, timeout=10).status_code == 401
    assert httpx.post(server.url, json=code, headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    ok = httpx.post(server.url, json=code, headers={"X-API-Key": KEY}, timeout=10)
    assert ok.status_code == 200 and ok.json()["result"]["stdout"] == "1\n"
    assert health(server)["status"] == "ok"  # no key needed
    bad = httpx.post(server.url, content=b"{not json", headers=AUTH, timeout=10)
    assert bad.status_code == 400 and "malformed JSON" in bad.json()["error"]
    bad = httpx.post(server.url, json={"code": "1", "limits": {"isolation": "basic"}}, headers=AUTH, timeout=10)
    assert bad.status_code == 400 and "'isolation' cannot be set per call" in bad.json()["error"]

    client = SandboxClient(f"{server.base_url},{server.base_url}/run", api_key="wrong")
    r = client.run_sync("print(1)")
    assert r.error and "HTTP 401" in r.error and server.base_url in r.error and r.exit_code is None
    assert client.counters == {"calls": 0, "failovers": 0, "failures": 1}  # a refused key stops at once


def test_first_endpoint_dead_fails_over(server, tmp_path, caplog):
    dead = dead_url()
    path = tmp_path / "sandboxes.txt"
    write_endpoints(path, [dead, server.base_url])
    client = SandboxClient(f"endpoints:{path}", api_key=KEY)
    with caplog.at_level(logging.WARNING, logger="rlhforge.agents.sandbox.client"):
        r = client.run_sync("print('hi')")
    assert r.ok and r.stdout == "hi\n" and client.last_url == server.base_url
    assert client.counters["failovers"] == 1
    assert any(dead in rec.getMessage() and "ConnectError" in rec.getMessage() for rec in caplog.records)
    # the dead server cools down: later calls go straight to the live one
    for _ in range(3):
        assert client.run_sync("print(1)").ok
    assert client.counters == {"calls": 4, "failovers": 1, "failures": 0}


def test_rewriting_the_endpoints_file_moves_calls(server, server_b, tmp_path):
    path = tmp_path / "sandboxes.txt"
    write_endpoints(path, [server.base_url])
    client = SandboxClient(f"endpoints:{path}", api_key=KEY)
    a0, b0 = health(server)["calls"], health(server_b)["calls"]
    assert client.run_sync("print(1)").ok and client.last_url == server.base_url
    write_endpoints(path, [server_b.base_url])
    for _ in range(2):
        assert client.run_sync("print(2)").stdout == "2\n" and client.last_url == server_b.base_url
    assert (health(server)["calls"] - a0, health(server_b)["calls"] - b0) == (1, 2)


def test_all_servers_dead_is_a_counted_sandbox_error(tmp_path, caplog):
    dead1, dead2 = dead_url(), dead_url()
    client = SandboxClient([dead1, dead2], api_key=KEY, max_attempts=3, backoff_s=0.01)
    with caplog.at_level(logging.WARNING, logger="rlhforge.agents.sandbox.client"):
        r = client.run_sync("print(1)")
    assert r.exit_code is None and not r.ok and r.error.startswith("sandbox service unavailable: ")
    assert dead1 in r.error and dead2 in r.error and "ConnectError" in r.error
    assert r.error.count("ConnectError") == 3  # three tries: both servers, then the first again
    assert client.counters == {"calls": 0, "failovers": 2, "failures": 1}
    errors = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.ERROR]
    assert len(errors) == 1 and dead1 in errors[0] and dead2 in errors[0]
    assert format_feedback(r).startswith("Error: the code could not be run (sandbox service unavailable: ")


def test_over_concurrency_is_503_then_queued_calls_are_stopped_by_disconnect(server):
    with start(concurrency=1, max_queue=1) as busy:
        async def scenario():
            slow = {"code": "import time\ntime.sleep(60)", "limits": {"timeout_s": 30}}
            async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
                first = asyncio.ensure_future(http.post(busy.url, json=slow))
                await asyncio.to_thread(wait_until, lambda: health(busy)["running"] == 1, "the first call to run")
                second = asyncio.ensure_future(http.post(busy.url, json=slow))
                await asyncio.to_thread(wait_until, lambda: health(busy)["queued"] == 1, "the second call to queue")
                third = await http.post(busy.url, json={"code": "print(3)"})
                assert third.status_code == 503 and third.headers["retry-after"] == "1"
                assert "busy: 1 calls running, 1 queued" in third.json()["error"]
                # a client moves on to the next server when one is full
                client = SandboxClient([busy.base_url, server.base_url], api_key=KEY)
                r = await client.run("print('elsewhere')")
                assert r.stdout == "elsewhere\n" and client.last_url == server.base_url
                assert client.counters["failovers"] == 1
                for task in (first, second):  # the clients leave: their calls are stopped
                    task.cancel()
                await asyncio.gather(first, second, return_exceptions=True)

        asyncio.run(scenario())
        wait_until(lambda: health(busy)["cancelled"] == 2, "both calls to be stopped")
        h = health(busy)
        assert (h["running"], h["queued"], h["calls"], h["rejected"]) == (0, 0, 0, 2)
        # the slot is free again
        r = httpx.post(busy.url, json={"code": "print('free')"}, headers=AUTH, timeout=30).json()
        assert r["result"]["stdout"] == "free\n"


def test_serve_sandbox_cli_subprocess(tmp_path):
    port = int(dead_url().rsplit(":", 1)[1])
    log = open(tmp_path / "server.log", "w")
    env = {**os.environ, "RLHFORGE_SANDBOX_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "rlhforge.cli.main", "serve-sandbox", "--port", str(port),
                             "--concurrency", "1", "--timeout_s", "3", "--log_level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        def up():
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(up, "serve-sandbox to answer", limit_s=120)
        client = SandboxClient(f"http://127.0.0.1:{port}", api_key=KEY)
        assert client.run_sync("print(sum(range(10)))").stdout == "45\n"
        assert client.run_sync("while True: pass", timeout_s=50).time_limit_s == 3.0
        assert SandboxClient(f"http://127.0.0.1:{port}", api_key="no").run_sync("1").error
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
    assert "POST http://127.0.0.1:%d/run" % port in (tmp_path / "server.log").read_text()


def test_serve_sandbox_bad_flags_exit_2():
    out = subprocess.run([sys.executable, "-m", "rlhforge.cli.serve_sandbox", "--memory_mb", "8"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--memory_mb must be >= 32" in out.stderr


# ------------------------------------------------------------------------------ math_tir, remote


class _ScriptedEngine:
    """Test double for this unit test only: answers each request with the next scripted text."""

    def __init__(self, tok, texts):
        self.tok, self.texts = tok, list(texts)

    async def generate(self, prompts, params):
        from rlhforge.rollout.engine import GenerationOutput

        outs = []
        for _p, _sp in zip(prompts, params):
            ids = self.tok.encode(self.texts.pop(0), add_special_tokens=False) + [self.tok.eos_token_id]
            outs.append(GenerationOutput(ids, [-0.5] * len(ids), "stop"))
        return outs


def _math_tir_episode(tok):
    from rlhforge.agents import AgentSettings, RegistryExecutor
    from rlhforge.agents.single_turn import PromptRequest
    from rlhforge.rollout.engine import SamplingParams

    ex = RegistryExecutor().configure(tokenizer=tok, settings=AgentSettings(step_timeout=60.0))
    ids = tok.encode("Compute 6 * 7.", add_special_tokens=False)
    label = json.dumps({"env_func": "math_tir", "task": "math_tir", "answer": "42"})
    engine = _ScriptedEngine(tok, ["```python\nprint(6 * 7)\n```", "So \\boxed{42}."])
    (traj,) = asyncio.run(ex.execute_batch([PromptRequest(ids, label, None, 0, 0)],
                                           [SamplingParams(max_new_tokens=64)], engine))
    return traj


def test_math_tir_runs_its_code_on_the_service(server, tiny_model_dir, tmp_path, monkeypatch, caplog):
    from transformers import AutoTokenizer

    from rlhforge.agents.registry.builtin import math_tir_sample_filter

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    path = tmp_path / "sandboxes.txt"
    write_endpoints(path, [dead_url(), server.base_url])
    monkeypatch.setenv("RLHFORGE_SANDBOX_URL", f"endpoints:{path}")
    monkeypatch.setenv("RLHFORGE_SANDBOX_API_KEY", KEY)
    before = health(server)["calls"]
    traj = _math_tir_episode(tok)
    assert traj.drop_reason is None, traj.error
    assert traj.reward == 1.0 and traj.extra["tir_sandbox_errors"] == 0.0 and "```output\n42" in tok.decode(traj.token_ids)
    assert health(server)["calls"] == before + 1 and math_tir_sample_filter(traj, None)

    dead = dead_url()
    write_endpoints(path, [dead])  # every server gone: the sample is a sandbox failure, filtered out
    with caplog.at_level(logging.WARNING, logger="rlhforge.agents.sandbox.client"):
        traj = _math_tir_episode(tok)
    assert traj.extra["tir_sandbox_errors"] == 1.0 and not math_tir_sample_filter(traj, None)
    assert any(dead in rec.getMessage() and rec.levelno == logging.ERROR for rec in caplog.records)


def test_train_sandbox_url_flag_points_math_tir_at_the_service(server, tiny_model_dir, monkeypatch, capsys):
    """--train.sandbox_url reaches the built-in tool env through build_executor; a malformed value is a
    start-up error naming the flag; a later run without the flag goes back to a local sandbox."""
    from transformers import AutoTokenizer

    from rlhforge.agents.registry import builtin as builtin_envs
    from rlhforge.agents.loader import build_executor
    from rlhforge.agents.sandbox import Sandbox, SandboxClient
    from rlhforge.cli.train_ppo_ray import parse_rl_args
    from rlhforge.config.parsing import ConfigError

    monkeypatch.delenv("RLHFORGE_SANDBOX_URL", raising=False)
    monkeypatch.setenv("RLHFORGE_SANDBOX_API_KEY", KEY)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = ["--actor.model_name_or_path", str(tiny_model_dir), "--data.prompt_dataset", "x.jsonl",
            "--train.agent_func_path", "registry", "--rollout.batch_size", "8", "--train.batch_size", "8"]
    try:
        build_executor(parse_rl_args(base + ["--train.sandbox_url", server.base_url]), tok, None)
        box = builtin_envs.sandbox()
        assert isinstance(box, SandboxClient) and box.source.current() == [server.base_url]
        before = health(server)["calls"]
        assert asyncio.run(box.run("print(6 * 7)")).stdout.strip() == "42" and health(server)["calls"] == before + 1
        with pytest.raises(ConfigError, match="--train.sandbox_url ftp://nowhere"):
            build_executor(parse_rl_args(base + ["--train.sandbox_url", "ftp://nowhere"]), tok, None)
        build_executor(parse_rl_args(base), tok, None)
        assert isinstance(builtin_envs.sandbox(), Sandbox)
    finally:
        builtin_envs.configure_sandbox(None)
