"""The host allocator's thresholds (rlhforge/backend/host_memory.py): with them, the HF engine's sampling steps
at a 151,936-token vocabulary reuse freed blocks instead of page-faulting every page of their tensors again;
the settings reach child processes through GLIBC_TUNABLES; the user's own settings are left alone."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

import pytest

from rlhforge.backend import host_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux)")

_STEPS = r"""
import resource, sys, torch
from rlhforge.backend.host_memory import tune_host_allocator
from rlhforge.rollout.hf_generate import sample_batch, seed_keys
torch.set_num_threads(1)
if sys.argv[1] == "call":
    assert tune_host_allocator()
B, V = 16, 151936
head = torch.nn.Linear(32, V, bias=False)
ones, keys, no_k = torch.ones(B), seed_keys(range(B)), torch.full((B,), -1)
def steps(n, first):
    for step in range(first, first + n):
        with torch.no_grad():
            logits = head(torch.randn(B, 32))
        sample_batch(logits, ones, ones, no_k, keys, step, all_greedy=False, any_filter=False, any_greedy=False)
steps(3, 0)  # warm-up: the heap grows to the step's size
faults = []
for step in range(3, 13):
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    steps(1, step)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
print(*faults)
"""


def _faults_per_step(mode: str, **env) -> list[int]:
    environ = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "RLHFORGE_MALLOC")}
    out = subprocess.run([sys.executable, "-c", _STEPS, mode], env={**environ, **env}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return [int(n) for n in out.stdout.split()]


def test_sampling_steps_stop_page_faulting_with_the_thresholds():
    """One step's logits, log-probs and probabilities are 4 x 9.7 MB (2,400 pages each). glibc's own thresholds
    hand them back and fault them in again every step; with the thresholds set by a call in the process, or by
    GLIBC_TUNABLES in a child's environment (the same two values), a step after the warm-up faults almost no
    page. The heap's free space may still settle for a few steps (seen: one step in ten, at random, grows the
    heap by one 9.7 MB block, 2,374 pages), so the check is on the median step and on the ten steps' total."""
    system = _faults_per_step("none", RLHFORGE_MALLOC="system")
    called = _faults_per_step("call")
    inherited = _faults_per_step("none", GLIBC_TUNABLES=host_memory.tunables())
    assert statistics.median(system) > 4000, system  # the premise: glibc's defaults map and unmap these blocks
    for tuned in (called, inherited):
        assert statistics.median(tuned) < 100, (tuned, system)
        assert sum(tuned) < sum(system) / 4, (tuned, system)


def test_the_users_settings_and_the_opt_out_are_left_alone():
    env = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert host_memory.tune_host_allocator(env) is False and env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    env = {"RLHFORGE_MALLOC": "system"}
    assert host_memory.tune_host_allocator(env) is False and "GLIBC_TUNABLES" not in env
    assert host_memory.tunables() == "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=268435456"
