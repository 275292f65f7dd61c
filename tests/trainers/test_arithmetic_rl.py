"""The RL trainer's own arithmetic, checked against an independent plain-torch computation.

One RL step of the real :class:`~rlhforge.trainers.rl.RLTrainer` (built by the CLI's
``parse_rl_args`` + ``build_trainer`` on the tiny local model, one process, fp32 on CPU) runs on
FIXED trajectories built here (prompt tokens of the run's own prompts, responses of chosen token
ids, rewards of chosen values), through ``trainer.step`` (experience, advantages, every optimizer
step, weight sync). The test then recomputes from the raw token ids, with the formulas of OpenRLHF
0.11 written out in ``tests/trainers/arithmetic_ref.py`` (no rlhforge.algorithms, no rlhforge
forward code, one unpadded float64 HF forward per sequence):

- old log-probs (a fresh HF copy with the weights the actor had at experience time), reference
  log-probs (a fresh copy of the initial model), critic values, the k1 KL to the reference, the
  GRPO group-normalised reward (unbiased std, eps 1e-6 as rlhforge documents; OpenRLHF's 1e-9 is
  within the tolerance here) or GAE (gamma 1, lambda 0.95) with global whitening, returns;
- for each optimizer step: the clipped PPO loss as a token mean over that step's whole batch
  (both micro-batches), the clipped value loss likewise, and the gradient of every parameter;
- the logged metrics (policy loss, clip fraction, entropy, approx KL, value loss, value clip
  fraction, values mean, KL to the reference).

How the gradient is read: ``StepRecorder`` wraps the worker strategy's ``step`` (instrumentation,
not a mock): it copies every ``param.grad`` and the weights they were taken at, then runs the real
step. Which samples each optimizer step got is read by wrapping the worker's ``train_step`` the
same way. A first, warm-up RL step (real, on other fixed trajectories) moves the actor away from
the reference so the KL terms are not zero; its learning rate and update are not asserted (the
warm-up schedule is being changed), only that whatever weights the step used give the numbers.

The KL controller is fixed (no target) and the KL small, so no clamp binds; gamma = 1.
"""

from __future__ import annotations

import pytest
import torch

from rlhforge.cli.train_ppo_ray import build_trainer, parse_rl_args
from tests.rl.helpers import rl_args, write_reward
from tests.trainers import arithmetic_ref as ref
from tests.trainers.fixed_rollouts import N, REWARDS, fixed_trajectories, rollout_batch

BETA = 0.05
EPS_CLIP = 0.1
VALUE_CLIP = 0.05
LAMBDA = 0.95
TEMPERATURE = 0.8
GRPO_EPS = 1e-6
TOL = 1e-5

