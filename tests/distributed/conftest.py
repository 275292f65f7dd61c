"""Distributed tests: one local Ray cluster of 2 CPUs shared by the whole module that asks for it."""

from contextlib import contextmanager

import pytest
import torch

from tests.conftest import ray_init_local

torch.set_num_threads(1)


#: the shared 2-CPU cluster (re-made after a module that declared GPUs, if it was up); ray_init_local: a new
#: cluster (even where a stopped ``ray start --head`` left its address behind), on 127.0.0.1 only
SHARED_INIT = dict(num_cpus=2)


@pytest.fixture(scope="session")
def ray_cluster(ray_module):
    ray = ray_module  # skipped without Ray locally, failed in CI (tests/conftest.py)
    if not ray.is_initialized():
        ray_init_local(ray, **SHARED_INIT)
    yield ray
    ray.shutdown()


@contextmanager
def declared_gpus(ray, num_cpus: int, num_gpus: int):
    """A Ray cluster that declares ``num_gpus`` GPUs (Ray accepts declared resources; nothing touches a GPU),
    instead of the shared one, which is given back afterwards if it was up."""
    was_up = ray.is_initialized()
    if was_up:
        ray.shutdown()
    ray_init_local(ray, num_cpus=num_cpus, num_gpus=num_gpus)
    try:
        yield ray
    finally:
        ray.shutdown()
        if was_up:
            ray_init_local(ray, **SHARED_INIT)
