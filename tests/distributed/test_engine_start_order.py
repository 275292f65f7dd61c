"""Issue 30, bug 3: colocated vLLM engines start before any model loads (as OpenRLHF does). On a GPU, a
vLLM engine checks at start-up that its ``--vllm.gpu_memory_utilization`` share of the device is free,
which it is not once the trainers sit there. Checked on the CPU cluster through the same seam: when the
engine actors are started, no model worker holds any of the placement groups' bundles yet; afterwards
they all do, and the engines serve a generation."""

import asyncio

import pytest

from rlhforge.cli.train_ppo_ray import _vllm_max_model_len, parse_rl_args
from rlhforge.rollout.engine import SamplingParams
from tests.rl.helpers import rl_args

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.usefixtures("vllm")]


def _bundle_use(ray) -> dict[str, float]:
    """CPU taken inside placement-group bundles (``CPU_group_<id>`` resources: total - available)."""
    total, free = ray.cluster_resources(), ray.available_resources()
    return {k: total[k] - free.get(k, 0.0) for k in total if k.startswith("CPU_group_") and k.count("_") == 2}


def test_engines_start_before_the_models_load(ray_cluster, tiny_model_dir, tmp_path):
    import ray

    from rlhforge.config.batching import plan_rl_batches
    from rlhforge.distributed.engine_actors import build_engine_actors
    from rlhforge.distributed.launch import build_ray_groups, close_groups
    from rlhforge.models.loading import load_tokenizer
    from rlhforge.trainers.rl.prompts import load_prompts

    cfg = parse_rl_args(rl_args(tiny_model_dir, tmp_path / "run", "--train.workers", "ray", "--train.colocate_all",
                                "--vllm.num_engines", "1", "--ds.strategy", "torch"))
    tok = load_tokenizer(str(tiny_model_dir))
    prompts, eval_prompts = load_prompts(cfg, tok)
    plan = plan_rl_batches(rollout_batch_size=4, n_samples_per_prompt=2, train_batch_size=4, micro_batch_size=2,
                           rollout_micro_batch_size=8, world_size=1, num_prompts=len(prompts), max_steps=1)
    seen = {}

    def start_engines(placement, pgs):
        seen["before"] = _bundle_use(ray)  # nothing scheduled in the bundles yet
        engines = build_engine_actors(cfg, tok, _vllm_max_model_len(cfg, prompts, eval_prompts), placement, pgs)
        seen["engines"] = _bundle_use(ray)
        return engines

    actor, ref, critic, placement, reward, engine = build_ray_groups(cfg, tok, plan, start_engines)
    try:
        after = _bundle_use(ray)
        assert sum(seen["before"].values()) == 0, seen  # no bundle in use when the engines start
        assert sum(seen["engines"].values()) > 0  # the engine took its share of the actor's bundle first
        assert sum(after.values()) > sum(seen["engines"].values())  # then the model workers theirs
        out = asyncio.run(engine.generate([[5, 9, 11]], [SamplingParams(max_new_tokens=4, temperature=0.0)]))
        assert len(out[0].token_ids) == 4
    finally:
        engine.close()
        close_groups(actor, ref, critic, reward)
