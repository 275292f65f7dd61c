"""One record per advantage estimator (config/rl_algo.py): every estimator has one, and the facts the
rest of the system reads from it match the math table and the flag's choices."""

import typing

import pytest

from rlhforge.algorithms.advantages import ADVANTAGE_ESTIMATORS
from rlhforge.config.rl_algo import ESTIMATORS, AdvantageConfig, estimator_record


def test_every_estimator_has_one_record():
    choices = typing.get_args(typing.get_type_hints(AdvantageConfig)["estimator"])
    assert set(ESTIMATORS) == set(ADVANTAGE_ESTIMATORS) == set(choices)
    assert all(name == r.name for name, r in ESTIMATORS.items())


def test_records_say_what_each_estimator_needs():
    assert [n for n, r in ESTIMATORS.items() if r.critic] == ["gae"]
    assert {n for n, r in ESTIMATORS.items() if r.groups} == {"rloo", "reinforce_baseline", "group_norm", "dr_grpo"}
    assert {n for n, r in ESTIMATORS.items() if not r.gamma_one} == {"gae", "reinforce"}
    assert [n for n, r in ESTIMATORS.items() if r.teacher] == ["on_policy_distill"]
    flash = AdvantageConfig(estimator="flash_reinforce").record
    assert (flash.old_logprobs, flash.policy_loss, flash.loss_agg_mode) == ("rollout", "flash_reinforce",
                                                                            "seq_mean_token_mean")
    with pytest.raises(ValueError, match="valid: gae, reinforce"):
        estimator_record("ppo")
