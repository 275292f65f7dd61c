"""Token-budget dynamic batching in RL (--train.dynamic_batch_enable).

The actor's and critic's steps (real workers on the plain-torch strategy) give the same loss, metrics
and gradients (1e-5, float32) with fixed micro-batches and with token-budget ones, in token-mean and
seq-mean modes and for GSPO, with fewer forward passes and less computed padding (counted by a
forward pre-hook on the model, not timed); the no-grad passes return the same per-sample values in
input order. Two gloo ranks (DDP, ZeRO-2, ZeRO-3, FSDP2; tests/rl/dynamic_batch_worker.py) agree on the
number of passes and give the one-rank gradient. Two short RL runs through the real CLI (fixed vs
token budget) train, log ``actor/micro_batches`` and match on their first step.
"""

from __future__ import annotations

import pytest
import torch

from rlhforge.config.parsing import from_dict
from rlhforge.config.rl import RLConfig
from rlhforge.workers.actor import ActorWorker, CriticWorker, PolicyLossSpec

from tests.rl.dynamic_batch_worker import LENGTHS, experience_samples as _samples
from tests.rl.helpers import worker_plan
from tests.torchrun import free_port, run_torchrun

# LENGTHS: mixed, long and short alternating: fixed pairs pad every short sample up to a long one
BUDGET = 128  # first-fit decreasing: 60+55+12 | 50+10+8+7+6 -> 2 micro-batches instead of 4 pairs


def _cfg(model_dir, **over) -> RLConfig:
    base = {"actor.model_name_or_path": str(model_dir), "data.prompt_dataset": "builtin:arithmetic",
            "reward.remote_url": "builtin:arithmetic", "rollout.batch_size": 8, "train.batch_size": 8,
            "train.micro_batch_size": 2, "ds.param_dtype": "fp32", "train.device": "cpu",
            "ds.packing_samples": True, "train.dynamic_batch_enable": True, "train.max_tokens_per_gpu": BUDGET}
    cfg = from_dict(RLConfig, {**base, **over})
    cfg.validate()
    return cfg


class _Counter:
    """Forward calls and the tokens each one computes (padding included), from a pre-hook."""

    def __init__(self, module):
        self.passes, self.computed = 0, 0
        self.handle = module.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, _module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.passes += 1
        self.computed += ids.numel()


def _step(worker, samples, *args, fixed_padded: bool):
    """One train_step; returns (metrics, gradients, forward passes, computed tokens); weights restored."""
    module = worker.strategy.module
    start = {k: v.clone() for k, v in module.state_dict().items()}
    worker.packed = not fixed_padded
    worker.train_tokens = None if fixed_padded else BUDGET
    grads: dict = {}
    step = worker.strategy.step

    def recording_step():
        grads.update({n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None})
        return step()

    worker.strategy.step = recording_step
    counter = _Counter(module)
    try:
        metrics = worker.train_step(samples, *args)
    finally:
        counter.handle.remove()
        worker.strategy.step = step
        module.load_state_dict(start)
    return metrics, grads, counter.passes, counter.computed


def _assert_same(a, b, keys):
    (ma, ga, _, _), (mb, gb, _, _) = a, b
    for key in keys:
        assert mb[key] == pytest.approx(ma[key], rel=1e-5, abs=1e-7), key
    assert ga.keys() == gb.keys() and len(ga) > 10
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.fixture(scope="module")
def actor(tiny_model_dir):
    from transformers import AutoTokenizer

    cfg = _cfg(tiny_model_dir, **{"rollout.max_tokens_per_gpu": 200})
    return ActorWorker(cfg, AutoTokenizer.from_pretrained(tiny_model_dir), worker_plan(cfg, 10))


def test_budgets_come_from_the_config(tiny_model_dir):
    assert _cfg(tiny_model_dir).token_budgets() == (BUDGET, BUDGET)  # passes: the train value
    assert _cfg(tiny_model_dir, **{"rollout.max_tokens_per_gpu": 300}).token_budgets() == (BUDGET, 300)
    assert _cfg(tiny_model_dir, **{"train.dynamic_batch_enable": False}).token_budgets() == (None, None)


@pytest.mark.parametrize("agg, loss_type", [("token_mean", "ppo"), ("seq_mean_token_mean", "ppo"),
                                            ("seq_mean_token_mean", "gspo")])
