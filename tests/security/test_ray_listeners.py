"""Issue 46, item 5: the local Ray cluster rlhforge starts (``distributed.launch.init_ray``) listens on
loopback only, and its token authentication is on and refuses a client without the token.

The run is a child process (a fresh driver, as ``rlhforge rl --train.workers ray`` is): it starts the
cluster through ``init_ray``, runs a task, an actor, and a two-rank worker group whose ranks open their
torch process group as rlhforge's workers do (``RayWorkerGroup`` + ``backend.device.init_process_group``),
then lists every listening socket (TCP LISTEN, bound UDP) of its own process tree with psutil, as
``ss -ltnp`` / ``ss -lunp`` show them, and probes the GCS with a wrong token, no token, and the
cluster's own token. On ``89172c3`` (before ``keep_loopback`` covered the local cluster) the list held
the GCS, the raylet, the workers and the driver on ``::``, two helper processes on ``0.0.0.0`` and the
dashboard and runtime-env agents on the machine's address; and rank 0's torch store on ``::``.
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

import torch
from ray.util.placement_group import placement_group
from rlhforge.distributed.ray_group import RayWorkerGroup

init_ray(num_cpus=2)

@ray.remote
def task():
    return os.getpid()

@ray.remote(num_cpus=0)
class Actor:
    def pid(self):
        return os.getpid()

class Rank:  # a model rank as rlhforge's workers open it: torch.distributed through backend.device
    def __init__(self):
        import torch.distributed as dist
        from rlhforge.backend.device import init_process_group, single_process_env
        if os.environ["WORLD_SIZE"] == "1":
            single_process_env()  # as DeepSpeed / FSDP2 do for a one-rank group
        init_process_group(torch.device("cpu"), force=True)
        t = torch.ones(1)
        dist.all_reduce(t)
        self.total = t.item()

    def pid(self):
        return os.getpid(), self.total, os.environ.get("GLOO_SOCKET_IFNAME")

actor = Actor.remote()
ray.get(task.remote())  # a task's worker (Ray may reuse or end it afterwards: not looked for below)
pids = [ray.get(actor.pid.remote())]
pg = placement_group([{"CPU": 1}, {"CPU": 1}])
ray.get(pg.ready())
group = RayWorkerGroup("probe", Rank, (), num_workers=2, pg=pg, share=0.5, device="cpu")
ranks = group._get([h.run.remote("pid", (), {}) for h in group.hosts], "pid")
assert [total for _, total, _ in ranks] == [2.0, 2.0], ranks
from rlhforge.backend.collective import loopback_gloo_env
loopback_if = os.environ.get("GLOO_SOCKET_IFNAME") or loopback_gloo_env()["GLOO_SOCKET_IFNAME"]  # lo on Linux
assert [ifname for _, _, ifname in ranks] == [loopback_if] * 2, ranks  # gloo's pair sockets on the loopback interface
pids += [pid for pid, _, _ in ranks]
single = RayWorkerGroup("single", Rank, (), num_workers=1, pg=pg, share=0.5, device="cpu")
(rank,) = single._get([h.run.remote("pid", (), {}) for h in single.hosts], "pid")
assert rank[1] == 1.0, rank
pids.append(rank[0])
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
token_file = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
token_mode = oct(os.stat(token_file).st_mode & 0o777) if os.path.exists(token_file) else None
print("RESULT " + json.dumps({"listeners": listeners, "worker_pids": pids, "auth": check_token_auth(True),
                              "token_mode": token_mode,
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
    # the whole tree was seen: the GCS, the raylet, both agents, the actor's and the two ranks' workers
    assert {"gcs_server", "raylet"} <= names, listeners
    assert any("DashboardAgent" in n or "DashboardA" in n for n in names), listeners
    assert any("RuntimeEnv" in n for n in names), listeners
    worker_pids = {pid for pid, *_ in listeners}
    assert set(ray_run["worker_pids"]) <= worker_pids, (ray_run["worker_pids"], listeners)
    # the two model ranks: Ray's gRPC server, gloo's pair, and on rank 0 the process group's store
    rank_ports = [[e for e in listeners if e[0] == pid] for pid in ray_run["worker_pids"][1:3]]
    assert min(len(r) for r in rank_ports) >= 2 and max(len(r) for r in rank_ports) >= 3, rank_ports
    # the one-rank group (its own store, as DeepSpeed and FSDP2 open one for a single rank)
    assert len([e for e in listeners if e[0] == ray_run["worker_pids"][3]]) >= 2, listeners
    outside = [entry for entry in listeners if not _loopback(entry[2])]
    assert outside == [], f"Ray processes listening beyond loopback (pid, name, address, port, kind): {outside}"


def test_token_authentication_is_on_and_refuses_other_clients(ray_run):
    assert ray_run["auth"] == "token" and ray_run["auth_mode_env"] == "token"
    assert ray_run["token_mode"] == "0o600", ray_run["token_mode"]  # Ray wrote it 0644: readable by every user
    probes = ray_run["probes"]
    assert probes["wrong_token"] == "REFUSED AuthenticationError", probes
    assert probes["no_token"] == "REFUSED AuthenticationError", probes
    assert probes["own_token"] == "ANSWERED", probes  # the probe itself works: the refusals are the token's


def test_weight_sync_group_store_listens_on_loopback():
    """A weight-sync group on one machine (backend.collective.open_group at 127.0.0.1): rank 0's store
    server on 127.0.0.1, not on every interface as torch would bind it."""
    import threading

    from rlhforge.backend.collective import free_port, open_group

    before = {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet") if c.status == "LISTEN"}
    port, groups = free_port(), {}

    def member(rank):
        groups[rank] = open_group("127.0.0.1", port, rank, 2, "gloo", 30)

    threads = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert sorted(groups) == [0, 1]
    now = {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet") if c.status == "LISTEN"}
    new = now - before
    assert (("127.0.0.1", port) in new) and all(_loopback(ip) for ip, _ in new), new


def test_loopback_check_itself():
    assert _loopback("127.0.0.1") and _loopback("::1") and _loopback("::ffff:127.0.0.1")
    assert not _loopback("0.0.0.0") and not _loopback("::") and not _loopback("192.0.2.2")


ONE_PROCESS = r"""
import json, os, psutil, torch
import torch.distributed as dist
from rlhforge.backend.device import init_process_group, single_process_env

