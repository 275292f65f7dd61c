"""The RL actor with ring attention (--ds.ring_attn_size 2, 2 gloo ranks forming one ring) gives the
one-rank log-probs, step metrics and gradients (DDP averages the ring's partial gradients back to the
full one). The worker runs for real (tests/rl/ring_actor_worker.py); the RL command still refuses the
flag until its Ray groups shard samples by ring (docs/long_context.md)."""

import os
import sys
from pathlib import Path

import pytest
import torch
from tests.torchrun import free_port, run_torchrun

WORKER = Path(__file__).with_name("ring_actor_worker.py")
ROOT = Path(__file__).parents[2]


def _run(model_dir, out, nproc):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), str(WORKER), str(model_dir), str(out)]
    proc = run_torchrun(cmd, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return torch.load(out, weights_only=False)


def test_ring_actor_matches_one_rank(tiny_model_dir, tmp_path):
    one = _run(tiny_model_dir, tmp_path / "one.pt", 1)
    ring = _run(tiny_model_dir, tmp_path / "ring.pt", 2)
    assert len(ring["logprobs"]) == len(one["logprobs"]) == 8
    for a, b in zip(ring["logprobs"], one["logprobs"]):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for key in ("policy_loss", "kl_loss", "entropy", "clip_frac", "grad_norm"):
        assert ring["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-7), key
    assert one["metrics"]["entropy"] > 1.0 and one["metrics"]["grad_norm"] > 0
    assert ring["grads"].keys() == one["grads"].keys() and len(one["grads"]) > 10
    for name, g in one["grads"].items():
        torch.testing.assert_close(ring["grads"][name], g, rtol=1e-4, atol=1e-6, msg=name)


RL = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "builtin:arithmetic", "--reward.remote_url",
      "builtin:arithmetic", "--rollout.batch_size", "4", "--train.batch_size", "4", "--train.micro_batch_size", "4"]


@pytest.mark.parametrize("extra, message", [
    (["--ds.ring_attn_size", "2", "--ds.packing_samples"], "actor ranks, which are Ray workers"),
    (["--ds.ring_attn_size", "2", "--actor.num_gpus_per_node", "2"], "needs --ds.packing_samples"),
    (["--ds.ring_attn_size", "2", "--actor.num_gpus_per_node", "3", "--ds.packing_samples"],
     "ring_attn_size 2 must divide the 3 training ranks"),
    (["--ds.ring_attn_size", "2", "--actor.num_gpus_per_node", "2", "--ds.packing_samples", "--train.routing_replay"],
     "routing_replay cannot be combined"),
])
def test_rl_ring_attention_refusals(extra, message):
    from rlhforge.cli.train_ppo_ray import parse_rl_args
    from rlhforge.config.parsing import ConfigError

    with pytest.raises(ConfigError, match=message):
        parse_rl_args([*RL, *extra])


def test_rl_ring_batch_arithmetic_uses_the_data_parallel_size():
    """2 actor workers in one ring are 1 data-parallel rank: a batch of 4 in micro-batches of 4 is fine
    (it would not be over 2 data-parallel ranks)."""
    from rlhforge.cli.train_ppo_ray import parse_rl_args
    from rlhforge.config.parsing import ConfigError

    parse_rl_args([*RL, "--ds.ring_attn_size", "2", "--actor.num_gpus_per_node", "2", "--ds.packing_samples"])
    with pytest.raises(ConfigError, match=r"micro_batch_size x actor workers \(4 x 2 = 8\)"):
        parse_rl_args([*RL, "--actor.num_gpus_per_node", "2", "--ds.packing_samples"])
