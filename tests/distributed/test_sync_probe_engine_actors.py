"""The post-sync effect check with vLLM engines as Ray actors (docs/rl.md, "Weights in effect after every
sync"): after every sync from actor rank 0 (2 ranks, ZeRO-3, colocated with 2 engine actors), each engine
actor scores the probe and the Ray actor group scores it through the same log-prob pass as the old
log-probs; the run logs the largest gap every step, below the fp32 bound."""

import pytest

from rlhforge.cli.train_ppo_ray import main
from tests.rl.helpers import metrics, rl_args, write_reward

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.usefixtures("vllm")]


def test_engine_actors_log_the_probe_every_step(ray_cluster, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    assert main(rl_args(tiny_model_dir, out, "--reward.remote_url", write_reward(tmp_path / "r.py"),
                        "--ds.strategy", "deepspeed", "--ds.zero_stage", "3", "--actor.num_gpus_per_node", "2",
                        "--train.colocate_all", "--vllm.num_engines", "2", steps=2)) == 0
    rows = [r for r in metrics(out) if "timing/broadcast" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["sync/probe_logprob_diff"] < 1e-4 and r["sync/probe_logprob_diff_max"] < 1e-3, r
        assert r["sync/probe_policy_change"] > 1e-2
