"""``init_ray`` without ``RAY_ADDRESS`` (issue 47, item 6): a ``ray start --head`` that was stopped or
crashed leaves Ray's ``ray_current_cluster`` file behind; a plain ``ray.init()`` attached to it and
rlhforge's ``num_cpus`` then failed with a raw ``ValueError`` ("When connecting to an existing cluster,
num_cpus and num_gpus must not be provided"). init_ray starts a new local cluster instead, listening on
127.0.0.1 only.

Runs in a child process (this process may already hold the suite's shared cluster, and init_ray returns
early then) with its own Ray temp folder (``RAY_TMPDIR``), so no other test's Ray is touched."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys
import psutil, ray
from rlhforge.distributed.launch import init_ray

init_ray(num_cpus=1)
try:
    assert ray.get(ray.remote(lambda: 41).remote()) == 41  # the cluster works: a task ran on a worker
    me = psutil.Process()
    listening = []
    for p in [me, *me.children(recursive=True)]:  # the driver and the cluster it started (gcs, raylet, workers)
        try:
            listening += [[p.name(), c.laddr.ip, c.laddr.port] for c in p.net_connections(kind="inet")
                          if c.status == psutil.CONN_LISTEN]
        except psutil.Error:
            pass
    print("RESULT " + json.dumps({"gcs": ray.get_runtime_context().gcs_address, "listening": listening}))
finally:
    ray.shutdown()
"""


@pytest.fixture
def ray_tmpdir():
    """A short Ray temp folder (Ray's socket paths must stay under ~107 characters) holding a stale
    ``ray/ray_current_cluster`` that names a dead address, as a stopped ``ray start --head`` leaves it."""
    folder = Path(tempfile.mkdtemp(prefix="rr", dir="/tmp"))
    (folder / "ray").mkdir()
    (folder / "ray" / "ray_current_cluster").write_text("127.0.0.1:1\n")  # port 1: nothing listens there
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_stale_ray_session_file_does_not_stop_a_local_cluster(ray_module, ray_tmpdir):
    env = {**os.environ, "RAY_TMPDIR": str(ray_tmpdir), "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    result = json.loads(next(line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")))
    assert result["gcs"].startswith("127.0.0.1:") and result["gcs"] != "127.0.0.1:1"  # a new cluster, on loopback
    names = {name for name, _, _ in result["listening"]}
    assert {"gcs_server", "raylet"} <= names, result["listening"]
    exposed = [x for x in result["listening"] if x[1] not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
    assert exposed == [], f"the local cluster listens beyond loopback: {exposed}"


@pytest.mark.parametrize("address", [None, "10.0.0.7:6379"])
def test_a_cluster_that_cannot_be_reached_is_one_line_naming_ray_address(ray_module, monkeypatch, address):
    """What Ray raises when it cannot reach (or start) a cluster becomes a one-line ConfigError (exit 2)
    naming RAY_ADDRESS. (Ray itself takes minutes to give up on a dead address, hence the stand-in.)"""
    from rlhforge.config.parsing import ConfigError
    from rlhforge.distributed.launch import init_ray

    calls = []

    def refuse(**kwargs):
        calls.append(kwargs)
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.7:6379\n(and Ray's own details)")

    monkeypatch.setattr(ray_module, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_module, "init", refuse)
    if address is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", address)
    with pytest.raises(ConfigError) as err:
        init_ray(num_cpus=1)
    message = str(err.value)
    assert "\n" not in message and "RAY_ADDRESS" in message and "Failed to connect" in message
    if address is None:
        assert calls[0]["address"] == "local" and "not set" in message  # never the address Ray remembers
    else:
        assert calls[0]["address"] == address and f"RAY_ADDRESS={address}" in message and "num_cpus" not in calls[0]
