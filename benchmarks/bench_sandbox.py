"""Tool-call throughput of the code sandbox: calls/s at concurrency 1, 4 and 16.

    .venv/bin/python benchmarks/bench_sandbox.py [--calls 64] [--modes auto basic] \
        [--out benchmarks/results/sandbox.json]

Each call runs a trivial snippet (``print(sum(range(100)))``) in a fresh sandboxed process, so
the numbers measure the fixed cost of a call (interpreter start, namespaces, mounts, limits,
teardown), which is what a tool-integrated-reasoning rollout pays per tool call. Records calls/s
and the median / p90 duration of one call (from its process start to the end of its teardown,
not counting the wait for a free slot) for every isolation mode and concurrency level.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlhforge.agents.sandbox import Sandbox, SandboxConfig  # noqa: E402

SNIPPET = "print(sum(range(100)))"


async def measure(mode: str, concurrency: int, calls: int) -> dict:
    sandbox = Sandbox(SandboxConfig(isolation=mode, concurrency=concurrency, timeout_s=30))
    await sandbox.start()
    for _ in range(2):  # warm-up (page cache, first namespace setup)
        assert (await sandbox.run(SNIPPET)).stdout == "4950\n"
    latencies: list[float] = []

    async def one() -> None:
        result = await sandbox.run(SNIPPET)
        latencies.append(result.duration)  # start to finish of the call itself (not the wait for a slot)
        if result.stdout != "4950\n":
            raise RuntimeError(f"unexpected result: {result}")

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(calls)))
    wall = time.perf_counter() - t0
    latencies.sort()
    return {
        "calls": calls,
        "calls_per_s": calls / wall,
        "call_duration_median_s": statistics.median(latencies),
        "call_duration_p90_s": latencies[int(0.9 * (len(latencies) - 1))],
        "isolation": sandbox.isolation,
        "layers": sandbox.layers,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=64, help="calls per concurrency level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--modes", nargs="+", default=["auto", "basic"])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "sandbox.json")
    args = parser.parse_args()

    results: dict = {}
    load_before = os.getloadavg()[0]
    for mode in args.modes:
        for c in args.concurrency:
            r = asyncio.run(measure(mode, c, args.calls))
            name = r["isolation"]
            results.setdefault(name, {"layers": r.pop("layers")})
            r.pop("isolation")
            results[name][f"concurrency_{c}"] = r
            print(f"{name:>10}  concurrency {c:>2}: {r['calls_per_s']:6.1f} calls/s   call median "
                  f"{1000 * r['call_duration_median_s']:.0f} ms, p90 {1000 * r['call_duration_p90_s']:.0f} ms",
                  flush=True)
    results["setup"] = {
        "snippet": SNIPPET,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "euid": os.geteuid(),
        "load_average_1min_before": load_before,
        "load_average_1min_after": os.getloadavg()[0],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
