"""gpu-review-2 (../shared/reference/gpu-review-2.md) findings F1 (restart), F3, F4, F6, F7, F8, F9 and F12,
each pinned on CPU through the seam the GPU path uses: the attention selector with a dtype, the start-up rules,
the device variables a Ray actor sets under RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, node-ordered bundles,
the IPC sync's error classes with real Ray actors, the restarted engine's sleep, the fp32 master move."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from rlhforge.cli.train_ppo_ray import parse_rl_args
from rlhforge.config.parsing import ConfigError
from tests.distributed.conftest import declared_gpus
from tests.rl.helpers import rl_args


@pytest.fixture(scope="module")
def gpu2_cluster(ray_module):
    """Ray declared with 2 GPUs for the module (tests/distributed/conftest.py)."""
    with declared_gpus(ray_module, num_cpus=2, num_gpus=2) as ray:
        yield ray


def _cfg(tmp_path, *extra, validate=True):
    return parse_rl_args(rl_args("/nonexistent/model", tmp_path / "run", *extra), validate=validate)


# ------------------------------------------------------------------------------------------------ F3
def test_auto_attention_picks_flash_attention_for_half_precision_only(monkeypatch):
    """flash-attn takes fp16/bf16 only: an fp32 run (``--ds.param_dtype fp32``) gets sdpa even where it imports."""
    from rlhforge.models.loading import default_attn_implementation

    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))  # "installed"
    cuda = torch.device("cuda", 0)
    assert default_attn_implementation("auto", cuda, "bf16") == "flash_attention_2"
    assert default_attn_implementation("auto", cuda, "fp16") == "flash_attention_2"
    assert default_attn_implementation("auto", cuda, "auto") == "flash_attention_2"  # auto is bf16 on CUDA
    assert default_attn_implementation("auto", cuda, "fp32") == "sdpa"
    assert default_attn_implementation("auto", torch.device("cpu"), "bf16") == "sdpa"
    assert default_attn_implementation("eager", cuda, "fp32") == "eager"  # explicit choices pass through
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed
    assert default_attn_implementation("auto", cuda, "bf16") == "sdpa"


def test_explicit_flash_attention_with_fp32_is_refused_at_start_up(tmp_path):
    from rlhforge.config.parsing import parse_args
    from rlhforge.config.sft import SFTConfig

    with pytest.raises(ConfigError, match=r"--ds.attn_implementation flash_attention_2 needs bf16 or fp16 training, "
                                          r"but this run trains in fp32 \(--ds.param_dtype fp32\)"):
        parse_rl_args(rl_args("/nonexistent/model", tmp_path / "run", "--ds.attn_implementation", "flash_attention_2",
                              "--ds.param_dtype", "fp32"))
    with pytest.raises(ConfigError, match=r"fp32 \(--ds.param_dtype auto, which is fp32 off CUDA\)"):
        parse_args(SFTConfig, ["--model.model_name_or_path", "x", "--data.dataset", "builtin:arithmetic",
                               "--ds.attn_implementation", "flash_attention_2", "--train.device", "cpu"])
    cfg = parse_rl_args(rl_args("/nonexistent/model", tmp_path / "run", "--ds.attn_implementation",
                                "flash_attention_2", "--ds.param_dtype", "bf16"), validate=False)
    from rlhforge.config.validation import check_flash_attention_dtype

    check_flash_attention_dtype(cfg.ds, "cuda")  # bf16: accepted


# ------------------------------------------------------------------------------------------------ F4
def test_noset_cuda_visible_devices_gives_each_actor_its_own_gpu():
    from rlhforge.distributed.ray_group import NOSET_ENV, device_env_for

    assert device_env_for({}, [3]) == {}  # Ray narrowed CUDA_VISIBLE_DEVICES itself: cuda:0 is the actor's GPU
    assert device_env_for({NOSET_ENV: "0"}, [3]) == {}
    assert device_env_for({NOSET_ENV: "1"}, [3]) == {"LOCAL_RANK": "3"}  # a rank: set_device(3)
    assert device_env_for({NOSET_ENV: "true"}, ["5"]) == {"LOCAL_RANK": "5"}
    assert device_env_for({NOSET_ENV: "1"}, [3], engine=True) == {"CUDA_VISIBLE_DEVICES": "3"}  # vLLM on cuda:0
    assert device_env_for({NOSET_ENV: "1"}, ["GPU-1a2b"]) == {"CUDA_VISIBLE_DEVICES": "GPU-1a2b", "LOCAL_RANK": "0"}
    assert device_env_for({NOSET_ENV: "1"}, []) == {}  # a CPU actor


class EnvReader:
    """A worker built inside a WorkerHost (as ActorWorker is), reporting what its process sees."""

    def env(self, name: str):
        import os

        return os.environ.get(name)


def test_a_ray_worker_under_noset_takes_its_own_gpu_index(gpu2_cluster):
    """Real Ray actors on declared GPUs (no CUDA touched): under the NOSET variable rank 1's host sets
    LOCAL_RANK to the GPU Ray gave it, not 0; without it LOCAL_RANK stays 0 (Ray narrowed the devices)."""
    import ray

    from rlhforge.distributed.ray_group import NOSET_ENV, WorkerHost

    remote = ray.remote(WorkerHost)
    seen = []
    for env in ({NOSET_ENV: "1", "LOCAL_RANK": "0"}, {"LOCAL_RANK": "0"}):
        hosts = [remote.options(num_gpus=1, num_cpus=0).remote(dict(env)) for _ in range(2)]
        try:
            ray.get([h.build.remote(EnvReader, (), {}) for h in hosts])
            ranks = ray.get([h.run.remote("env", ("LOCAL_RANK",), {}) for h in hosts])
            ids = ray.get([h.run.remote("env", ("CUDA_VISIBLE_DEVICES",), {}) for h in hosts])
        finally:
            for h in hosts:
                ray.kill(h)
        seen.append((sorted(ranks), ids))
    noset, normal = seen
    assert noset[0] == ["0", "1"]  # each on its own GPU (Ray left CUDA_VISIBLE_DEVICES alone)
    assert normal[0] == ["0", "0"] and sorted(normal[1]) == ["0", "1"]  # Ray narrowed it: cuda:0 is its own


# ------------------------------------------------------------------------------------------------ F7
def test_bundles_are_ordered_by_node():
    from rlhforge.distributed.ray_group import bundle_index, bundles_by_node

    table = {"bundles": {i: {"GPU": 1} for i in range(6)},
             "bundles_to_node_id": {0: "nodeA", 1: "nodeB", 2: "nodeA", 3: "nodeB", 4: "nodeA", 5: "nodeB"}}
    assert bundles_by_node(table) == [0, 2, 4, 1, 3, 5]  # a TP-2 engine on "bundles 0-1" stays on nodeA
    one = {"bundles": {i: {} for i in range(3)}, "bundles_to_node_id": {0: "n", 1: "n", 2: "n"}}
    assert bundles_by_node(one) == [0, 1, 2]

    class PG:
        rlhforge_bundle_order = [0, 2, 4, 1, 3, 5]

    assert [bundle_index(PG(), i) for i in range(6)] == [0, 2, 4, 1, 3, 5]
    assert bundle_index(object(), 4) == 4  # a group made elsewhere: as numbered


def test_created_placement_groups_know_their_node_order(gpu2_cluster):
    from ray.util.placement_group import remove_placement_group

    from rlhforge.distributed.placement import plan_placement
    from rlhforge.distributed.ray_group import create_placement_groups

    pgs = create_placement_groups(plan_placement({"actor": 2}, device="cpu"))
    try:
        assert pgs["actor"].rlhforge_bundle_order == [0, 1]  # one node: unchanged
    finally:
        for pg in pgs.values():
            remove_placement_group(pg)


# ------------------------------------------------------------------------------------------------ F6
class _Engine:
    def __init__(self, mode: str):
        self.mode = mode

    def ready(self):
        return True

    def load_ipc(self):
        import os
        import time

        if self.mode == "error":
            raise ValueError("no CUDA-IPC handle for GPU GPU-9 (engine worker rank 0)")
        if self.mode == "die":
            os._exit(1)
        if self.mode == "hang":
            time.sleep(60)
        return 1


def test_ipc_sync_restarts_dead_or_hung_engines_and_raises_the_rest(gpu2_cluster):
    """A dead or hung engine is a fault (restart); a deterministic error is raised (no restart loop)."""
    import ray

    from rlhforge.workers.ipc_sync import IPCSyncError, collect_engine_results

    remote = ray.remote(num_cpus=0, max_restarts=0)(_Engine)
    engines = {i: remote.remote(m) for i, m in enumerate(["ok", "error", "die", "hang"])}
    try:
        ray.get([e.ready.remote() for e in engines.values()], timeout=120)  # started (the deadline is the calls')
        faults, errors = collect_engine_results({i: e.load_ipc.remote() for i, e in engines.items()}, timeout_s=8.0)
    finally:
        for e in engines.values():
            ray.kill(e)
    assert sorted(faults) == [2, 3] and faults[2].startswith("ActorDiedError") and "Timeout" in faults[3]
    assert errors == {1: "ValueError: no CUDA-IPC handle for GPU GPU-9 (engine worker rank 0)"}
    assert "not from a dead or hung engine (no restart): vLLM engine 1: ValueError" in str(
        IPCSyncError("vLLM engine 1: ValueError: x"))


# ------------------------------------------------------------------------------------------------ F1
class _SleepyEngine:
    def __init__(self):
        self.calls = []

    def pid(self):
        import os

        return os.getpid()

    def node_id(self):
        return "n"

    def sleep(self):
        self.calls.append("sleep")

    def wake_up(self):
        self.calls.append("wake_up")

    def history(self):
        return self.calls


def test_a_restarted_engine_goes_back_to_sleep_while_the_others_sleep(gpu2_cluster):
    """gpu-review-2 F1: a colocated engine restarted while the models train must not hold its KV cache."""
    import ray

    from rlhforge.distributed.engine_actors import EngineActors

    remote = ray.remote(num_cpus=0, max_restarts=0)(_SleepyEngine)
    actors = EngineActors(lambda i: remote.remote(), 1, enable_sleep=True, max_restarts=3, timeout_s=30,
                          sync_timeout_s=30)
    try:
        actors.sleep()
        e = actors.engines[0]
        first = e.handle
        actors._fail(e, "RayActorError: died", load=False)
        assert e.alive and e.handle is not first and ray.get(e.handle.history.remote()) == ["sleep"]
        actors.wake_up()
        actors._fail(e, "RayActorError: died", load=False)  # during generation: it stays awake
        assert ray.get(e.handle.history.remote()) == []
    finally:
        actors.close()


# ------------------------------------------------------------------------------------------------ F8
def test_zero3_master_partitions_are_found_and_skipped_where_they_already_are():
    """The byte move itself needs a GPU (CPU -> CPU moves nothing); what DeepSpeed's ZeRO-3 sleep asks for, with
    the master partitions, is checked on a real one-rank ZeRO-3 engine by tests/rl/test_sleep.py."""
    from rlhforge.backend.sleep import move_master_weights

    flats = [torch.nn.Parameter(torch.ones(6)), torch.nn.Parameter(torch.zeros(4))]

    class Zero3:
        fp32_partitioned_groups_flat = flats

    assert move_master_weights(Zero3(), "cpu") == 0  # already in host memory
    assert move_master_weights(object(), "cpu") == 0  # not ZeRO-3: nothing to move


# ------------------------------------------------------------------------------------------------ F9
def test_bf16_optimizer_has_no_offload_so_sleep_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"--ds.enable_sleep with --ds.zero_stage 1, bf16 and --ds.grad_accum_dtype "
                                          r"fp32: DeepSpeed trains that combination with its BF16_Optimizer"):
        _cfg(tmp_path, "--ds.strategy", "deepspeed", "--ds.zero_stage", "1", "--ds.param_dtype", "bf16",
             "--ds.grad_accum_dtype", "fp32", "--ds.enable_sleep")
    for ok in (["--ds.zero_stage", "2"], ["--ds.adam_offload"], []):  # ZeRO-2, CPU offload, bf16 accumulation
        extra = ["--ds.grad_accum_dtype", "fp32"] if ok else []
        _cfg(tmp_path, "--ds.strategy", "deepspeed", "--ds.zero_stage", "1", "--ds.param_dtype", "bf16",
             "--ds.enable_sleep", *extra, *ok)


# ------------------------------------------------------------------------------------------------ F12
def test_expandable_segments_with_ipc_sync_is_refused(tmp_path, monkeypatch):
    from rlhforge.config.rl_workers import _refuse_expandable_segments

    cfg = _cfg(tmp_path, "--train.colocate_all", "--vllm.num_engines", "2", "--train.device", "cuda",
               "--actor.num_gpus_per_node", "2", validate=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:True")
    with pytest.raises(ConfigError, match=r"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True with "
                                          r"--train.colocate_all: the engines load the weights by CUDA IPC"):
        _refuse_expandable_segments(cfg)
    with_ray = _cfg(tmp_path, "--train.colocate_all", "--vllm.num_engines", "2", "--train.device", "cuda",
                    "--actor.num_gpus_per_node", "2", "--vllm.sync_with_ray", validate=False)
    _refuse_expandable_segments(with_ray)  # through the object store: no IPC
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    _refuse_expandable_segments(cfg)
