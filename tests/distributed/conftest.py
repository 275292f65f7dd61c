"""Distributed tests: one local Ray cluster of 2 CPUs shared by the whole module that asks for it."""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ray_cluster(ray_module):
    ray = ray_module  # skipped without Ray locally, failed in CI (tests/conftest.py)
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
    yield ray
    ray.shutdown()
