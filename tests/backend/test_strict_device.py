"""Strict-device mode (issue 30, bug 1): a host tensor handed to a collective fails on CPU as it would on NCCL.

The suite runs with ``RLHFORGE_STRICT_DEVICE=1`` (tests/conftest.py), so every torchrun and Ray test
of the strategies and the weight sync goes through these checks too."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from rlhforge.backend import strict_device
from rlhforge.backend.strict_device import StrictDeviceError


@pytest.fixture
def strict(monkeypatch):
    monkeypatch.setenv(strict_device.ENV, "1")


def test_the_suite_runs_in_strict_mode():
    assert strict_device.enabled(), "tests/conftest.py sets RLHFORGE_STRICT_DEVICE=1 for the suite"


def test_check_refuses_a_tensor_not_placed_for_the_group(strict):
    with pytest.raises(StrictDeviceError, match="not put on the group's device"):
        strict_device.check(torch.tensor(1.0), "gloo", "here")
    strict_device.check(strict_device.place(torch.tensor(1.0), "cpu"), "gloo", "here")  # placed: fine


def test_check_refuses_a_host_tensor_on_nccl_whatever_its_mark(strict):
    placed = strict_device.place(torch.tensor(1.0), "cpu")
    with pytest.raises(StrictDeviceError, match="a cpu tensor in a nccl collective \\(needs cuda\\)"):
        strict_device.check(placed, "nccl", "all_reduce")


def test_off_means_plain_moves_and_no_checks(monkeypatch):
    monkeypatch.setenv(strict_device.ENV, "0")
    t = strict_device.place(torch.tensor([2.0]), "cpu")
    assert not hasattr(t, "_rlhforge_on_group_device")
    strict_device.check(torch.tensor(1.0), "nccl", "x")  # nothing raised


def test_backend_device_types():
    assert strict_device.backend_device_type("nccl") == "cuda"
    assert strict_device.backend_device_type("gloo") == "cpu"
    assert strict_device.backend_device_type("cpu:gloo,cuda:nccl") is None


# One gloo process group (world 1) in a child process: the wrappers around torch.distributed and the
# strategies' all-reduce, as a multi-rank run calls them. The group's world is 1, so sums are the inputs.
CHILD = textwrap.dedent("""
    import json, sys, tempfile, torch, torch.distributed as dist
    from rlhforge.backend.device import init_process_group
    from rlhforge.backend.strategy import all_reduce_tensor
    store = tempfile.mktemp()
    dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
    init_process_group(torch.device("cpu"))  # installs the strict wrappers (the group exists already)
    out = {}
    # bug 1's class: a call site in rlhforge that hands a host tensor straight to the collective
    fake_module = {"__name__": "rlhforge.trainers.example", "dist": dist, "torch": torch}
    try:
        exec("dist.all_reduce(torch.tensor(1.0))", fake_module)
        out["direct_from_rlhforge"] = "passed"
    except Exception as err:
        out["direct_from_rlhforge"] = type(err).__name__ + ": " + str(err)
    dist.all_reduce(torch.tensor(1.0))  # not from rlhforge (DeepSpeed, torch, this script): not checked
    # the fixed seam: a host tensor is placed on the group's device, the result returns on the input's
    r = all_reduce_tensor(torch.tensor([3.0, 4.0]), "sum", 2)
    m = all_reduce_tensor(torch.tensor([3.0, 4.0]), "mean", 2)
    out["sum"], out["mean"], out["device"] = r.tolist(), m.tolist(), str(r.device)
    print("RESULT", json.dumps(out))
    dist.destroy_process_group()
""")


def test_rlhforge_collectives_are_checked_and_the_seam_places_tensors():
    env = dict(os.environ, RLHFORGE_STRICT_DEVICE="1")
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["direct_from_rlhforge"].startswith("StrictDeviceError"), out
    assert "rlhforge.trainers.example" in out["direct_from_rlhforge"]
    assert out["sum"] == [3.0, 4.0]  # a world of one: the sum is the input
    assert out["mean"] == [1.5, 2.0]  # mean divides by the world size the caller names
    assert out["device"] == "cpu"


def test_weight_sync_broadcast_checks_its_buffers(strict):
    from rlhforge.backend.collective import _broadcast

    class FakeGloo:  # the group object's class name tells the backend, as ProcessGroupGloo's does
        def broadcast(self, tensor, root):
            raise AssertionError("must be refused before it reaches the group")

    FakeGloo.__name__ = "ProcessGroupNCCL"
    with pytest.raises(StrictDeviceError, match="weight-sync broadcast: a cpu tensor in a nccl collective"):
        _broadcast(FakeGloo(), strict_device.place(torch.zeros(4, dtype=torch.uint8), "cpu"))
