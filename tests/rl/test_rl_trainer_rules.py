"""RLTrainer's OpenRLHF rules, with fake worker groups (no model): gamma forced to 1 for the group
estimators, dr_grpo / no_std_norm, the loss normaliser, the KL coefficient of each step, rollout
extra metrics and timing names."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rlhforge.agents.types import Trajectory
from rlhforge.cli.train_ppo_ray import parse_rl_args
from rlhforge.trainers.rl.rollouts import RolloutBatch
from rlhforge.trainers.rl import RLTrainer

LN = math.log


def _cfg(*flags):
    return parse_rl_args(["--actor.model_name_or_path", "unused", "--rollout.max_new_tokens", "6",
                          "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2",
                          "--train.batch_size", "4", "--train.micro_batch_size", "2", "--train.max_epochs", "1",
                          *flags], validate=False)


class _Group:
    """A worker group whose log-probs are fixed per sample and whose train_step records its spec."""

    def __init__(self, logprobs=None):
        self.logprobs, self.specs = logprobs, []

    def map_gather(self, method, samples, *args):
        return [self.logprobs[len(s)].clone() for s in samples]

    def map_train(self, method, chunk, spec):
        self.specs.append(spec)
        return [{"policy_loss": 0.0}]

    def gather_weights(self):
        return {}

    def call(self, method, *args):
        return [0.0]


class _Engine:
    def update_weights(self, state):
        pass

    def wake_up(self):
        pass

    def sleep(self):
        pass


def _traj(prompt_len, resp, reward, extra=None):
    n = prompt_len + len(resp)
    return Trajectory(token_ids=list(range(1, n + 1)), prompt_len=prompt_len, action_ranges=[(prompt_len, n)],
                      rollout_logprobs=resp, finish_reason="stop", reward=reward, score=reward, extra=extra or {})


def _trainer(cfg, tmp_path, *, actor=None, ref=None, executor=None):
    prompts = [SimpleNamespace(ids=[1, 2], label=None, datasource=None, index=i, raw={}, vision=None) for i in range(4)]
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=False: " ".join(map(str, ids)))
    return RLTrainer(cfg, tok, prompts, [], SimpleNamespace(total_steps=2), actor=actor or _Group(), ref=ref,
                     critic=None, engine=_Engine(), reward_source=None, logger=None, run_dir=tmp_path,
                     executor=executor or SimpleNamespace())


def test_on_policy_distillation_names_its_own_discount_when_gamma_is_set(tmp_path, capsys):
    t = _trainer(_cfg("--algo.advantage.estimator", "on_policy_distill", "--teacher.model_name_or_path", "unused",
                      "--algo.advantage.gamma", "0.9"), tmp_path)
    assert t.gamma == 1.0
    out = capsys.readouterr().out
    assert out.count("--algo.advantage.gamma 0.9 is ignored with on_policy_distill: its discount is "
                     "--algo.distill.discount") == 1 and "forced to 1.0" not in out


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_baseline", "group_norm", "dr_grpo", "flash_reinforce"])
def test_gamma_is_forced_to_one_for_group_estimators(estimator, tmp_path, capsys):
    t = _trainer(_cfg("--algo.advantage.estimator", estimator, "--algo.advantage.gamma", "0.9"), tmp_path)
    assert t.gamma == 1.0
    out = capsys.readouterr().out
    assert out.count("warning: --algo.advantage.gamma 0.9 is ignored") == 1 and "forced to 1.0" in out


@pytest.mark.parametrize("estimator", ["gae", "reinforce"])
def test_gamma_is_kept_where_openrlhf_keeps_it(estimator, tmp_path, capsys):
    t = _trainer(_cfg("--algo.advantage.estimator", estimator, "--algo.advantage.gamma", "0.9"), tmp_path)
    assert t.gamma == 0.9 and "warning" not in capsys.readouterr().out


def test_forced_gamma_reaches_the_advantages(tmp_path):
    # rloo, n = 2, rewards (1, 0): leave-one-out advantages +1 / -1 on the last token; with gamma 0.5
    # they would decay to 0.5, 0.25 towards the start. gamma forced to 1: constant along the sequence.
    lp = {5: torch.tensor([0.0, 0.0, LN(0.5), LN(0.5), LN(0.5)])}
    t = _trainer(_cfg("--algo.advantage.estimator", "rloo", "--algo.advantage.gamma", "0.5",
                      "--algo.kl.init_coef", "0"), tmp_path, actor=_Group(lp))
    trajs = [_traj(2, [LN(0.5)] * 3, 1.0), _traj(2, [LN(0.5)] * 3, 0.0)]
    samples, _ = t.make_experience(trajs)
    torch.testing.assert_close(samples[0].tensors["advantages"], torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0]))
    torch.testing.assert_close(samples[1].tensors["advantages"], torch.tensor([0.0, 0.0, -1.0, -1.0, -1.0]))


def test_group_norm_with_no_std_norm_still_divides_by_the_group_std(tmp_path):
    lp = {4: torch.tensor([0.0, 0.0, LN(0.5), LN(0.5)])}
    t = _trainer(_cfg("--algo.advantage.estimator", "group_norm", "--algo.advantage.no_std_norm",
                      "--algo.kl.init_coef", "0"), tmp_path, actor=_Group(lp))
    # one group of 2, rewards (3, 1): mean 2, unbiased std sqrt(2) -> (+-1) / (1.414214 + 1e-6) = +-0.707106
    # (the mean-centred dr_grpo shaping would give +-1)
    samples, _ = t.make_experience([_traj(2, [LN(0.5)] * 2, 3.0), _traj(2, [LN(0.5)] * 2, 1.0)])
    a = 1.0 / (math.sqrt(2.0) + 1e-6)
    torch.testing.assert_close(samples[0].tensors["advantages"], torch.tensor([0.0, 0.0, a, a]))
    torch.testing.assert_close(samples[1].tensors["advantages"], torch.tensor([0.0, 0.0, -a, -a]))


def test_dr_grpo_uses_the_configured_loss_aggregation(tmp_path):
    spec = _trainer(_cfg("--algo.advantage.estimator", "dr_grpo"), tmp_path).loss_spec
    assert (spec.agg_mode, spec.norm_constant) == ("token_mean", None)  # OpenRLHF: no special normaliser
    spec = _trainer(_cfg("--algo.advantage.estimator", "dr_grpo", "--actor.loss_agg_mode", "seq-mean-token-sum-norm"),
                    tmp_path).loss_spec
    assert (spec.agg_mode, spec.norm_constant) == ("seq_mean_token_sum_norm", 6.0)  # rollout.max_new_tokens
    spec = _trainer(_cfg("--algo.advantage.estimator", "group_norm", "--actor.loss_agg_mode", "seq-mean-token-mean"),
                    tmp_path).loss_spec
    assert (spec.agg_mode, spec.norm_constant) == ("seq_mean_token_mean", None)


def _kl_run(tmp_path, *flags):
    # actor (pi_old) vs reference on the 2 action tokens: x = ln 2 each -> k1 per-sequence mean ln 2
    actor = _Group({4: torch.tensor([0.0, 0.0, LN(0.5), LN(0.5)])})
    ref = _Group({4: torch.tensor([0.0, 0.0, LN(0.25), LN(0.25)])})
    t = _trainer(_cfg("--algo.advantage.estimator", "reinforce", "--algo.kl.init_coef", "0.1", "--algo.kl.target",
                      "0.1", "--algo.kl.horizon", "4", "--algo.kl.estimator", "k1", *flags), tmp_path, actor=actor, ref=ref)
    return t, actor


def _batch(step):
    trajs = [_traj(2, [LN(0.5)] * 2, r) for r in (1.0, 0.0, 0.5, 0.0)]
    return RolloutBatch(index=step, trajs=trajs, metrics={}, stream_position=0, version_start=step, version_end=step,
                        generation_s=0.0)


def test_kl_loss_uses_the_controllers_value_of_each_step_and_updates_after(tmp_path):
    t, actor = _kl_run(tmp_path, "--algo.kl.use_loss")
    # adaptive: error = clip(ln2 / 0.1 - 1, +-0.2) = 0.2 ; beta <- beta * (1 + 0.2 * 4 samples / horizon 4) = 1.2 beta
    m1 = t.step(_batch(0))
    assert m1["rollout/kl_coef"] == pytest.approx(0.1) and actor.specs[-1].kl_loss_coef == pytest.approx(0.1)
    assert m1["actor/kl_ref"] == pytest.approx(LN(2.0))
    assert t.kl_ctl.value == pytest.approx(0.12)
    m2 = t.step(_batch(1))
    assert m2["rollout/kl_coef"] == pytest.approx(0.12) and actor.specs[-1].kl_loss_coef == pytest.approx(0.12)
    assert t.kl_ctl.value == pytest.approx(0.144)
    assert t.loss_spec.kl_loss_coef == pytest.approx(0.1)  # the template is not mutated


def test_kl_penalty_uses_the_value_before_this_steps_update(tmp_path):
    t, actor = _kl_run(tmp_path)
    samples, _ = t.make_experience(_batch(0).trajs)
    # reinforce, per-token reward -beta * k1 = -0.1 ln 2 on both tokens, plus R on the last; G_t = return
    # to go: sample 0 (R=1): [1 - 0.2 ln2, 1 - 0.1 ln2] before whitening. Check the returns (unwhitened).
    k = 0.1 * LN(2.0)
    torch.testing.assert_close(samples[0].tensors["returns"], torch.tensor([0.0, 0.0, 1 - 2 * k, 1 - k]))
    assert t.kl_ctl.value == pytest.approx(0.1)  # make_experience does not move the controller
    assert actor.specs == [] and t.step(_batch(0))["rollout/kl_coef"] == pytest.approx(0.1)
    assert all(s.kl_loss_coef == 0.0 for s in actor.specs)  # penalty mode: no KL loss term


def test_timing_metrics_carry_openrlhfs_names(tmp_path):
    t, _ = _kl_run(tmp_path)
    m = t.step(_batch(0))
    for key in ("timing/generation", "timing/make_experience", "timing/ppo_train", "timing/broadcast",
                "timing/step_total"):
        assert key in m and m[key] >= 0.0, key
    assert not {"timing/experience", "timing/training", "timing/weight_sync", "timing/step"} & set(m)


def test_rollout_extra_metrics_average_over_every_sample(tmp_path):
    class Executor:
        async def execute_batch(self, reqs, params, engine):
            extras = [{"a": 2.0, "b": 1.0}, {"a": 4.0}, {}, {"a": 6.0, "b": 3.0}]
            return [_traj(2, [LN(0.5)] * 2, 1.0, extra=e) for e in extras[: len(reqs)]]

    t = _trainer(_cfg("--algo.advantage.estimator", "reinforce", "--algo.kl.init_coef", "0"), tmp_path,
                 executor=Executor())
    _, metrics, *_ = t.rollout()  # (trajs, metrics, stream position, buffered positions)
    # over all 4 samples, a missing key counting as 0: a = (2 + 4 + 0 + 6) / 4 = 3, b = (1 + 0 + 0 + 3) / 4 = 1
    assert metrics["rollout/a"] == pytest.approx(3.0) and metrics["rollout/b"] == pytest.approx(1.0)