def test_actor_step_equals_fixed_micro_batches(actor, agg, loss_type):
    kwargs = {"eps_low": 0.2, "eps_high": 0.2} if loss_type == "ppo" else {}
    spec = PolicyLossSpec(loss_type=loss_type, loss_kwargs=kwargs, agg_mode=agg, entropy_coef=0.01,
                          kl_loss_coef=0.1)
    samples = _samples()
    fixed = _step(actor, samples, spec, fixed_padded=True)
    dynamic = _step(actor, samples, spec, fixed_padded=False)
    _assert_same(fixed, dynamic, ["policy_loss", "kl_loss", "entropy", "approx_kl", "clip_frac"])
    assert abs(fixed[0]["policy_loss"]) > 1e-4 and fixed[0]["kl_loss"] > 0  # real, non-zero terms
    # fewer passes (4 pairs -> 2 budget micro-batches) and less computed padding
    real = sum(LENGTHS)
    assert (fixed[2], dynamic[2]) == (4, 2)
    assert fixed[3] == 2 * (60 + 55 + 50 + 12)  # pairs padded to their longer sample: 354 tokens for 208
    assert real <= dynamic[3] < fixed[3]


def test_actor_logprob_pass_equals_fixed_micro_batches(actor):
    samples = _samples(seed=1)
    actor.packed, actor.pass_tokens = False, None
    counter = _Counter(actor.strategy.module)
    fixed = actor.logprobs(samples, 2, 1.0)
    passes_fixed = counter.passes
    actor.packed, actor.pass_tokens = True, 200  # --rollout.max_tokens_per_gpu 200 -> 2 passes
    dynamic = actor.logprobs(samples, 2, 1.0)
    counter.handle.remove()
    assert (passes_fixed, counter.passes - passes_fixed) == (4, 2)
    for s, a, b in zip(samples, fixed, dynamic):  # input order kept although the groups are not consecutive
        assert a.shape == b.shape == (len(s),)
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert float(torch.cat(fixed).sum()) < -100  # real log-probs of a random model


def test_critic_step_and_values_equal_fixed_micro_batches(tiny_model_dir):
    from transformers import AutoTokenizer

    cfg = _cfg(tiny_model_dir, **{"algo.advantage.estimator": "gae"})
    critic = CriticWorker(cfg, AutoTokenizer.from_pretrained(tiny_model_dir), worker_plan(cfg, 10))
    samples = _samples(seed=2)
    fixed = _step(critic, samples, 0.2, fixed_padded=True)
    dynamic = _step(critic, samples, 0.2, fixed_padded=False)
    _assert_same(fixed, dynamic, ["value_loss", "clip_frac", "values_mean"])
    assert fixed[0]["value_loss"] > 1e-3 and (fixed[2], dynamic[2]) == (4, 2)
    critic.packed, critic.pass_tokens = False, None
    a = critic.values(samples, 2)
    critic.packed, critic.pass_tokens = True, BUDGET
    b = critic.values(samples, 2)
    for x, y in zip(a, b):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)


