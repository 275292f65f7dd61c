"""The experience half of an RL step (:class:`~rlhforge.trainers.rl.RLTrainer`): rollouts in,
training samples out.

    shaped rewards -> (token check) -> old / reference log-probs and values -> advantages and returns
                   -> importance-sampling weights -> rollout metrics

:class:`RLExperience` is a mixin of the trainer (as :class:`~rlhforge.trainers.rl.checkpoints.RLCheckpointing`
is): it reads ``cfg``, ``actor``, ``ref``, ``critic``, ``kl_ctl``, ``gamma``, ``max_new_tokens`` and
``state``, and sets ``old_from_update`` for the update that follows.
"""

from __future__ import annotations

import time

import torch

from rlhforge.algorithms import compute_advantages, compute_kl, is_correction, overlong_penalty, stop_properly_penalty
from rlhforge.workers.experience import ExperienceSample, pad_rows, samples_from_trajectories, unpad_rows
from rlhforge.trainers.rl.metrics import check_tokens
from rlhforge.trainers.rl.distill import needs_student_logprobs, teacher_experience

__all__ = ["RLExperience"]


class RLExperience:
    """Rollouts -> :class:`ExperienceSample` rows with old/ref log-probs, values, advantages, returns
    and IS weights (module docstring)."""

    teacher = None  # on-policy distillation's teacher group (trainers/rl/distill.py), set by the CLI

    def shaped_rewards(self, trajs) -> torch.Tensor:
        cfg = self.cfg.reward
        r = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
        if cfg.overlong_buffer_len is not None:
            lengths = torch.tensor([t.response_length for t in trajs])
            r = r + overlong_penalty(lengths, self.max_new_tokens, int(cfg.overlong_buffer_len),
                                     cfg.overlong_penalty_factor)
        if cfg.stop_properly_penalty_coef is not None:
            r = stop_properly_penalty(r, torch.tensor([t.truncated for t in trajs]), cfg.stop_properly_penalty_coef)
        return r

    @torch.no_grad()
    def make_experience(self, trajs) -> tuple[list[ExperienceSample], dict[str, float]]:
        cfg = self.cfg
        rewards = self.shaped_rewards(trajs)
        samples = samples_from_trajectories(trajs, rewards.tolist())
        checked = check_tokens(trajs, samples) if cfg.train.check_tokens else {}  # --train.check_tokens
        if checked and not getattr(self, "_tokens_check_announced", False):  # once on the console, then metrics
            self._tokens_check_announced = True
            print(f"[rlhforge] --train.check_tokens: {checked['rollout/tokens_checked_samples']:.0f} samples "
                  f"({checked['rollout/tokens_checked_turns']:.0f} engine turns) match what the engine saw and "
                  "produced, token for token; checked every step (rollout/tokens_checked_*)", flush=True)
        mb, temp = cfg.rollout.micro_batch_size, cfg.rollout.temperature
        clock = [time.perf_counter()]  # the phases' split (timing/old_logprobs, reference, values)
        self.old_from_update = self._old_equals_update(len(samples))
        if self.old_from_update:  # pi_old = the update's own forward (ratio 1): no separate pass
            for s in samples:
                s.tensors["old_logprobs"] = s.tensors["rollout_logprobs"]  # a placeholder nothing reads
        else:
            for s, lp in zip(samples, self.actor.map_gather("logprobs", samples, mb, temp)):
                s.tensors["old_logprobs"] = lp
        clock.append(time.perf_counter())
        if self.ref is not None:
            for s, lp in zip(samples, self.ref.map_gather("logprobs", samples, mb, temp)):
                s.tensors["ref_logprobs"] = lp
        clock.append(time.perf_counter())
        if self.critic is not None:
            for s, v in zip(samples, self.critic.map_gather("values", samples, mb)):
                s.tensors["values"] = v
        clock.append(time.perf_counter())
        lengths = [len(s) for s in samples]
        mask = pad_rows([torch.tensor(s.loss_mask, dtype=torch.float32) for s in samples])
        old_lp = pad_rows([s.tensors["old_logprobs"] for s in samples])
        roll_lp = pad_rows([s.tensors["rollout_logprobs"] for s in samples])
        metrics: dict[str, float] = dict(checked)
        metrics.update({f"timing/{k}": b - a for k, a, b in zip(("old_logprobs", "reference", "values"), clock, clock[1:])})
        kl = None
        if self.ref is not None:
            ref_lp = pad_rows([s.tensors["ref_logprobs"] for s in samples])
            kl = compute_kl(old_lp, ref_lp, mask, cfg.algo.kl.estimator)
            per_seq_kl = (kl * mask).sum(1) / mask.sum(1).clamp_min(1)
            metrics["actor/kl_ref"] = float(per_seq_kl.mean())  # the KL controller's input (step())
        distill_kwargs = {}  # on-policy distillation: the teacher's scores (trainers/rl/distill.py)
        if self.teacher is not None:
            distill_kwargs, distill_metrics = teacher_experience(cfg, self.teacher, samples, old_lp, mask)
            metrics.update(distill_metrics)
        adv_cfg = cfg.algo.advantage
        est = adv_cfg.estimator  # no_std_norm only changes the global whitening (group_norm keeps its std)
        values = pad_rows([s.tensors["values"] for s in samples]) if self.critic is not None else None
        use_penalty = kl is not None and not cfg.algo.kl.use_loss
        adv, ret = compute_advantages(
            est, rewards, mask, values=values, kl=kl if use_penalty else None,
            kl_coef=self.kl_ctl.value if use_penalty else 0.0,
            reward_clip=tuple(cfg.reward.clip_range) if cfg.reward.clip_range is not None else None,
            n_samples_per_prompt=cfg.rollout.n_samples_per_prompt, gamma=self.gamma, lam=adv_cfg.lambd,
            whiten_std=not adv_cfg.no_std_norm, **distill_kwargs,
        )
        for s, a, r in zip(samples, unpad_rows(adv, lengths), unpad_rows(ret, lengths)):
            s.tensors["advantages"], s.tensors["returns"] = a, r
        if adv_cfg.is_correction_level != "off":
            th = adv_cfg.is_correction_threshold
            low, high = (None, th[0]) if len(th) == 1 else (th[0], th[1])
            w, _, is_metrics = is_correction(old_lp, roll_lp, mask, level=adv_cfg.is_correction_level,
                                             mode=adv_cfg.is_correction_mode, gating=adv_cfg.is_correction_gating,
                                             low=low, high=high)
            for s, wi in zip(samples, unpad_rows(w, lengths)):
                s.tensors["is_weights"] = wi
            metrics.update({f"rollout/is_{k}": float(v) for k, v in is_metrics.items()})
        m = mask.bool()
        metrics["rollout/shaped_reward_mean"] = float(rewards.mean())
        metrics["rollout/advantage_mean"] = float(adv[m].mean()) if m.any() else 0.0
        metrics["rollout/advantage_std"] = float(adv[m].std()) if m.sum() > 1 else 0.0
        if m.any() and not self.old_from_update:  # else measured in the update's forward
            metrics["rollout/logprob_diff_rollout_vs_train"] = float((roll_lp - old_lp)[m].abs().mean())
            metrics["rollout/vllm_kl"] = float((roll_lp - old_lp)[m].mean())  # OpenRLHF's vllm_kl (signed k1)
        if values is not None:
            metrics["critic/values_before"] = float(values[m].mean()) if m.any() else 0.0
            metrics["critic/returns_mean"] = float(ret[m].mean()) if m.any() else 0.0
        return samples, metrics

    def _old_equals_update(self, num_samples: int) -> bool:
        """True when the old log-probs would equal the update forward's own (detached) log-probs: the
        rollout feeds exactly one optimizer step of one epoch, the actor is trained this step, and
        nothing reads pi_old before the update (no reference model, no IS correction)."""
        cfg = self.cfg
        actor_frozen = self.critic is not None and self.state.global_step < cfg.critic.freezing_steps
        return (num_samples <= cfg.train.batch_size and cfg.train.max_epochs == 1 and self.ref is None
                and cfg.algo.advantage.is_correction_level == "off" and not actor_frozen
                and not needs_student_logprobs(cfg))
