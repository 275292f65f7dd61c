"""On-policy distillation's maths (rlhforge.algorithms.distillation): hand-worked values of the reverse-KL
reward, its discounted sum and its combination with an environment reward; the forward KL over the
teacher's top-k against a hand-worked value and against the gradient of the formula written out here."""

import math

import pytest
import torch

from rlhforge.algorithms import compute_advantages
from rlhforge.algorithms.distillation import (
    discounted_future_sum,
    env_advantages,
    forward_kl_topk,
    on_policy_distill_advantages,
    reverse_kl_rewards,
    shifted_gather_logprobs,
    shifted_topk_logprobs,
)

LN = math.log


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def test_reverse_kl_reward_is_the_teacher_gap_on_action_tokens():
    student, teacher, mask = t([[-1.0, -2.0, -0.5]]), t([[-1.5, -1.0, -3.0]]), t([[0, 1, 1]])
    # -(s - t): position 0 is not an action token; -(-2 + 1) = 1; -(-0.5 + 3) = -2.5
    assert torch.allclose(reverse_kl_rewards(student, teacher, mask), t([[0.0, 1.0, -2.5]]))


def test_discount_steps_over_action_tokens_only():
    x, mask = t([[1.0, 2.0, 9.0, 4.0]]), t([[1, 1, 0, 1]])
    # y3 = 4; position 2 is feedback (0, costs no discount step); y1 = 2 + 0.5 * 4 = 4; y0 = 1 + 0.5 * 4 = 3
    assert torch.allclose(discounted_future_sum(x, mask, 0.5), t([[3.0, 4.0, 0.0, 4.0]]))
    assert torch.allclose(discounted_future_sum(x, mask, 0.0), t([[1.0, 2.0, 0.0, 4.0]]))
    assert torch.allclose(discounted_future_sum(x, mask, 1.0), t([[7.0, 6.0, 0.0, 4.0]]))


def test_env_reward_is_group_centred():
    mask = t([[0, 1, 1]] * 4)
    adv = env_advantages(t([1.0, 0.0, 0.5, 0.5]), mask, 2)
    assert torch.allclose(adv, t([[0, 0.5, 0.5], [0, -0.5, -0.5], [0, 0, 0], [0, 0, 0]]))
    assert torch.allclose(env_advantages(t([2.0]), t([[1, 0, 1]]), 1), t([[2.0, 0.0, 2.0]]))  # one sample: as is


def test_advantages_combine_distillation_env_reward_and_reference_kl():
    mask = t([[0, 1, 1]] * 4)
    gap = t([[0, 0.1, 0.2], [0, -0.3, 0.0], [0, 0.5, 0.5], [0, 0.0, 1.0]])  # log pi_S - log pi_T
    student = t([[-1.0, -2.0, -3.0]] * 4)
    teacher = student - gap
    scores = t([1.0, 0.0, 0.5, 0.5])
    kl = torch.ones(4, 3)
    adv, ret = on_policy_distill_advantages(scores, mask, student_logprobs=student, teacher_logprobs=teacher,
                                            distill_coef=2.0, env_coef=0.5, kl=kl, kl_coef=0.1,
                                            n_samples_per_prompt=2)
    # token reward 2 * (-gap) - 0.1; env: 0.5 x (group-centred scores 0.5, -0.5, 0, 0)
    expected = t([[0, -0.2 - 0.1 + 0.25, -0.4 - 0.1 + 0.25],
                  [0, 0.6 - 0.1 - 0.25, 0.0 - 0.1 - 0.25],
                  [0, -1.0 - 0.1, -1.0 - 0.1],
                  [0, 0.0 - 0.1, -2.0 - 0.1]])
    assert torch.allclose(adv, expected, atol=1e-6) and torch.equal(adv, ret)
    # with a discount of 0.5 the first action token adds half of the second's token reward (not the env part)
    disc, _ = on_policy_distill_advantages(scores, mask, student_logprobs=student, teacher_logprobs=teacher,
                                           distill_coef=2.0, env_coef=0.5, kl=kl, kl_coef=0.1, discount=0.5,
                                           n_samples_per_prompt=2)
    assert disc[0, 1].item() == pytest.approx((-0.2 - 0.1) + 0.5 * (-0.4 - 0.1) + 0.25, abs=1e-6)
    assert torch.allclose(disc[:, 2], expected[:, 2], atol=1e-6)
    # the estimator table reaches the same function
    via_table, _ = compute_advantages("on_policy_distill", scores, mask, student_logprobs=student,
                                      teacher_logprobs=teacher, distill_coef=2.0, env_coef=0.5, kl=kl, kl_coef=0.1,
                                      n_samples_per_prompt=2, gamma=1.0, lam=1.0, whiten_std=True, values=None)
    assert torch.equal(via_table, adv)


