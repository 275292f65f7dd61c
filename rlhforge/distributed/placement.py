"""Where the Ray worker groups go: a pure plan from group sizes and colocation flags.

One *bundle* is one device's worth of resources: ``{"GPU": 1, "CPU": 1}`` on GPUs, ``{"CPU": 1}``
on CPU-only clusters. Rank ``i`` of a group sits on bundle ``i`` of its placement group. Models
that are colocated share a placement group, and each takes ``1 / (models sharing it)`` of every
bundle (OpenRLHF gives each 0.2 GPU; the fraction only matters to Ray's bookkeeping):

=========================  ===============================================================
(no flag)                  one placement group per model
``colocate_actor_ref``     actor + ref share one (their sizes must be equal)
``colocate_critic_reward`` critic + reward model (the reward model runs in the driver here,
                           so the critic keeps its own group)
``colocate_all``           actor, ref and critic share one (the hybrid engine; the vLLM
                           engines live beside them, in the driver process, on CPU)
=========================  ===============================================================
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhforge.config.parsing import ConfigError

__all__ = ["GroupPlacement", "PlacementPlan", "plan_placement", "check_resources"]


@dataclass(frozen=True)
class GroupPlacement:
    name: str
    num_workers: int
    pg: str
    """Key of the placement group this model's ranks live in."""
    share: float
    """Fraction of each bundle this model's ranks request."""


@dataclass(frozen=True)
class PlacementPlan:
    device: str
    """``cpu`` or ``cuda``."""
    bundles: dict[str, int]
    """Placement group key -> number of bundles."""
    groups: dict[str, GroupPlacement]

    @property
    def total_bundles(self) -> int:
        return sum(self.bundles.values())

    def bundle(self) -> dict[str, float]:
        return {"GPU": 1.0, "CPU": 1.0} if self.device == "cuda" else {"CPU": 1.0}

    def describe(self) -> str:
        parts = []
        for key, n in self.bundles.items():
            members = [f"{g.name} x{g.num_workers}" for g in self.groups.values() if g.pg == key]
            parts.append(f"[{' + '.join(members)}] on {n} {'GPU' if self.device == 'cuda' else 'CPU'} bundle(s)")
        return "; ".join(parts)


def plan_placement(sizes: dict[str, int], *, device: str, colocate_all: bool = False,
                   colocate_actor_ref: bool = False) -> PlacementPlan:
    """``sizes``: model name -> workers (``num_nodes x num_gpus_per_node``), e.g.
    ``{"actor": 2, "ref": 2, "critic": 2}``. Models absent from ``sizes`` are not placed."""
    for name, n in sizes.items():
        if n < 1:
            raise ConfigError(f"--{name}.num_nodes x --{name}.num_gpus_per_node must be >= 1 (got {n})")
    members: dict[str, list[str]] = {}
    if colocate_all:
        members["all"] = list(sizes)
    else:
        for name in sizes:
            key = "actor" if (colocate_actor_ref and name == "ref" and "actor" in sizes) else name
            members.setdefault(key, []).append(name)
        if colocate_actor_ref and "ref" in sizes and "actor" in sizes and sizes["ref"] != sizes["actor"]:
            raise ConfigError(f"--train.colocate_actor_ref needs as many ref workers as actor workers "
                              f"(actor {sizes['actor']}, ref {sizes['ref']})")
    bundles = {key: max(sizes[m] for m in names) for key, names in members.items()}
    groups = {name: GroupPlacement(name, sizes[name], key, 1.0 / len(names))
              for key, names in members.items() for name in names}
    return PlacementPlan(device=device, bundles=bundles, groups=groups)


def check_resources(plan: PlacementPlan, available: dict[str, float]) -> None:
    """Fail before creating anything when the cluster cannot hold the plan (Ray would wait forever)."""
    kind = "GPU" if plan.device == "cuda" else "CPU"
    need = plan.total_bundles
    have = float(available.get(kind, 0.0))
    if need > have + 1e-9:
        hint = "" if len(plan.bundles) == 1 else "; colocate the models (--train.colocate_all) or "
        raise ConfigError(
            f"the Ray workers need {need} {kind} bundle(s) ({plan.describe()}) but the Ray cluster has {have:g} "
            f"free {kind}(s){hint or '; '}use fewer workers (--actor.num_gpus_per_node ...) or a bigger cluster"
        )
