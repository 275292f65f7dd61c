"""Each policy loss of the 2026 pack (CISPO, SAPO, DPPO, DRO, GMPO, Clip-Cov, KL-Cov) trains 2 steps end to
end through ``rlhforge.cli.train_ppo_ray``'s ``main`` on a tiny CPU model, composed with the terms it accepts
(IS correction, entropy bonus, KL loss, dual clip, aggregation modes, two epochs so the ratio moves)."""

import math

import pytest
import torch
from safetensors.torch import load_file

from rlhforge.cli.train_ppo_ray import main as rl_main
from tests.rl.helpers import metrics, rl_args, write_reward

#: loss -> (extra flags, a metric of that loss which must be logged)
CASES = {
    "cispo": (["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", "clip",
               "--actor.entropy_coef", "0.01", "--actor.policy_loss.cispo_eps_high", "2"], "actor/clip_frac"),
    "sapo": (["--actor.loss_agg_mode", "seq-mean-token-mean", "--algo.kl.use_loss", "--algo.kl.estimator", "k3",
              "--actor.policy_loss.tau_pos", "1.0"], "actor/gate_mean"),
    "dppo": (["--train.max_epochs", "2", "--actor.policy_loss.dppo_delta_high", "0.1"], "actor/masked_frac"),
    "dro": (["--train.max_epochs", "2", "--actor.loss_agg_mode", "seq-mean-token-sum-norm"], "actor/sq_log_ratio"),
    "geo_mean": ([], "actor/seq_ratio_mean"),  # veRL's name of GMPO
    "clip_cov": (["--actor.dual_clip", "3", "--actor.policy_loss.clip_cov_ratio", "0.2",
                  "--actor.policy_loss.clip_cov_lb", "-100"], "actor/cov_selected_frac"),
    "kl_cov": (["--actor.policy_loss.kl_cov_ratio", "0.1", "--train.max_epochs", "2"], "actor/cov_selected_frac"),
}


@pytest.mark.parametrize("loss", list(CASES))
def test_each_loss_trains_two_steps(tiny_model_dir, tmp_path, loss):
    extra, metric = CASES[loss]
    out = tmp_path / "run"
    args = rl_args(tiny_model_dir, out, "--reward.remote_url", write_reward(tmp_path / "reward.py"),
                   "--algo.kl.init_coef", "0.01", "--actor.policy_loss_type", loss, *extra)
    assert rl_main(args) == 0
    recs = [r for r in metrics(out) if "actor/policy_loss" in r]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert math.isfinite(r["actor/policy_loss"]) and math.isfinite(r["actor/grad_norm"]) and r["actor/grad_norm"] > 0
        assert metric in r and math.isfinite(r[metric])
    if loss in ("clip_cov", "kl_cov"):  # the budget (10-20% of the tokens) selected some on each step
        assert all(r["actor/cov_selected_frac"] > 0 for r in recs)
    before, after = load_file(tiny_model_dir / "model.safetensors"), load_file(out / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)