CASES = {
    "grpo": ("group_norm", []),
    "grpo_kl_loss": ("group_norm", ["--algo.kl.use_loss", "--algo.kl.estimator", "k3"]),
    "ppo_gae": ("gae", ["--critic.value_clip", VALUE_CLIP, "--critic.adam.lr", "1e-3", "--critic.lr_warmup_ratio", "0",
                        "--algo.advantage.lambd", LAMBDA]),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _trainer(model_dir, tmp_path, estimator, extra):
    args = rl_args(model_dir, tmp_path / "run", "--reward.remote_url", write_reward(tmp_path / "reward.py"),
                   "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", N, "--train.batch_size", "4",
                   "--train.micro_batch_size", "2", "--rollout.micro_batch_size", "4",
                   "--rollout.temperature", TEMPERATURE, "--actor.adam.lr", "1e-2", "--actor.eps_clip", EPS_CLIP,
                   "--algo.kl.init_coef", BETA, "--algo.advantage.gamma", "1", "--train.workers", "local",
                   "--logger.progress_bar", "off", *extra, estimator=estimator)
    return build_trainer(parse_rl_args(args))


class _TrainStepRecorder:
    """Wraps a worker's ``train_step``: records the samples of each optimizer step and what it returned."""

    def __init__(self, worker):
        self.calls: list[tuple[list, dict]] = []
        real = worker.train_step

        def train_step(samples, *args, **kwargs):
            out = real(samples, *args, **kwargs)
            self.calls.append((list(samples), out))
            return out

        worker.train_step = train_step


def _close(a, b, what, tol=TOL):
    assert abs(float(a) - float(b)) <= tol * max(1.0, abs(float(b))), \
        f"{what}: trainer {float(a):.9g} vs recomputed {float(b):.9g}"


def _close_tokens(got: torch.Tensor, want: torch.Tensor, actions, what, tol=TOL):
    g, w = got.double()[actions], want[actions]
    diff = float((g - w).abs().max())
    assert diff <= tol * max(1.0, float(w.abs().max())), f"{what}: max |diff| {diff:.3g}\n trainer {g}\n recomputed {w}"


@pytest.mark.parametrize("case", list(CASES))
def test_one_rl_step_matches_an_independent_computation(tiny_model_dir, tmp_path, case):
    estimator, extra = CASES[case]
    use_loss = "--algo.kl.use_loss" in extra
    kl_est = "k3" if use_loss else "k1"
    trainer = _trainer(tiny_model_dir, tmp_path, estimator, extra)
    actor_w = trainer.actor.local
    critic_w = trainer.critic.local if trainer.critic is not None else None
    assert (critic_w is not None) == (estimator == "gae")

    try:
        trainer.step(rollout_batch(fixed_trajectories(trainer, seed=1), 0))  # warm-up: the actor leaves the reference
        actor_steps, actor_calls = ref.StepRecorder(actor_w.strategy), _TrainStepRecorder(actor_w)
        if critic_w is not None:
            critic_steps, critic_calls = ref.StepRecorder(critic_w.strategy), _TrainStepRecorder(critic_w)
        trajs = fixed_trajectories(trainer, seed=2)
        metrics = trainer.step(rollout_batch(trajs, 1))
    finally:
        trainer.logger.close()
    assert len(actor_steps.records) == len(actor_calls.calls) == 2

    # ---- experience, recomputed -----------------------------------------------------------------
    by_ids = {tuple(t.token_ids): i for i, t in enumerate(trajs)}
    ids = [t.token_ids for t in trajs]
    actions = [list(range(t.prompt_len, len(t.token_ids))) for t in trajs]
    masks = [torch.tensor(t.action_mask(), dtype=torch.float64) for t in trajs]
    with torch.no_grad():
        old_model = ref.causal_lm(tiny_model_dir, actor_steps.records[0]["state"])  # weights at experience time
        ref_model = ref.causal_lm(tiny_model_dir)  # the initial policy
        old = [ref.token_logprobs(ref.logits_of(old_model, x), x, TEMPERATURE) for x in ids]
        ref_lp = [ref.token_logprobs(ref.logits_of(ref_model, x), x, TEMPERATURE) for x in ids]
        kl = [ref.kl_estimate(o, r, kl_est) * m for o, r, m in zip(old, ref_lp, masks)]
        values = None
        if critic_w is not None:
            critic0 = ref.sequence_classifier(tiny_model_dir, critic_steps.records[0]["state"])
            values = [ref.token_values(critic0, x) * m for x, m in zip(ids, masks)]
    assert max(float(k.abs().max()) for k in kl) > 1e-3, "the warm-up step should have moved the actor"
    assert max(float(k.abs().max()) for k in kl) < 5.0  # well inside the [-10, 10] KL clamp
    penalty = 0.0 if use_loss else BETA
    if estimator == "group_norm":
        scalars = ref.group_norm_scalars(REWARDS, N, GRPO_EPS)
        adv = [ref.returns_to_go(ref.token_rewards(len(x), a, s, k, penalty), a) for x, a, s, k in
               zip(ids, actions, scalars, kl)]
        ret = [a.clone() for a in adv]
    else:
        raw = [ref.gae(ref.token_rewards(len(x), a, r, k, penalty), v, a, 1.0, LAMBDA) for x, a, r, k, v in
               zip(ids, actions, REWARDS, kl, values)]
        adv = ref.whiten_all([a for a, _ in raw], masks)
        ret = [r for _, r in raw]

    seen = {}
    for samples, _ in actor_calls.calls:
        for s in samples:
            i = by_ids[tuple(s.input_ids)]
            seen[i] = s
            _close_tokens(s.tensors["old_logprobs"], old[i], actions[i], f"old log-probs of sample {i}")
            _close_tokens(s.tensors["ref_logprobs"], ref_lp[i], actions[i], f"reference log-probs of sample {i}")
            _close_tokens(s.tensors["advantages"], adv[i], actions[i], f"advantages of sample {i}")
            if values is not None:
                _close_tokens(s.tensors["values"], values[i], actions[i], f"critic values of sample {i}")
                _close_tokens(s.tensors["returns"], ret[i], actions[i], f"returns of sample {i}")
    assert sorted(seen) == list(range(len(trajs)))  # every sample trained on once
    per_seq_kl = [float(k.sum() / m.sum()) for k, m in zip(kl, masks)]
    _close(metrics["actor/kl_ref"], sum(per_seq_kl) / len(per_seq_kl), "actor/kl_ref")
    # OpenRLHF's vllm_kl: the token mean of rollout - trainer log-probs (the fixed rollouts carry -1.0)
    gaps = [-1.0 - float(old[i][a]) for i in range(len(trajs)) for a in actions[i]]
    _close(metrics["rollout/vllm_kl"], sum(gaps) / len(gaps), "rollout/vllm_kl")
    assert trainer.kl_ctl.value == pytest.approx(BETA)  # fixed controller

    # ---- each actor optimizer step, recomputed ----------------------------------------------------
    step_metrics = []
    for k, (record, (samples, got)) in enumerate(zip(actor_steps.records, actor_calls.calls)):
        model = ref.causal_lm(tiny_model_dir, record["state"])
        idx = [by_ids[tuple(s.input_ids)] for s in samples]
        n_tok = sum(len(actions[i]) for i in idx)
        pg = kl_term = 0.0
        clipped = ent = approx = 0.0
        for i in idx:
            a = actions[i]
            logits = ref.logits_of(model, ids[i])
            logp = ref.token_logprobs(logits, ids[i], TEMPERATURE)
            tok_loss, was_clipped = ref.ppo_token_losses(logp[a], old[i][a], adv[i][a], EPS_CLIP, EPS_CLIP)
            pg = pg + tok_loss.sum() / n_tok
            if use_loss:
                kl_term = kl_term + ref.kl_estimate(logp[a], ref_lp[i][a], kl_est).sum() / n_tok
            with torch.no_grad():
                log_ratio = logp[a] - old[i][a]
                clipped += float(was_clipped.double().sum()) / n_tok
                ent += float(ref.token_entropy(logits, TEMPERATURE)[a].sum()) / n_tok
                approx += float((torch.expm1(log_ratio) - log_ratio).sum()) / n_tok  # rlhforge's documented k3
        loss = pg + BETA * kl_term if use_loss else pg
        loss.backward()
        want_grads = {n: p.grad for n, p in model.named_parameters()}
        ref.assert_grads_close(record["grads"], want_grads, TOL, f"actor step {k}")
        _close(got["policy_loss"], pg, f"actor step {k} policy_loss")
        _close(got["clip_frac"], clipped, f"actor step {k} clip_frac")
        _close(got["entropy"], ent, f"actor step {k} entropy")
        _close(got["approx_kl"], approx, f"actor step {k} approx_kl")
        if use_loss:
            _close(got["kl_loss"], kl_term, f"actor step {k} kl_loss")
        step_metrics.append({"policy_loss": float(pg), "clip_frac": clipped, "entropy": ent, "approx_kl": approx})
    for key in ("policy_loss", "clip_frac", "entropy", "approx_kl"):
        _close(metrics[f"actor/{key}"], sum(m[key] for m in step_metrics) / len(step_metrics), f"actor/{key}")
    # the second optimizer step sees moved weights: the PPO clip binds on some tokens there
    assert step_metrics[1]["clip_frac"] > 0, step_metrics

    # ---- each critic optimizer step, recomputed ---------------------------------------------------
    if critic_w is None:
        return
    assert len(critic_steps.records) == len(critic_calls.calls) == 2
    crit_metrics = []
    for k, (record, (samples, got)) in enumerate(zip(critic_steps.records, critic_calls.calls)):
        critic = ref.sequence_classifier(tiny_model_dir, record["state"])
        idx = [by_ids[tuple(s.input_ids)] for s in samples]
        n_tok = sum(len(actions[i]) for i in idx)
        vl, clip_frac, v_mean = 0.0, 0.0, 0.0
        for i in idx:
            a = actions[i]
            v = ref.token_values(critic, ids[i])[a]
            tok_loss, was_clipped = ref.value_token_losses(v, values[i][a], ret[i][a], VALUE_CLIP)
            vl = vl + tok_loss.sum() / n_tok
            clip_frac += float(was_clipped.double().sum()) / n_tok
            v_mean += float(v.detach().sum()) / n_tok
        vl.backward()
        ref.assert_grads_close(record["grads"], {n: p.grad for n, p in critic.named_parameters()}, TOL,
                               f"critic step {k}")
        _close(got["value_loss"], vl, f"critic step {k} value_loss")
        _close(got["clip_frac"], clip_frac, f"critic step {k} clip_frac")
        _close(got["values_mean"], v_mean, f"critic step {k} values_mean")
        crit_metrics.append({"value_loss": float(vl), "clip_frac": clip_frac, "values_mean": v_mean})
    for key in ("value_loss", "clip_frac", "values_mean"):
        _close(metrics[f"critic/{key}"], sum(m[key] for m in crit_metrics) / len(crit_metrics), f"critic/{key}")
    # the second optimizer step sees moved weights: the value clip binds on some tokens there
    assert crit_metrics[1]["clip_frac"] > 0, crit_metrics