def test_topk_mode_advantage_is_the_env_reward_only():
    mask = t([[0, 1, 1]] * 2)
    adv, _ = on_policy_distill_advantages(t([1.0, 0.0]), mask, env_coef=1.0, n_samples_per_prompt=2)
    assert torch.allclose(adv, t([[0, 0.5, 0.5], [0, -0.5, -0.5]]))
    with pytest.raises(ValueError, match="come together"):
        on_policy_distill_advantages(t([1.0]), t([[0, 1]]), student_logprobs=t([[0, -1.0]]))


def test_forward_kl_topk_hand_worked():
    teacher = t([[[0.0, 0.0], [LN(0.5), LN(0.25)]]])
    student = t([[[0.0, 0.0], [LN(0.25), LN(0.5)]]])
    # 0.5 (ln .5 - ln .25) + 0.25 (ln .25 - ln .5) = 0.25 ln 2; position 0 is not an action token
    out = forward_kl_topk(student, teacher, t([[0, 1]]))
    assert torch.allclose(out, t([[0.0, 0.25 * LN(2.0)]]))


def test_shifted_topk_and_gather_follow_the_token_convention():
    logits = torch.log(t([[[1, 2, 3, 4], [4, 3, 2, 1], [1, 1, 1, 1]]]))  # softmax rows: (1, 2, 3, 4) / 10 ...
    ids, lps = shifted_topk_logprobs(logits, 2)
    # row t is the distribution that predicted token t: row 1 <- logits[0], row 2 <- logits[1]; row 0 zeros
    assert ids.tolist() == [[[0, 0], [3, 2], [0, 1]]]
    assert torch.allclose(lps[0, 1], t([LN(0.4), LN(0.3)])) and torch.allclose(lps[0, 2], t([LN(0.4), LN(0.3)]))
    assert torch.equal(lps[0, 0], torch.zeros(2))
    got = shifted_gather_logprobs(logits, torch.tensor([[[0, 0], [0, 1], [3, 3]]]))
    assert torch.allclose(got[0, 1], t([LN(0.1), LN(0.2)])) and torch.allclose(got[0, 2], t([LN(0.1), LN(0.1)]))
    # the temperature divides the logits first
    hot = shifted_gather_logprobs(logits, torch.tensor([[[0, 0], [3, 0], [0, 0]]]), temperature=2.0)
    z = torch.sqrt(t([1, 2, 3, 4]))  # exp(log(x) / 2)
    assert hot[0, 1, 0].item() == pytest.approx(math.log(z[3] / z.sum()), abs=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_kl_topk_gradient_equals_the_formula(temperature):
    """d/dz of sum_k p_k (log p_k - log softmax(z/T)[i_k]) is (1/T) sum_k p_k (softmax(z/T) - e_{i_k}), at the
    position that predicted the token; the teacher gets no gradient."""
    g = torch.Generator().manual_seed(0)
    B, T, V, K = 2, 5, 11, 3
    z = torch.randn(B, T, V, generator=g, dtype=torch.float64).requires_grad_(True)
    teacher_logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    ids, t_lps = shifted_topk_logprobs(teacher_logits, K, temperature)
    t_lps = t_lps.double().requires_grad_(True)
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 1]], dtype=torch.float64)
    loss = forward_kl_topk(shifted_gather_logprobs(z, ids, temperature), t_lps, mask).sum()
    loss.backward()
    expected = torch.zeros(B, T, V, dtype=torch.float64)
    for b in range(B):
        for pos in range(1, T):
            if not mask[b, pos]:
                continue
            p = t_lps.detach()[b, pos].exp()
            q = torch.softmax(z.detach()[b, pos - 1] / temperature, -1)
            onehot = torch.zeros(K, V, dtype=torch.float64)
            onehot[torch.arange(K), ids[b, pos]] = 1.0
            expected[b, pos - 1] = (p[:, None] * (q[None] - onehot)).sum(0) / temperature
    assert torch.allclose(z.grad, expected, atol=1e-10)
    assert t_lps.grad is None or torch.count_nonzero(t_lps.grad) == 0
    # and the value equals the sum written out
    value = sum(float((t_lps.detach()[b, pos].exp() * (t_lps.detach()[b, pos] - torch.log_softmax(
        z.detach()[b, pos - 1] / temperature, -1)[ids[b, pos]])).sum()) for b in range(B) for pos in range(1, T)
        if mask[b, pos])
    assert loss.item() == pytest.approx(value, abs=1e-9)
