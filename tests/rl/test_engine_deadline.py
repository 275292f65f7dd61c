"""An engine actor that dies during a weight sync (``--vllm.sync_timeout_s``): the driver restarts it,
every engine ends the sync holding the current weights, the sync returns within the deadline (no
raise, no 30-minute wait in the collective), and the next sync rebuilds the group and reaches both.

Real pieces: two vLLM CPU engines as Ray actors (EngineHost), the driver's EngineActors, a Ray worker
group whose rank 0 is the sender over a real gloo sync group (rlhforge.backend.collective.SyncGroup).
The sender serves the tiny model's weights (a trainer's rank 0 serves its model's the same way: the
three methods EngineActors calls) so that the test needs no DeepSpeed start-up."""

import time

import pytest

from rlhforge.distributed.engine_actors import EngineActors, EngineHost

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.usefixtures("vllm")]

SYNC_TIMEOUT_S = 6.0


class Sender:
    """Rank 0's side of the engines' weight sync (the methods of ActorWorker the driver calls)."""

    def __init__(self, model_dir: str):
        from safetensors.torch import load_file

        self.state = load_file(f"{model_dir}/model.safetensors")
        if "lm_head.weight" not in self.state:
            self.state["lm_head.weight"] = self.state["model.embed_tokens.weight"]
        self.state = {k: v.float() for k, v in self.state.items()}
        self._sender = None

    def step(self, scale: float) -> str:
        """A new version of the weights; returns their fingerprint."""
        from rlhforge.backend.collective import state_fingerprint

        self.state = {k: v * scale for k, v in self.state.items()}
        return state_fingerprint(self.state)

    def open_weight_channel(self, host, port, world_size, bucket_bytes, backend="gloo", timeout_s=1800.0):
        from rlhforge.backend.collective import SyncGroup

        self._sender = None
        self._sender = SyncGroup(host, port, 0, world_size, backend, "cpu", timeout_s)
        self._bucket_bytes = bucket_bytes

    def send_weights(self) -> int:
        from rlhforge.backend.collective import state_fingerprint

        self._sent = state_fingerprint(self.state)
        return self._sender.send(self.state, self._bucket_bytes)

    def engine_state_dict(self):
        from rlhforge.backend.collective import state_fingerprint

        self._sent = state_fingerprint(self.state)
        return self.state

    def sent_fingerprint(self) -> str:
        """What the last sync sent (the driver checks every engine's report against it)."""
        return self._sent


@pytest.fixture(scope="module")
def ray_local(ray_module):
    ray = ray_module
    if not ray.is_initialized():
        from tests.conftest import ray_init_local

        ray_init_local(ray, num_cpus=2)
    yield ray
    ray.shutdown()


def _engines(ray, model_dir, n=2):
    remote = ray.remote(EngineHost)
    env = {"RLHFORGE_RAY_WORKER": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    kwargs = dict(max_model_len=64, in_process=True, kv_cache_bytes=16 << 20, bucket_mb=1)

    def spawn(i):
        return remote.options(num_cpus=0.5, max_restarts=0, max_concurrency=4).remote(env, str(model_dir),
                                                                                          dict(kwargs, seed=i))

    return EngineActors(spawn, n, backend="gloo", bucket_bytes=1 << 20, max_restarts=1, timeout_s=240.0,
                        sync_timeout_s=SYNC_TIMEOUT_S)


def test_an_engine_killed_before_a_sync_is_restarted_and_the_next_sync_reaches_both(ray_local, tiny_model_dir):
    ray = ray_local
    from rlhforge.distributed.placement import plan_placement
    from rlhforge.distributed.ray_group import RayWorkerGroup, create_placement_groups

    pg = create_placement_groups(plan_placement({"sender": 1}, device="cpu"))["sender"]
    sender = RayWorkerGroup("sender", Sender, (str(tiny_model_dir),), num_workers=1, pg=pg, share=1.0, device="cpu")
    engines = _engines(ray, tiny_model_dir)
    try:
        engines.fingerprint_syncs = True
        v1 = sender.call("step", 0.5)[0]
        engines.sync_from(sender)  # opens the group
        assert engines.last_fingerprints == [v1, v1]

        v2 = sender.call("step", 2.0)[0]
        victim = engines.engines[0]
        old_handle = victim.handle
        ray.kill(old_handle, no_restart=True)  # dies while still a member of the sync group
        t0 = time.monotonic()
        engines.sync_from(sender)  # no WorkerError: restarted, everyone reloaded
        took = time.monotonic() - t0
        assert victim.restarts == 1 and victim.alive and victim.handle is not old_handle
        assert engines.restarts_total == 1
        assert engines.last_fingerprints == [v2, v2]
        assert ray.get(victim.handle.fingerprint.remote()) == v2
        assert took < 2 * SYNC_TIMEOUT_S + 120, took  # the broken collective's deadline + one engine start

        v3 = sender.call("step", 0.5)[0]
        t0 = time.monotonic()
        engines.sync_from(sender)  # a new group with the restarted engine
        assert engines.last_fingerprints == [v3, v3]
        assert time.monotonic() - t0 < SYNC_TIMEOUT_S
        assert engines.step_metrics()["rollout/engine_restarts"] == 1
    finally:
        engines.close()
        sender.close()
