"""Plain-torch recomputation of what the trainers compute, written apart from ``rlhforge.algorithms``.

Nothing here imports rlhforge: models are loaded with ``transformers`` from the tiny model's folder
(and, where a test needs the weights a trainer held at some moment, given that state dict), every
sequence runs through its own unbatched forward (no padding, no packing), and the formulas are
OpenRLHF 0.11's (``/work/shared/reference/openrlhf-internals.md`` section 3), written out loop by loop
where that is clearer than vectorised code. The forward passes run in float64, so the reference is
more accurate than the float32 trainer it checks.

Also here: :class:`StepRecorder`, the instrumentation the tests put around a strategy's ``step``: it
copies every ``param.grad`` (and the weights the gradients were taken at) and then calls the real
``step``, so the optimizer still updates the model. The tests assert losses and gradients, never
the parameter update (the learning-rate schedule is not what they check).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

KL_CLAMP = 10.0  # OpenRLHF clamps every KL estimate to [-10, 10]


# ------------------------------------------------------------------------------------------ models


def causal_lm(model_dir, state: dict | None = None):
    """A fresh HF causal LM from ``model_dir`` (optionally with ``state`` loaded), float64, train mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state)
    return model.double().train()


def sequence_classifier(model_dir, state: dict):
    """A fresh HF one-label sequence classifier from ``model_dir`` with ``state`` (it holds the head)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    model.load_state_dict(state)
    return model.double().train()


def logits_of(model, ids: list[int]) -> torch.Tensor:
    """[L, V] float64 logits of one unpadded sequence."""
    return model(input_ids=torch.tensor([ids])).logits[0].double()


def token_logprobs(logits: torch.Tensor, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """[L]: entry t = log p(ids[t] | ids[:t]) under softmax(logits / T); entry 0 = 0."""
    logp = torch.log_softmax(logits[:-1] / temperature, dim=-1)
    picked = logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    return torch.cat([picked.new_zeros(1), picked])


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """[L]: entry t = entropy of the distribution that predicted token t; entry 0 = 0."""
    z = logits[:-1] / temperature
    p = torch.softmax(z, dim=-1)
    h = torch.logsumexp(z, dim=-1) - (p * z).sum(-1)
    return torch.cat([h.new_zeros(1), h])


def token_values(critic, ids: list[int]) -> torch.Tensor:
    """[L]: V[t] = the value head on the hidden state at t - 1 (the state before token t); V[0] = 0."""
    hidden = critic.model(input_ids=torch.tensor([ids])).last_hidden_state[0].double()
    head = critic.score(hidden)[:, 0]
    return torch.cat([head.new_zeros(1), head[:-1]])


def last_token_reward(rm, ids: list[int]) -> torch.Tensor:
    """Reward of one unpadded sequence: the value head at its last token. 0-dim."""
    hidden = rm.model(input_ids=torch.tensor([ids])).last_hidden_state[0].double()
    return rm.score(hidden[-1])[0]


# ------------------------------------------------------------------------------------------ RL maths


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate, clamped to [-10, 10] (OpenRLHF ``compute_approx_kl``)."""
    x = logp - ref_logp
    if estimator == "k1":
        k = x
    elif estimator == "k2":
        k = x * x / 2
    elif estimator == "k3":
        k = torch.exp(-x) - 1 + x
    else:
        raise ValueError(estimator)
    return k.clamp(-KL_CLAMP, KL_CLAMP)


def group_norm_scalars(rewards: list[float], n: int, eps: float) -> list[float]:
    """GRPO: (R_ij - mean_j) / (unbiased std_j + eps), groups of n consecutive samples."""
    out = []
    for g in range(0, len(rewards), n):
        group = rewards[g : g + n]
        mean = sum(group) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (n - 1))
        out += [(r - mean) / (std + eps) for r in group]
    return out


def token_rewards(length: int, actions: list[int], scalar: float, kl: torch.Tensor, beta: float) -> torch.Tensor:
    """[L]: r_t = 1[t = last action token] * R - beta * KL_t on action tokens, 0 elsewhere."""
    r = torch.zeros(length, dtype=torch.float64)
    for t in actions:
        r[t] = -beta * float(kl[t])
    r[actions[-1]] += scalar
    return r


