"""``--actor.policy_loss_type`` and ``--actor.policy_loss.*``: names and aliases, the keyword arguments each loss
gets, the start-up refusals (exit 2 naming the flag and why) and the one-line notices."""

import pytest

from rlhforge.algorithms import POLICY_LOSSES
from rlhforge.cli.train_ppo_ray import main as rl_main
from rlhforge.cli.train_ppo_ray import parse_rl_args
from rlhforge.config.parsing import from_dict
from rlhforge.config.rl import RLConfig
from rlhforge.config.rl_losses import (
    LOSS_PARAMS,
    POLICY_LOSS_ALIASES,
    POLICY_LOSS_TYPES,
    PolicyLossParams,
    policy_loss_setup,
)
from tests.flag_tables import refused_line

BASE = ["--actor.model_name_or_path", "/nonexistent/model", "--data.prompt_dataset", "builtin:arithmetic",
        "--reward.remote_url", "builtin:arithmetic", "--rollout.batch_size", "8", "--train.batch_size", "8",
        "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "2"]


def test_every_name_is_a_loss_and_every_param_a_keyword():
    import inspect

    assert set(POLICY_LOSS_TYPES) <= set(POLICY_LOSSES)
    assert set(POLICY_LOSS_ALIASES.values()) <= set(POLICY_LOSS_TYPES)
    fields = set(PolicyLossParams.__dataclass_fields__)
    for loss, params in LOSS_PARAMS.items():
        accepted = inspect.signature(POLICY_LOSSES[loss]).parameters
        assert set(params) <= fields and set(params.values()) <= set(accepted), loss
        for field, kw in params.items():  # the flag's default is the function's default
            assert getattr(PolicyLossParams(), field) == accepted[kw].default, (loss, field)
    assert set(fields) == {f for p in LOSS_PARAMS.values() for f in p}  # no flag without a reader


@pytest.mark.parametrize("argv, name, kwargs, agg", [
    ([], "ppo", {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": None}, None),
    (["--actor.policy_loss_type", "vanilla"], "ppo", {"eps_low": 0.2, "eps_high": 0.2, "dual_clip": None}, None),
    (["--actor.policy_loss_type", "cispo"], "cispo", {"eps_low": None, "eps_high": 5.0}, None),
    (["--actor.policy_loss.loss_mode", "sapo", "--actor.policy_loss.sapo_temperature_neg", "2"], "sapo",
     {"tau_pos": 1.0, "tau_neg": 2.0}, None),
    (["--actor.policy_loss_type", "dppo_tv", "--actor.policy_loss.dppo_mask_high", "0.28"], "dppo",
     {"delta_low": 0.2, "delta_high": 0.28, "ratio_cap": None}, None),
    (["--actor.policy_loss_type", "dro"], "dro", {"beta": 0.05}, None),
    (["--actor.policy_loss_type", "geo_mean", "--actor.loss_agg_mode", "seq-mean-token-mean"], "gmpo",
     {"eps_low": 0.4, "eps_high": 0.4}, "seq_mean_token_mean"),
    (["--actor.policy_loss_type", "clip_cov", "--actor.dual_clip", "3", "--actor.eps_clip_low_high", "0.2", "0.28"],
     "clip_cov", {"eps_low": 0.2, "eps_high": 0.28, "dual_clip": 3.0, "clip_cov_ratio": 2e-4, "clip_cov_lb": 1.0,
                  "clip_cov_ub": 5.0}, None),
    (["--actor.policy_loss_type", "kl_cov", "--actor.policy_loss.tau_pos", "1"], "kl_cov",
     {"kl_cov_ratio": 2e-4, "ppo_kl_coef": 1.0}, None),
])
def test_names_aliases_and_keywords(argv, name, kwargs, agg):
    cfg = parse_rl_args([*BASE, *argv])
    assert policy_loss_setup(cfg.actor) == (name, kwargs, agg)


def test_yaml_sets_the_loss_params():
    cfg = from_dict(RLConfig, {"actor.policy_loss_type": "dro", "actor": {"policy_loss": {"dro_beta": 0.1}}})
    assert policy_loss_setup(cfg.actor) == ("dro", {"beta": 0.1}, None)


@pytest.mark.parametrize("argv, words", [
    (["--actor.policy_loss_type", "cispo", "--actor.dual_clip", "3"], ["--actor.dual_clip", "cispo", "detached IS"]),
    (["--actor.policy_loss_type", "sapo", "--actor.eps_clip", "0.1"], ["--actor.eps_clip", "sigmoid gate"]),
    (["--actor.policy_loss_type", "dppo", "--actor.eps_clip_low_high", "0.2", "0.28"],
     ["--actor.eps_clip_low_high", "probability difference"]),
    (["--actor.policy_loss_type", "dro", "--actor.dual_clip", "3"], ["--actor.dual_clip", "dro_beta"]),
    (["--actor.policy_loss_type", "kl_cov", "--actor.eps_clip", "0.3"], ["--actor.eps_clip", "KL-Cov"]),
    (["--actor.policy_loss_type", "gmpo", "--actor.loss_agg_mode", "seq-mean-token-sum-norm"],
     ["--actor.loss_agg_mode", "one value per sequence"]),
    (["--actor.policy_loss_type", "gmpo", "--algo.advantage.estimator", "gae"], ["gmpo", "gae", "per token"]),
    (["--actor.policy_loss_type", "cispo", "--algo.advantage.estimator", "flash_reinforce"],
     ["cispo", "flash_reinforce", "its own loss"]),
    (["--actor.policy_loss_type", "sapo", "--actor.policy_loss.sapo_tau_neg", "0"], ["--actor.policy_loss.sapo_tau_neg",
                                                                                     "> 0"]),
    (["--actor.policy_loss.clip_cov_lb", "9"], ["--actor.policy_loss.clip_cov_lb", "clip_cov_ub 5.0"]),
    (["--actor.policy_loss.cispo_eps_low", "1.5"], ["--actor.policy_loss.cispo_eps_low", "[0, 1]"]),
])
def test_meaningless_combinations_exit_2_naming_the_flag(argv, words, capsys):
    line = refused_line(rl_main, [*BASE, *argv], capsys)
    for w in words:
        assert w in line, (w, line)


def test_a_param_of_another_loss_prints_one_notice(capsys):
    capsys.readouterr()
    parse_rl_args([*BASE, "--actor.policy_loss_type", "sapo", "--actor.policy_loss.dro_beta", "0.1",
                   "--actor.policy_loss.tau_pos", "2"])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if "has no effect" in x]
    assert lines == ["[rlhforge] note: --actor.policy_loss.dro_beta 0.1 has no effect with --actor.policy_loss_type "
                     "sapo (it is read by --actor.policy_loss_type dro only)"], err
