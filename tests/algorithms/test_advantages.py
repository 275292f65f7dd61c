"""Advantages: GAE, returns, group baselines, whitening, token rewards, the estimator table."""

import math
import statistics

import pytest
import torch

from rlhforge.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    assemble_token_rewards,
    batch_mean_baseline,
    compute_advantages,
    discounted_returns,
    dr_grpo,
    gae,
    get_advantage_estimator,
    group_norm,
    last_action_index,
    reinforce_baseline,
    rloo,
    whiten,
)

D = torch.float64


def t(x):
    return torch.tensor(x, dtype=D)


# ---------------------------------------------------------------- GAE


def test_gae_by_hand():
    r, v = t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]])
    adv, ret = gae(r, v, torch.ones(1, 3), gamma=0.9, lam=0.8)
    # d2 = 1 - 0.7 = 0.3                       A2 = 0.3
    # d1 = 0 + 0.9*0.7 - 0.6 = 0.03            A1 = 0.03 + 0.72*0.3   = 0.246
    # d0 = 0 + 0.9*0.6 - 0.5 = 0.04            A0 = 0.04 + 0.72*0.246 = 0.21712
    torch.testing.assert_close(adv, t([[0.21712, 0.246, 0.3]]))
    torch.testing.assert_close(ret, t([[0.71712, 0.846, 1.0]]))  # A + V