def returns_to_go(r: torch.Tensor, actions: list[int], gamma: float = 1.0) -> torch.Tensor:
    """[L]: G_t = sum_{s >= t, s an action token} gamma^(s-t) r_s on action tokens."""
    g = torch.zeros_like(r)
    running = 0.0
    for t in reversed(actions):
        running = float(r[t]) + gamma * running
        g[t] = running
    return g


def gae(r: torch.Tensor, v: torch.Tensor, actions: list[int], gamma: float, lam: float):
    """(A, R) on action tokens: delta_t = r_t + gamma V_{t+1} - V_t (V = 0 after the last action
    token), A_t = delta_t + gamma lam A_{t+1}, R_t = A_t + V_t."""
    adv, ret = torch.zeros_like(r), torch.zeros_like(r)
    next_v = next_a = 0.0
    for t in reversed(actions):
        delta = float(r[t]) + gamma * next_v - float(v[t])
        a = delta + gamma * lam * next_a
        adv[t], ret[t] = a, a + float(v[t])
        next_v, next_a = float(v[t]), a
    return adv, ret


def whiten_all(advs: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Global whitening over every action token: (A - mean) / sqrt(max(population var, 1e-8))."""
    flat = torch.cat([a[m.bool()] for a, m in zip(advs, masks)])
    mean = flat.mean()
    var = ((flat - mean) ** 2).mean()
    rstd = 1.0 / math.sqrt(max(float(var), 1e-8))
    return [torch.where(m.bool(), (a - mean) * rstd, torch.zeros_like(a)) for a, m in zip(advs, masks)]


def ppo_token_losses(logp, old_logp, adv, eps_low: float, eps_high: float):
    """Per-token PPO loss -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A) and the clipped flags."""
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))
    s1 = ratio * adv
    s2 = ratio.clamp(1 - eps_low, 1 + eps_high) * adv
    return -torch.minimum(s1, s2), s2 < s1


def value_token_losses(v, v_old, ret, clip: float | None):
    """Per-token 0.5 * max((V_clip - R)^2, (V - R)^2) (V_clip = V_old + clip(V - V_old, +-eps)) and
    the flags where the clipped branch was strictly larger."""
    unclipped = (v - ret) ** 2
    if clip is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    v_clip = v_old + (v - v_old).clamp(-clip, clip)
    clipped = (v_clip - ret) ** 2
    return 0.5 * torch.maximum(clipped, unclipped), clipped > unclipped


# ------------------------------------------------------------------------------------------ preference maths


def dpo_pair_loss(pc, pr, rc, rr, beta: float):
    """-log sigmoid(beta ((pc - pr) - (rc - rr))) of summed response log-probs."""
    return -F.logsigmoid(beta * ((pc - pr) - (rc - rr)))


def rm_pair_loss(r_chosen, r_rejected):
    return -F.logsigmoid(r_chosen - r_rejected)


# ------------------------------------------------------------------------------------------ instrumentation


class StepRecorder:
    """Wraps ``strategy.step`` of one strategy instance: before each real step, copies the weights the
    gradients were computed at (``state``: the module's state dict, tied weights included) and every
    ``param.grad`` (``grads``: by parameter name), then runs the real step."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.records: list[dict] = []
        self._real_step = strategy.step
        strategy.step = self._step

    def _step(self, *args, **kwargs):
        module = self.strategy.module
        self.records.append({
            "state": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "grads": {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None},
        })
        out = self._real_step(*args, **kwargs)
        self.records[-1]["stats"] = out
        return out


def assert_grads_close(got: dict, want: dict, tol: float = 1e-5, what: str = "") -> float:
    """Every parameter gradient the trainer had equals the recomputed one: max |got - want| <= tol *
    max(1, max |want|) per tensor. Returns the largest absolute difference seen."""
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want)))
    worst = 0.0
    for name, g in got.items():
        w = want[name]
        diff = float((g.double() - w).abs().max())
        scale = max(1.0, float(w.abs().max()))
        assert diff <= tol * scale, \
            f"{what} grad of {name}: max |diff| {diff:.3g} (max |grad| {float(w.abs().max()):.3g})"
        worst = max(worst, diff)
    return worst
