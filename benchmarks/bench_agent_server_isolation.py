"""Agent-server isolation (issue 46, item 4): latency of small chat requests of other sessions while one
client sends a 50 MB message, or messages of the largest allowed size.

    python benchmarks/bench_agent_server_isolation.py [--requests 200] [--concurrency 1 4] [--repeats 3]

The OpenAI-compatible agent server (default limits: 8 MiB body, 262144-character messages) over the
tiny model's HF engine, bound to an event loop in another thread as the trainer binds it. Each small
request is the first call of its own session (one short user message, 2 generated tokens: template
rendering, tokenisation, generation, decoding). Scenarios, each at every ``--concurrency``:

- ``baseline``: the small requests alone;
- ``refused_50mb``: meanwhile a client in another process sends a 50 MB message every ``--pause`` s,
  alternately with ``Content-Length`` and chunked (each refused with 413; their refusal times are recorded);
- ``largest_allowed``: meanwhile that client sends a message just under ``max_message_chars`` characters
  every ``--pause`` s, each in a fresh session (accepted: rendered and tokenised in a worker thread under
  the shared tokenizer lock, the most one request may make the tokenizer do).

Every scenario runs ``--repeats`` times, interleaved (the test machine is shared: a busy spell of another
job shows as one slow repeat); the summary gives each scenario's median p99 over the repeats.
Writes ``benchmarks/results/agent_server_isolation.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SMALL = {"model": "policy", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2}


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


NOISE = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
from tests.security.raw_http import raw_post as _raw_post
port, path, kind, pause, chars = int(sys.argv[2]), sys.argv[3], sys.argv[4], float(sys.argv[5]), int(sys.argv[6])
head = b'{"messages": [{"role": "user", "content": "'
i = 0
while True:
    if kind == "largest_allowed":
        body = head + b"word " * (chars // 5) + b'"}], "max_tokens": 2}'
        extra, chunks = f"Content-Length: {len(body)}\r\n", [body]
    elif i % 2 == 0:
        extra, chunks = f"Content-Length: {50 * 2**20}\r\n", [head] + [b"a" * (1 << 20)] * 50
    else:
        extra, chunks = "Transfer-Encoding: chunked\r\n", [f"{1 << 20:x}\r\n".encode() + b"a" * (1 << 20) + b"\r\n"] * 50
    t0 = time.perf_counter()
    try:
        answer, _ = _raw_post(port, path.format(i=i), extra, chunks, read_timeout=120)
    except OSError:  # the server has stopped
        break
    if i == 0:
        print("READY", flush=True)
    print(json.dumps({"kind": kind if kind == "largest_allowed" else ("content-length" if i % 2 == 0 else "chunked"),
                      "status": answer[9:12].decode(), "seconds": time.perf_counter() - t0}), flush=True)
    i += 1
    time.sleep(pause)
"""


def _start_noise(server, noisy_sids, scenario: str, pause: float):
    """The noisy client: another process (as an attacker or a faulty agent would be)."""
    import subprocess

    sid_of = {i: sid for i, sid in enumerate(noisy_sids)}
    if scenario == "refused_50mb":
        path = f"/sessions/{noisy_sids[0]}/v1/chat/completions"
    else:  # every message in a fresh session (a session's second call would have to extend its first)
        path = "/sessions/{i}/v1/chat/completions"
        for i, sid in sid_of.items():  # sessions named 0, 1, ... for the noisy client
            server.sessions[str(i)] = server.sessions.pop(sid)
            server.sessions[str(i)].sid = str(i)
    chars = server.limits.max_message_chars - 100  # the rendered prompt (template text added) stays within it
    proc = subprocess.Popen([sys.executable, "-c", NOISE, str(ROOT), str(server.port), path, scenario, str(pause),
                             str(chars)], stdout=subprocess.PIPE, text=True)
    first = proc.stdout.readline()  # after its first request: the noise is under way
    if first.strip() != "READY":
        raise RuntimeError(f"the noisy client did not start: {first!r}")
    return proc


def run_scenario(model_dir, scenario: str, requests: int, concurrency: int, pause: float) -> dict:
    import httpx

    from tests.security.agent_servers import running_server

    with running_server(model_dir, "chat", sessions=requests + 1 + 200, budget=64) as (server, sids):
        small_sids, noisy_sids = sids[:requests + 1], sids[requests + 1:]
        latencies: list[float] = []
        noise: list[dict] = []

        async def smalls():
            sem = asyncio.Semaphore(concurrency)
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
                async def one(sid, record=True):
                    async with sem:
                        t0 = time.perf_counter()
                        r = await http.post(f"/sessions/{sid}/v1/chat/completions", json=SMALL)
                        if r.status_code != 200:
                            raise RuntimeError(r.text)
                        if record:
                            latencies.append(time.perf_counter() - t0)

                await one(small_sids[0], record=False)  # warm-up
                noisy = None
                if scenario != "baseline":
                    noisy = await asyncio.to_thread(_start_noise, server, noisy_sids, scenario, pause)
                t0 = time.perf_counter()
                await asyncio.gather(*(one(sid) for sid in small_sids[1:]))
                wall = time.perf_counter() - t0
                if noisy is not None:
                    noisy.terminate()
                    out, _ = noisy.communicate(timeout=30)
                    noise.extend(json.loads(line) for line in out.splitlines() if line.startswith("{"))
                return wall

        wall = asyncio.run(smalls())
    row = {"scenario": scenario, "concurrency": concurrency, "requests": len(latencies), "wall_s": round(wall, 3),
           "p50_ms": round(1000 * statistics.median(latencies), 1), "p99_ms": round(1000 * _pct(latencies, 0.99), 1),
           "max_ms": round(1000 * max(latencies), 1), "slowest_ms": [round(1000 * x, 1) for x in sorted(latencies)[-3:]]}
    if noise:
        row["noise_requests"] = len(noise)
        row["noise_statuses"] = sorted({str(n["status"]) for n in noise})
        row["noise_p50_ms"] = round(1000 * statistics.median(n["seconds"] for n in noise), 1)
        row["noise_max_ms"] = round(1000 * max(n["seconds"] for n in noise), 1)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--pause", type=float, default=0.1, help="seconds between the noisy client's requests")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/agent_server_isolation.json"))
    args = ap.parse_args()
    from rlhforge.models.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", seed=0)
        rows = []
        for repeat in range(args.repeats):  # scenarios interleaved: a busy spell of the machine hits all alike
            for c in args.concurrency:
                for scenario in ("baseline", "refused_50mb", "largest_allowed"):
                    row = {"repeat": repeat, **run_scenario(model_dir, scenario, args.requests, c, args.pause)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    summary = [{"scenario": sc, "concurrency": c,
                "p99_ms_median_of_repeats": statistics.median(r["p99_ms"] for r in rows
                                                              if r["scenario"] == sc and r["concurrency"] == c),
                "p99_ms_each_repeat": [r["p99_ms"] for r in rows if r["scenario"] == sc and r["concurrency"] == c]}
               for c in args.concurrency for sc in ("baseline", "refused_50mb", "largest_allowed")]
    result = {"benchmark": "agent_server_isolation", "command": "python benchmarks/bench_agent_server_isolation.py "
              + " ".join(sys.argv[1:]), "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]},
              "limits": {"max_body_bytes": 8 * 2**20, "max_message_chars": 262_144},
              "note": "small requests: first call of a fresh session, 2 generated tokens on the tiny model; "
                      "the machine is shared with other jobs, so absolute numbers are noisy",
              "summary": summary, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