def test_gae_right_padding_and_all_masked_row():
    r = t([[0.0, 1.0, 99.0], [5.0, 5.0, 5.0]])
    v = t([[0.5, 0.4, 77.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    adv, ret = gae(r, v, mask)  # gamma = lam = 1: A_t = sum_{s>=t} r_s - V_t
    # row 0: A1 = 1 - 0.4 = 0.6 ; A0 = 1 - 0.5 = 0.5 ; padding ignored
    torch.testing.assert_close(adv, t([[0.5, 0.6, 0.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(ret, t([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))


def test_gae_skips_masked_tokens_inside_the_response():
    # mask [1, 0, 1]: the env token in the middle is skipped (its r=5 and V=9 are ignored)
    adv, ret = gae(t([[0.0, 5.0, 1.0]]), t([[0.5, 9.0, 0.7]]), torch.tensor([[1, 0, 1]]), gamma=0.9, lam=0.8)
    # A2 = 1 - 0.7 = 0.3 ; d0 = 0 + 0.9*0.7 - 0.5 = 0.13 ; A0 = 0.13 + 0.72*0.3 = 0.346
    torch.testing.assert_close(adv, t([[0.346, 0.0, 0.3]]))
    torch.testing.assert_close(ret, t([[0.846, 0.0, 1.0]]))


def test_gae_zero_length():
    adv, ret = gae(torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0))
    assert adv.shape == (2, 0) and ret.shape == (2, 0)


def _gae_loop(r, v, m, gamma, lam):
    B, T = len(r), len(r[0])
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        idx = [i for i in range(T) if m[b][i]]
        running, next_v = 0.0, 0.0
        for i in reversed(idx):
            delta = r[b][i] + gamma * next_v - v[b][i]
            running = delta + gamma * lam * running
            adv[b][i] = running
            next_v = v[b][i]
    ret = [[(adv[b][i] + v[b][i]) if m[b][i] else 0.0 for i in range(T)] for b in range(B)]
    return adv, ret


def _random_mask(g, B, T):
    m = torch.rand(B, T, generator=g) < 0.75
    m[0] = False  # an all-masked row
    if B > 2:
        lengths = torch.randint(0, T + 1, (1,), generator=g).item()
        m[1] = torch.arange(T) < lengths  # right padding
    return m


@pytest.mark.parametrize("seed", range(4))
def test_gae_matches_python_loop(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = torch.randint(3, 7, (1,), generator=g).item(), torch.randint(1, 9, (1,), generator=g).item()
    r, v = torch.randn(B, T, generator=g, dtype=D), torch.randn(B, T, generator=g, dtype=D)
    m = _random_mask(g, B, T)
    gamma, lam = 0.5 + 0.5 * torch.rand(1, generator=g).item(), torch.rand(1, generator=g).item()
    adv, ret = gae(r, v, m, gamma, lam)
    ref_adv, ref_ret = _gae_loop(r.tolist(), v.tolist(), m.tolist(), gamma, lam)
    torch.testing.assert_close(adv, t(ref_adv))
    torch.testing.assert_close(ret, t(ref_ret))


# ---------------------------------------------------------------- returns


def test_discounted_returns_by_hand():
    r = t([[1.0, 0.0, 2.0]])
    # gamma 0.5: G2 = 2, G1 = 0 + 0.5*2 = 1, G0 = 1 + 0.5*1 = 1.5
    torch.testing.assert_close(discounted_returns(r, torch.ones(1, 3), 0.5), t([[1.5, 1.0, 2.0]]))
    # gamma 1: suffix sums [3, 2, 2]
    torch.testing.assert_close(discounted_returns(r, torch.ones(1, 3), 1.0), t([[3.0, 2.0, 2.0]]))
    # hole in the mask: r=7 at the masked token is ignored; G0 = 1 + 0.5*2 = 2
    torch.testing.assert_close(discounted_returns(t([[1.0, 7.0, 2.0]]), torch.tensor([[1, 0, 1]]), 0.5), t([[2.0, 0.0, 2.0]]))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_discounted_returns_match_python_loop(seed, gamma):
    g = torch.Generator().manual_seed(seed)
    B, T = 4, torch.randint(1, 8, (1,), generator=g).item()
    r, m = torch.randn(B, T, generator=g, dtype=D), _random_mask(g, B, T)
    expected = [[0.0] * T for _ in range(B)]
    for b in range(B):
        running = 0.0
        for i in reversed(range(T)):
            if m[b, i]:
                running = r[b, i].item() + gamma * running
                expected[b][i] = running
    torch.testing.assert_close(discounted_returns(r, m, gamma), t(expected))


# ---------------------------------------------------------------- group shaping


def test_group_estimators_by_hand():
    rewards = t([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    # group 1 mean 0.25; group 2 constant
    torch.testing.assert_close(reinforce_baseline(rewards, 4), t([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]))
    torch.testing.assert_close(dr_grpo(rewards, 4), t([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]))
    # leave-one-out: r_i - (1 - r_i)/3 -> [1 - 0, 0 - 1/3, ...]
    torch.testing.assert_close(rloo(rewards, 4), t([1.0, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0]))
    # unbiased std: (0.5625 + 3*0.0625) / 3 = 0.25 -> std 0.5 ; (r - 0.25) / (0.5 + 1e-6)
    s = 0.5 + 1e-6
    torch.testing.assert_close(group_norm(rewards, 4), t([0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s, 0, 0, 0, 0]))


@pytest.mark.parametrize("fn", [reinforce_baseline, rloo, group_norm, dr_grpo])
def test_group_estimators_reject_one_sample_per_group(fn):
    with pytest.raises(ValueError, match=r"needs n_samples_per_prompt > 1 \(got 1\)"):
        fn(t([1.0, 2.0]), 1)
    with pytest.raises(ValueError, match="do not split into groups of 2"):
        fn(t([1.0, 2.0, 3.0]), 2)


def _group_loop(rewards, n, kind):
    out = []
    for s in range(0, len(rewards), n):
        grp = rewards[s : s + n]
        mean = sum(grp) / n
        for j, x in enumerate(grp):
            if kind in ("baseline", "dr_grpo"):
                out.append(x - mean)
            elif kind == "rloo":
                out.append(x - (sum(grp) - x) / (n - 1))
            else:
                out.append((x - mean) / (statistics.stdev(grp) + 1e-6))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_group_estimators_match_python_loop(seed):
    g = torch.Generator().manual_seed(seed)
    P, n = torch.randint(1, 6, (1,), generator=g).item(), torch.randint(2, 6, (1,), generator=g).item()
    rewards = torch.randn(P * n, generator=g, dtype=D)
    lst = rewards.tolist()
    for fn, kind in ((reinforce_baseline, "baseline"), (rloo, "rloo"), (group_norm, "norm"), (dr_grpo, "dr_grpo")):
        torch.testing.assert_close(fn(rewards, n), t(_group_loop(lst, n, kind)))


def test_batch_mean_baseline():
    torch.testing.assert_close(batch_mean_baseline(t([1.0, 2.0, 3.0, 6.0])), t([-2.0, -1.0, 0.0, 3.0]))  # mean 3


# ---------------------------------------------------------------- whitening, token rewards


def test_whiten_by_hand():
    x = t([[1.0, 2.0, 3.0, math.inf]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # mean 2, population var (1 + 0 + 1)/3 = 2/3 -> (x - 2) * sqrt(1.5)
    torch.testing.assert_close(whiten(x, mask), t([[-1.224745, 0.0, 1.224745, 0.0]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(whiten(x, mask, use_std=False), t([[-1.0, 0.0, 1.0, 0.0]]))
    # constant values: var 0 is clamped to 1e-8 -> zeros, not NaN; all-masked -> zeros
    torch.testing.assert_close(whiten(t([[2.0, 2.0]]), torch.ones(1, 2)), t([[0.0, 0.0]]))
    torch.testing.assert_close(whiten(t([[2.0, math.nan]]), torch.zeros(1, 2)), t([[0.0, 0.0]]))


def test_assemble_token_rewards_by_hand():
    scores = t([2.0, 20.0, 5.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    kl = t([[0.1, 0.2, 9.0], [0.3, 0.1, 0.2], [1.0, 1.0, 1.0]])
    r = assemble_token_rewards(scores, mask, kl, kl_coef=0.5, reward_clip=(-10.0, 10.0))
    # row 0: [-0.5*0.1, 2 - 0.5*0.2, 0] ; row 1: score clipped to 10: [-0.15, -0.05, 10 - 0.1]
    # row 2: no action token -> zeros
    torch.testing.assert_close(r, t([[-0.05, 1.9, 0.0], [-0.15, -0.05, 9.9], [0.0, 0.0, 0.0]]))
    # kl_coef <= 0 disables the penalty
    torch.testing.assert_close(assemble_token_rewards(scores, mask, kl, kl_coef=0.0), t([[0, 2, 0], [0, 0, 20], [0, 0, 0]]))
    assert last_action_index(mask).tolist() == [1, 2, -1]
    assert last_action_index(torch.zeros(2, 0)).tolist() == [-1, -1]
    assert assemble_token_rewards(t([1.0, 2.0]), torch.zeros(2, 0)).shape == (2, 0)


# ---------------------------------------------------------------- the estimator table


def test_table_names_and_unknown_name():
    assert set(ADVANTAGE_ESTIMATORS) == {"gae", "reinforce", "reinforce_baseline", "rloo", "group_norm", "dr_grpo", "flash_reinforce",
                                         "on_policy_distill"}
    assert get_advantage_estimator("group-norm") is ADVANTAGE_ESTIMATORS["group_norm"]
    with pytest.raises(ValueError, match="unknown advantage estimator 'grpo'; valid names: dr_grpo, flash_reinforce, gae"):
        get_advantage_estimator("grpo")


def test_group_norm_estimator_end_to_end():
    mask = torch.tensor([[1, 1], [1, 0]])
    adv, ret = compute_advantages("group_norm", t([1.0, 0.0]), mask, n_samples_per_prompt=2)
    # mean 0.5, unbiased std sqrt(0.5) = 0.707107 -> +-0.5 / 0.707108 = +-0.707106 ; G_t carries it back
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    torch.testing.assert_close(adv, t([[a, a], [-a, 0.0]]))
    torch.testing.assert_close(ret, adv)
    with pytest.raises(ValueError, match="critic-free"):
        compute_advantages("group_norm", t([1.0, 0.0]), mask, n_samples_per_prompt=2, values=torch.zeros(2, 2))


def test_reinforce_whitens_by_default():
    mask = torch.tensor([[1, 1], [1, 0]])
    adv, ret = compute_advantages("reinforce", t([1.0, 0.0]), mask)
    # G = [[1, 1], [0, -]] ; tokens 1, 1, 0: mean 2/3, var (1/9 + 1/9 + 4/9)/3 = 2/9, std 0.471405
    torch.testing.assert_close(ret, t([[1.0, 1.0], [0.0, 0.0]]))
    torch.testing.assert_close(adv, t([[0.707107, 0.707107], [-1.414214, 0.0]]), atol=1e-6, rtol=0)
    adv_raw, _ = compute_advantages("reinforce", t([1.0, 0.0]), mask, whiten=False)
    torch.testing.assert_close(adv_raw, ret)
    adv_c, _ = compute_advantages("reinforce", t([1.0, 0.0]), mask, whiten_std=False)
    torch.testing.assert_close(adv_c, t([[1 / 3, 1 / 3], [-2 / 3, 0.0]]))  # centred only


def test_rloo_with_kl_penalty_accumulates_into_returns():
    kl = torch.full((2, 2), 0.2, dtype=D)
    adv, _ = compute_advantages("rloo", t([1.0, 0.0]), torch.ones(2, 2), n_samples_per_prompt=2, kl=kl, kl_coef=0.5)
    # rloo: [1 - 0, 0 - 1] ; token rewards row 0: [-0.1, 0.9] -> G = [0.8, 0.9]
    # row 1: [-0.1, -1.1] -> G = [-1.2, -1.1] ; rloo does not whiten
    torch.testing.assert_close(adv, t([[0.8, 0.9], [-1.2, -1.1]]))


def test_gae_estimator_and_flash_reinforce_estimator():
    mask = torch.ones(1, 3)
    values = t([[0.5, 0.6, 0.7]])
    adv, ret = compute_advantages("gae", t([1.0]), mask, values=values, gamma=0.9, lam=0.8, whiten=False)
    torch.testing.assert_close(adv, t([[0.21712, 0.246, 0.3]]))  # same numbers as test_gae_by_hand
    with pytest.raises(ValueError, match="gae needs the critic's values"):
        compute_advantages("gae", t([1.0]), mask)
    adv, _ = compute_advantages("flash_reinforce", t([1.0, 0.0, 0.0, 1.0, 1.0]), torch.ones(5, 1))
    torch.testing.assert_close(adv, t([[0.4], [-0.6], [-0.6], [0.4], [0.4]]))  # minus the batch mean 0.6