def test_rl_cli_trains_with_dynamic_batching(tiny_model_dir, tmp_path):
    """Two GRPO steps through the CLI, fixed micro-batches (2 x 2 samples, padded) vs one token-budget
    micro-batch (packed): same first step (same rollout, same weights), the budget run logs 1 pass."""
    from rlhforge.cli.train_ppo_ray import main
    from tests.rl.helpers import metrics, rl_args, write_reward

    reward = write_reward(tmp_path / "reward.py")
    common = ["--reward.remote_url", reward, "--algo.kl.init_coef", "0.01", "--algo.kl.use_loss"]
    runs = {}
    for name, extra in {"fixed": [], "budget": ["--ds.packing_samples", "--train.dynamic_batch_enable",
                                                 "--train.max_tokens_per_gpu", "4096",
                                                 "--rollout.max_tokens_per_gpu", "96"]}.items():
        out = tmp_path / name
        assert main(rl_args(tiny_model_dir, out, *common, *extra, steps=2)) == 0
        runs[name] = [r for r in metrics(out) if "actor/policy_loss" in r]
        assert len(runs[name]) == 2 and all(r["actor/grad_norm"] > 0 for r in runs[name])
    fixed, budget = runs["fixed"][0], runs["budget"][0]
    assert (fixed["actor/micro_batches"], budget["actor/micro_batches"]) == (2.0, 1.0)
    assert budget["rollout/reward_mean"] == fixed["rollout/reward_mean"]  # the same rollout
    for key in ("actor/policy_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert budget[key] == pytest.approx(fixed[key], rel=1e-4, abs=1e-6), key


def test_dynamic_batching_needs_packing(tiny_model_dir):
    from rlhforge.config.parsing import ConfigError

    with pytest.raises(ConfigError, match="--train.dynamic_batch_enable needs --ds.packing_samples"):
        _cfg(tiny_model_dir, **{"ds.packing_samples": False})


@pytest.mark.slow
def test_two_ranks_deepspeed_and_ddp_equal_fixed_and_one_rank(actor, tiny_model_dir, tmp_path):
    """2 gloo ranks (DDP, ZeRO-2, ZeRO-3, FSDP2): the token-budget step (3 passes per rank, agreed by
    all_reduce(max) although rank 1 alone needs 2; DeepSpeed configured for 2) equals the fixed one
    (2 pairs per rank) and the one-rank step over all 8 samples, in the seq-mean mode."""
    import os
    import sys
    from pathlib import Path

    worker = Path(__file__).with_name("dynamic_batch_worker.py")
    out = tmp_path / "two_ranks.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(free_port()), str(worker), str(tiny_model_dir), str(out), "64",
           "torch", "deepspeed:2", "deepspeed:3", "fsdp2"]
    proc = run_torchrun(cmd, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = torch.load(out, weights_only=False)
    spec = PolicyLossSpec(loss_kwargs={"eps_low": 0.2, "eps_high": 0.2}, agg_mode="seq_mean_token_mean",
                          kl_loss_coef=0.1)
    one = _step(actor, _samples(), spec, fixed_padded=True)  # one rank, 4 pairs, all 8 samples
    for name, modes in results.items():
        assert (modes["fixed"]["metrics"]["micro_batches"], modes["budget"]["metrics"]["micro_batches"]) == (2, 3)
        for mode, r in modes.items():
            _assert_same(one, (r["metrics"], r["grads"], 0, 0), ["policy_loss", "kl_loss", "entropy", "clip_frac"])


def test_reward_model_scores_equal_fixed_micro_batches(tiny_model_dir, tmp_path):
    from rlhforge.config.components import DSConfig, ModelConfig
    from rlhforge.rewards.sources import RewardModels
    from tests.model_helpers import tiny_reward_model

    path = str(tiny_reward_model(tiny_model_dir, tmp_path / "rm"))
    seqs = [s.input_ids for s in _samples(seed=3)]

    def scores(max_tokens):
        models = RewardModels([path], ModelConfig(model_name_or_path=path), DSConfig(param_dtype="fp32"),
                              torch.device("cpu"), pad_token_id=0, normalize=False, micro_batch_size=2,
                              max_tokens=max_tokens)
        counter = _Counter(models.models[0].model)
        out = models.score(seqs)
        counter.handle.remove()
        return [row[0] for row in out], counter.passes

    (fixed, fixed_passes), (budget, budget_passes) = scores(None), scores(BUDGET)
    assert (fixed_passes, budget_passes) == (4, 2)
    assert budget == pytest.approx(fixed, rel=1e-5, abs=1e-5) and len(set(fixed)) == len(seqs)  # in input order


def test_micro_batch_size_does_not_constrain_token_budget_runs(tiny_model_dir):
    """With token budgets train.micro_batch_size splits nothing: 12 samples per step with a micro-batch
    size of 8 are refused for fixed micro-batches only (the arithmetic uses 1 sample, as OpenRLHF's
    DeepSpeed config does)."""
    from rlhforge.config.parsing import ConfigError

    over = {"rollout.batch_size": 12, "train.batch_size": 12, "train.micro_batch_size": 8}
    assert _cfg(tiny_model_dir, **over).planned_micro_batch_size == 1
    with pytest.raises(ConfigError, match="train.batch_size 12 is not divisible by train.micro_batch_size 8"):
        _cfg(tiny_model_dir, **over, **{"train.dynamic_batch_enable": False})
