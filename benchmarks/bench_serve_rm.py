"""Load benchmark of ``rlhforge serve-rm``: requests/s and latency, with and without bad payloads.

    python benchmarks/bench_serve_rm.py [--requests 400] [--concurrency 16] [--bad-fraction 0.2]

Starts ``python -m rlhforge serve-rm`` as a subprocess on a free 127.0.0.1 port with a tiny
reward model (the tiny Llama of ``rlhforge.models.tiny`` with a random one-label head), then sends
``--requests`` requests from ``--concurrency`` concurrent keep-alive connections (httpx):

- ``clean``: every request is good (2 queries of 10-60 words each);
- ``mixed``: the same good requests, with ``--bad-fraction`` of the slots replaced by bad payloads
  (cycling through: a lone surrogate, 100k-deep nesting, a 5000-digit integer, a wrong type,
  broken JSON), spread evenly through the run.

Reported per phase: requests/s (all requests), latency p50/p90/p99 of the good requests, and the
count of each HTTP status. Targets (issue #16): no 500 at all; good-request p99 with bad payloads
within 1.5x of the clean p99. Then one 16 MB query (accepted: cut to max_len tokens before
tokenising) and one 40 MB body (413) are timed. The two phases run in the order clean, mixed,
clean, mixed; the numbers of each phase pool both of its runs. Bounded: 2 x 2 x ``--requests``
requests, about a minute on 2 CPU cores. Writes ``benchmarks/results/serve_rm.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BAD_PAYLOADS = [
    ("lone_surrogate", b'{"query": ["fine", "\\ud800"]}'),
    ("deep_nesting", b'{"query": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("huge_int", b'{"query": ["a"], "labels": [' + b"7" * 5000 + b"]}"),
    ("wrong_type", b'{"query": ["a", 3]}'),
    ("broken_json", b'{"query": ["a", '),
]
WORDS = ("the answer is what compute add sum plus number result value think step final reverse sort count "
         "letters word list yes no true false good bad correct wrong hello world").split()


def build_rm(out: Path) -> Path:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhforge.models.tiny import build_tiny_model

    base = build_tiny_model(out / "base", seed=0)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
    with torch.no_grad():
        model.score.weight.normal_(0, 0.5)
    model.save_pretrained(out / "rm")
    AutoTokenizer.from_pretrained(base).save_pretrained(out / "rm")
    return out / "rm"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def good_payload(rng: random.Random) -> bytes:
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 60))) for _ in range(2)]
    return json.dumps({"query": texts, "prompts": ["p", "p"], "labels": ["l", "l"]}).encode()


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[k]


async def run_phase(url: str, payloads: list[tuple[str, bytes]], concurrency: int) -> dict:
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for item in payloads:
        queue.put_nowait(item)
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    bad_statuses: dict[str, int] = {}

    async def worker(http):
        while True:
            try:
                kind, body = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            t0 = time.perf_counter()
            response = await http.post(url, content=body, headers={"content-type": "application/json"})
            dt = time.perf_counter() - t0
            statuses[str(response.status_code)] = statuses.get(str(response.status_code), 0) + 1
            if kind == "good":
                if response.status_code == 200:
                    latencies.append(dt)
            else:
                key = f"{kind}:{response.status_code}"
                bad_statuses[key] = bad_statuses.get(key, 0) + 1

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*[worker(http) for _ in range(concurrency)])
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "requests": len(payloads), "latencies": latencies, "statuses": statuses,
            "bad_statuses": bad_statuses}


def summarise(runs: list[dict]) -> dict:
    lat = [x for r in runs for x in r["latencies"]]
    statuses: dict[str, int] = {}
    bad: dict[str, int] = {}
    for r in runs:
        for k, v in r["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
        for k, v in r["bad_statuses"].items():
            bad[k] = bad.get(k, 0) + v
    return {
        "requests_per_s": sum(r["requests"] for r in runs) / sum(r["seconds"] for r in runs),
        "requests_per_s_each_run": [r["requests"] / r["seconds"] for r in runs],
        "good_requests": len(lat),
        "good_p50_ms": 1000 * statistics.median(lat), "good_p90_ms": 1000 * percentile(lat, 90),
        "good_p99_ms": 1000 * percentile(lat, 99), "good_max_ms": 1000 * max(lat),
        "statuses": dict(sorted(statuses.items())), "bad_payload_statuses": dict(sorted(bad.items())),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--bad-fraction", type=float, default=0.2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-wait-ms", type=float, default=5.0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "serve_rm.json"))
    args = ap.parse_args()
    import httpx

    rng = random.Random(0)
    good = [("good", good_payload(rng)) for _ in range(args.requests)]
    every = max(1, round(1 / args.bad_fraction)) if args.bad_fraction > 0 else 0
    mixed = [(BAD_PAYLOADS[(i // every) % len(BAD_PAYLOADS)][0], BAD_PAYLOADS[(i // every) % len(BAD_PAYLOADS)][1])
             if every and i % every == every - 1 else item for i, item in enumerate(good)]

    with tempfile.TemporaryDirectory() as tmp:
        rm = build_rm(Path(tmp))
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1", "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, "-m", "rlhforge", "serve-rm", "--reward.model_name_or_path", str(rm), "--port", str(port),
               "--batch_size", str(args.batch_size), "--max_wait_ms", str(args.max_wait_ms), "--device", "cpu",
               "--log_level", "warning"]
        log_path = Path(tmp) / "serve.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + 180
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"serve-rm exited: {log_path.read_text()}")
                try:
                    if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit("serve-rm did not start within 180 s")
                time.sleep(0.2)
            url = f"{base}/get_reward"
            asyncio.run(run_phase(url, good[:64], args.concurrency))  # warm-up
            runs: dict[str, list[dict]] = {"clean": [], "mixed": []}
            for phase in ("clean", "mixed", "clean", "mixed"):
                runs[phase].append(asyncio.run(run_phase(url, good if phase == "clean" else mixed, args.concurrency)))
            big_query = json.dumps({"query": ["word " * (16 * 2**20 // 5)]}).encode()
            t0 = time.perf_counter()
            big = httpx.post(url, content=big_query, timeout=120)
            big_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            oversize = httpx.post(url, content=b"x" * (40 * 2**20), timeout=120)
            oversize_s = time.perf_counter() - t0
            health = httpx.get(f"{base}/health", timeout=10).json()
        finally:
            proc.terminate()
            try:
                code = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait(10)

    clean, mix = summarise(runs["clean"]), summarise(runs["mixed"])
    bad_n = sum(1 for kind, _ in mixed if kind != "good")
    results = {
        "setup": {
            "model": "rlhforge tiny Llama (TinyModelSpec defaults) + random one-label head",
            "server": "python -m rlhforge serve-rm (subprocess, 127.0.0.1, OMP_NUM_THREADS=1, defaults: "
                      "max_request_bytes 32 MiB, max_queue 256, max_len 2048)",
            "requests_per_run": args.requests, "runs_per_phase": 2, "concurrency": args.concurrency,
            "queries_per_good_request": 2, "words_per_query": "10-60",
            "bad_fraction": bad_n / len(mixed), "bad_kinds": [k for k, _ in BAD_PAYLOADS],
            "batch_size": args.batch_size, "max_wait_ms": args.max_wait_ms, "cpus": os.cpu_count(),
        },
        "clean": clean,
        "mixed": mix,
        "p99_ratio_mixed_vs_clean": mix["good_p99_ms"] / clean["good_p99_ms"],
        "p50_ratio_mixed_vs_clean": mix["good_p50_ms"] / clean["good_p50_ms"],
        "http_500s": clean["statuses"].get("500", 0) + mix["statuses"].get("500", 0),
        "query_16mb": {"status": big.status_code, "seconds": big_s},
        "body_40mb": {"status": oversize.status_code, "seconds": oversize_s},
        "server_exit_code_after_sigterm": code,
        "server_counters": {k: health[k] for k in ("requests", "queries", "batches", "errors")},
    }
    results["targets_met"] = {"zero_500s": results["http_500s"] == 0,
                              "p99_within_1.5x": results["p99_ratio_mixed_vs_clean"] <= 1.5}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k != "setup"}, indent=1))


if __name__ == "__main__":
    main()
