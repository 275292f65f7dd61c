"""Issue 46, item 5: the local Ray cluster rlhforge starts (``distributed.launch.init_ray``) listens on
loopback only, and its token authentication is on and refuses a client without the token.

The run is a child process (a fresh driver, as ``rlhforge rl --train.workers ray`` is): it starts the
cluster through ``init_ray``, runs a task and an actor (so the raylet has started worker processes),
then lists every listening socket (TCP LISTEN, bound UDP) of its own process tree with psutil, as
``ss -ltnp`` / ``ss -lunp`` show them, and probes the GCS with a wrong token, no token, and the
cluster's own token. On ``89172c3`` (before ``keep_loopback`` covered the local cluster) the list held
the GCS, the raylet, the workers and the driver on ``::``, two helper processes on ``0.0.0.0`` and the
dashboard and runtime-env agents on the machine's address.
"""

import ipaddress
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")

ROOT = Path(__file__).resolve().parents[2]

RUN = r"""
import json, os, subprocess, sys, time
import psutil, ray
from rlhforge.distributed.launch import check_token_auth, init_ray

init_ray(num_cpus=1)

@ray.remote
def task():
    return os.getpid()

@ray.remote
class Actor:
    def pid(self):
        return os.getpid()

actor = Actor.remote()
pids = [ray.get(task.remote()), ray.get(actor.pid.remote())]
time.sleep(1.0)  # the agents have opened every port by now (they report to the raylet first)
me = psutil.Process()
listeners = []
for proc in [me] + me.children(recursive=True):
    try:
        name = proc.name()
        for c in proc.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN or (c.type == 2 and c.laddr):  # TCP LISTEN, bound UDP
                listeners.append([proc.pid, name, c.laddr.ip, c.laddr.port, "udp" if c.type == 2 else "tcp"])
    except psutil.NoSuchProcess:
        continue
gcs = ray._private.worker.global_worker.node.gcs_address
probe = ("from ray._raylet import GcsClient\n"
         "try:\n"
         f"    GcsClient(address={gcs!r}).internal_kv_keys(b'', namespace=None, timeout=10)\n"
         "    print('ANSWERED')\n"
         "except Exception as e:\n"
         "    print('REFUSED', type(e).__name__)\n")
probes = {}
base = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
for label, extra in (("wrong_token", {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "not-the-cluster-token"}),
                     ("no_token", {"RAY_AUTH_MODE": "disabled"}), ("own_token", {"RAY_AUTH_MODE": "token"})):
    r = subprocess.run([sys.executable, "-c", probe], env={**base, **extra}, capture_output=True, text=True, timeout=60)
    probes[label] = (r.stdout.strip().splitlines() or ["(nothing) " + r.stderr[-300:]])[-1]
print("RESULT " + json.dumps({"listeners": listeners, "worker_pids": pids, "auth": check_token_auth(True),
                              "auth_mode_env": os.environ.get("RAY_AUTH_MODE"), "probes": probes}))
ray.shutdown()
"""


@pytest.fixture(scope="module")
def ray_run():
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", RUN], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"the Ray run failed (rc {r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped  # [::ffff:127.0.0.1], as gRPC binds
    return addr.is_loopback


def test_every_listener_of_the_ray_tree_is_on_loopback(ray_run):
    listeners = ray_run["listeners"]
    names = {name for _, name, _, _, _ in listeners}
    # the whole tree was seen: the GCS, the raylet, both agents, and the task's and actor's workers
    assert {"gcs_server", "raylet"} <= names, listeners
    assert any("DashboardAgent" in n or "DashboardA" in n for n in names), listeners
    assert any("RuntimeEnv" in n for n in names), listeners
    worker_pids = {pid for pid, *_ in listeners}
    assert set(ray_run["worker_pids"]) <= worker_pids, (ray_run["worker_pids"], listeners)
    outside = [entry for entry in listeners if not _loopback(entry[2])]
    assert outside == [], f"Ray processes listening beyond loopback (pid, name, address, port, kind): {outside}"


def test_token_authentication_is_on_and_refuses_other_clients(ray_run):
    assert ray_run["auth"] == "token" and ray_run["auth_mode_env"] == "token"
    probes = ray_run["probes"]
    assert probes["wrong_token"] == "REFUSED AuthenticationError", probes
    assert probes["no_token"] == "REFUSED AuthenticationError", probes
    assert probes["own_token"] == "ANSWERED", probes  # the probe itself works: the refusals are the token's


def test_loopback_check_itself():
    assert _loopback("127.0.0.1") and _loopback("::1") and _loopback("::ffff:127.0.0.1")
    assert not _loopback("0.0.0.0") and not _loopback("::") and not _loopback("192.0.2.2")