single_process_env()
out = {}
for attempt in range(2):  # made, torn down and made again in one process (an in-process vLLM engine does that)
    init_process_group(torch.device("cpu"), force=True)
    t = torch.ones(1)
    dist.all_reduce(t)
    out[f"sum{attempt}"] = t.item()
    dist.destroy_process_group()
    single_process_env()
import deepspeed
from rlhforge.backend.device import one_rank_store
with one_rank_store():
    deepspeed.init_distributed(dist_backend="gloo")
t = torch.ones(1)
dist.all_reduce(t)
out["deepspeed_sum"] = t.item()
out["agent_store_env_after"] = os.environ.get("TORCHELASTIC_USE_AGENT_STORE")
out["listeners"] = sorted({c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == "LISTEN"})
print("RESULT " + json.dumps(out))
"""


def test_one_process_group_outside_ray_listens_on_loopback():
    """A plain process's one-rank group (sft / rm / dpo, rl --train.workers local: backend.device), through torch
    and through DeepSpeed, twice in one process: every listener on loopback (torch's own store was on ::), and
    the store switch is not left in the environment for child processes."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                                            "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", ONE_PROCESS], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=180)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["sum0"] == out["sum1"] == out["deepspeed_sum"] == 1.0, out
    assert out["listeners"] and all(_loopback(ip) for ip in out["listeners"]), out["listeners"]
    assert out["agent_store_env_after"] is None


def test_token_authentication_turned_off_on_purpose_is_one_warning_line():
    """RAY_AUTH_MODE=disabled: the local cluster starts (the user's choice) and init_ray says once what that
    means; check_token_auth reports it."""
    code = ("from rlhforge.distributed.launch import init_ray\n"
            "from ray._private.authentication.authentication_utils import is_token_auth_enabled\n"
            "import ray\ninit_ray(num_cpus=1)\nprint('TOKEN', is_token_auth_enabled())\nray.shutdown()\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled", PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and "TOKEN False" in r.stdout, (r.stdout[-1000:], r.stderr[-2000:])
    warnings = [ln for ln in r.stderr.splitlines() if ln.startswith("warning: RAY_AUTH_MODE=disabled")]
    assert len(warnings) == 1 and "every local user" in warnings[0], r.stderr[-2000:]
