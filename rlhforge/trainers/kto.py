"""KTO's objective for the preference loop of :mod:`rlhforge.trainers.dpo` (``rlhforge kto``).

A KTO micro-batch is a batch of :class:`~rlhforge.data.unpaired.UnpairedSample` run as pairs: ``chosen`` is the
example (prompt + its completion, labelled desirable or not), ``rejected`` its mismatched sequence (the prompt
with another example's completion). Per micro-batch, as TRL's ``KTOTrainer`` per ``compute_loss``:

1. the reference point ``z``: the mean log-ratio ``log pi - log pi_ref`` of the mismatched sequences, averaged
   over every data-parallel rank's micro-batch (one all-reduce of a sum and a count), clamped at 0, detached
   (``apo_zero_unpaired`` has none; its ``kl`` metric is still reported);
2. per example the loss of :mod:`rlhforge.algorithms.unpaired_losses`, weighted by its label's weight.

The step loss is the mean over every example of the optimizer step on all ranks (the loop's normaliser), as
TRL's ``losses.mean()``. Metrics: loss, kl (``z`` before clamping, averaged over micro-batches), the implicit
rewards ``beta h`` of desirable and undesirable examples and their margin, their summed log-probs, the share of
desirable examples, tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhforge.algorithms.unpaired_losses import kto_losses, kto_reference_point

__all__ = ["KTOObjective"]


class KTOObjective:
    UNIT = "examples"
    FIELDS = ("loss", "kl", "kl_passes", "desirable", "desirable_reward", "undesirable_reward", "desirable_logp",
              "undesirable_logp", "tokens")

    def __init__(self, cfg, strategy):
        self.m, self.strategy = cfg.model, strategy

    def reference_point(self, mismatched_logratios: Tensor) -> tuple[Tensor, Tensor]:
        """(z, the unclamped rank-averaged KL estimate) from this rank's mismatched log-ratios [B]."""
        local = torch.stack([mismatched_logratios.detach().double().sum(),
                             torch.tensor(float(mismatched_logratios.numel()), dtype=torch.float64,
                                          device=mismatched_logratios.device)])
        total = self.strategy.all_reduce(local, op="sum")  # every rank's micro-batch k (copies cancel out)
        kl = total[0] / total[1].clamp(min=1)
        return kto_reference_point(kl), kl

    def __call__(self, sums: Tensor, ref: Tensor, token_logps: Tensor, mask: Tensor, samples) -> tuple[Tensor, dict]:
        m, n = self.m, len(samples)
        policy, reference = sums[:n], ref[:n].to(sums.dtype)
        z, kl = self.reference_point(sums[n:].detach() - ref[n:].to(sums.dtype))
        desirable = torch.tensor([s.desirable for s in samples], dtype=torch.bool, device=sums.device)
        losses, rewards = kto_losses(m.loss_type, policy, reference, desirable, beta=m.beta, reference_point=z,
                                     desirable_weight=m.desirable_weight, undesirable_weight=m.undesirable_weight)
        r, logps = rewards.double(), policy.detach().double()
        totals = dict(zip(self.FIELDS, (
            losses.sum(), kl, 1.0, desirable.sum(), r[desirable].sum(), r[~desirable].sum(), logps[desirable].sum(),
            logps[~desirable].sum(), sum(len(s.chosen_ids) for s in samples))))
        return losses.sum(), totals

    def metrics(self, t: dict[str, float], examples: float, prefix: str) -> dict[str, float]:
        t = {k: float(t.get(k, 0.0)) for k in self.FIELDS}
        good, bad = t["desirable"], examples - t["desirable"]
        out = {f"{prefix}/loss": t["loss"] / examples, f"{prefix}/kl": t["kl"] / max(t["kl_passes"], 1e-12)}
        d = t["desirable_reward"] / good if good else 0.0
        u = t["undesirable_reward"] / bad if bad else 0.0
        out.update({f"{prefix}/desirable_reward": d, f"{prefix}/undesirable_reward": u,
                    f"{prefix}/reward_margin": d - u,
                    f"{prefix}/desirable_logp": t["desirable_logp"] / good if good else 0.0,
                    f"{prefix}/undesirable_logp": t["undesirable_logp"] / bad if bad else 0.0,
                    f"{prefix}/desirable_fraction": good / examples, f"{prefix}/examples": examples,
                    f"{prefix}/tokens": t["tokens"]})
        return out

    @staticmethod
    def bar(metrics: dict[str, float]) -> dict[str, float]:
        return {"loss": metrics["train/loss"], "kl": metrics["train/kl"], "margin": metrics["train/reward_margin"]}
