"""Where the Ray worker groups and the generation engines go: a pure plan from sizes and flags.

One *bundle* is one device's worth of resources: ``{"GPU": 1, "CPU": 1}`` on GPUs, ``{"CPU": 1}``
on CPU-only clusters. Rank ``i`` of a model sits on bundle ``i`` of its placement group; engine
``i`` of ``N`` (tensor parallel size ``T``) sits on ``T`` bundles. Members that are colocated share
a placement group, and each takes ``1 / (members)`` of every bundle (the engines count as one
member; OpenRLHF's hybrid engine gives each 0.2 GPU; the fraction only matters to Ray's
bookkeeping):

=========================  ===============================================================
(no flag)                  one placement group per model (``actor``, ``ref``, ``critic``,
                           ``reward``) and one per engine (``engine0`` ... of ``T`` bundles)
``colocate_actor_ref``     actor + ref share one (their sizes must be equal)
``colocate_critic_reward`` critic + reward model share one (their sizes must be equal)
``colocate_all``           actor, ref, critic, reward *and* the engines share ``all``; engine
                           ``i`` sits on bundles ``[i*T, (i+1)*T)`` (the hybrid engine)
=========================  ===============================================================

:func:`check_resources` compares the plan with the cluster before anything is created and spells
out the arithmetic (and the colocation flag that would make it fit) when it does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlhforge.config.parsing import ConfigError

__all__ = ["GroupPlacement", "EnginePlacement", "PlacementPlan", "plan_placement", "plan_sizes", "plan_from_config", "check_resources"]

MODELS = ("actor", "ref", "critic", "reward", "teacher")


@dataclass(frozen=True)
class GroupPlacement:
    name: str
    num_workers: int
    pg: str
    """Key of the placement group this model's ranks live in."""
    share: float
    """Fraction of each bundle this model's ranks request."""


@dataclass(frozen=True)
class EnginePlacement:
    index: int
    """Engine number ``0..N-1``."""
    pg: str
    """Key in :attr:`PlacementPlan.bundles`."""
    bundle_indices: tuple[int, ...]
    """The ``tensor_parallel_size`` bundles of that placement group the engine's workers use."""
    share: float
    """Fraction of each bundle the engine requests (``num_gpus`` on GPU, ``num_cpus`` on CPU)."""


@dataclass(frozen=True)
class PlacementPlan:
    device: str
    """``cpu`` or ``cuda``."""
    bundles: dict[str, int]
    """Placement group key -> number of bundles."""
    groups: dict[str, GroupPlacement]
    engines: tuple[EnginePlacement, ...] = ()
    colocation: tuple[str, ...] = field(default=())
    """The colocation flags the plan was made with (``colocate_all`` ...), for messages."""

    @property
    def total_bundles(self) -> int:
        return sum(self.bundles.values())

    @property
    def engine_tp(self) -> int:
        return len(self.engines[0].bundle_indices) if self.engines else 0

    def bundle(self) -> dict[str, float]:
        return {"GPU": 1.0, "CPU": 1.0} if self.device == "cuda" else {"CPU": 1.0}

    def members(self, key: str) -> list[str]:
        """Who lives in placement group ``key``: model names, then ``engine i`` entries."""
        return ([g.name for g in self.groups.values() if g.pg == key]
                + [f"engine {e.index}" for e in self.engines if e.pg == key])

    def describe(self) -> str:
        unit = "GPU" if self.device == "cuda" else "CPU"
        parts = []
        for key, n in self.bundles.items():
            members = [f"{g.name} x{g.num_workers}" for g in self.groups.values() if g.pg == key]
            engines = [e for e in self.engines if e.pg == key]
            if engines:
                members.append(f"{len(engines)} engine(s) x TP {self.engine_tp}")
            parts.append(f"[{' + '.join(members)}] on {n} {unit} bundle(s)")
        return "; ".join(parts)


def plan_placement(sizes: dict[str, int], *, device: str, colocate_all: bool = False,
                   colocate_actor_ref: bool = False, colocate_critic_reward: bool = False,
                   num_engines: int = 0, engine_tp: int = 1) -> PlacementPlan:
    """``sizes``: model name -> workers (``num_nodes x num_gpus_per_node``), e.g.
    ``{"actor": 8, "ref": 8, "critic": 8, "reward": 8}``. Models absent from ``sizes`` are not placed;
    ``num_engines`` generation engines of ``engine_tp`` bundles each are (0: none)."""
    for name, n in sizes.items():
        if n < 1:
            raise ConfigError(f"--{name}.num_nodes x --{name}.num_gpus_per_node must be >= 1 (got {n})")
    num_engines = num_engines or 0
    if num_engines < 0:
        raise ConfigError(f"--vllm.num_engines must be >= 0 (got {num_engines})")
    if num_engines and engine_tp < 1:
        raise ConfigError(f"--vllm.tensor_parallel_size must be >= 1 (got {engine_tp})")
    members: dict[str, list[str]] = {}
    if colocate_all:
        members["all"] = list(sizes)
    else:
        for pair, flag in ((("actor", "ref"), "colocate_actor_ref"), (("actor", "teacher"), "colocate_actor_ref"),
                           (("critic", "reward"), "colocate_critic_reward")):
            a, b = pair
            wanted = colocate_actor_ref if flag == "colocate_actor_ref" else colocate_critic_reward
            if wanted and a in sizes and b in sizes and sizes[a] != sizes[b]:
                raise ConfigError(f"--train.{flag} needs as many {b} workers as {a} workers "
                                  f"({a} {sizes[a]}, {b} {sizes[b]})")
        for name in sizes:
            key = name
            if colocate_actor_ref and name in ("ref", "teacher") and "actor" in sizes:  # the teacher placed as the ref
                key = "actor"
            if colocate_critic_reward and name == "reward" and "critic" in sizes:
                key = "critic"
            members.setdefault(key, []).append(name)
    bundles = {key: max(sizes[m] for m in names) for key, names in members.items()}
    engines: list[EnginePlacement] = []
    if colocate_all and num_engines:
        n = bundles.get("all", 0)
        if num_engines * engine_tp > n:
            raise ConfigError(f"--train.colocate_all puts the engines on the models' bundles: {num_engines} engines x "
                              f"TP {engine_tp} = {num_engines * engine_tp} bundles, but the shared group has {n} "
                              f"(the largest of {', '.join(f'{m} {sizes[m]}' for m in sizes)}); use fewer engines "
                              f"(--vllm.num_engines) or a smaller --vllm.tensor_parallel_size")
        actor = sizes.get("actor", 0)
        if device == "cuda" and num_engines * engine_tp > actor:
            raise ConfigError(f"--train.colocate_all on GPUs: {num_engines} engines x TP {engine_tp} = "
                              f"{num_engines * engine_tp} GPUs, but the actor has {actor} rank(s); a colocated engine "
                              f"loads its weights by CUDA IPC from the actor rank on its own GPU, so every engine GPU "
                              f"needs one: use at most {actor // engine_tp} engine(s) at TP {engine_tp}, or more "
                              f"actor ranks (--actor.num_gpus_per_node)")
        share = 1.0 / (len(members["all"]) + 1)
        engines = [EnginePlacement(i, "all", tuple(range(i * engine_tp, (i + 1) * engine_tp)), share)
                   for i in range(num_engines)]
    else:
        for i in range(num_engines):
            bundles[f"engine{i}"] = engine_tp
            engines.append(EnginePlacement(i, f"engine{i}", tuple(range(engine_tp)), 1.0))
    with_engines = engines[0].pg if engines else None  # the engines count as one member of a shared group
    shares = {key: 1.0 / (len(names) + (key == with_engines)) for key, names in members.items()}
    groups = {name: GroupPlacement(name, sizes[name], key, shares[key])
              for key, names in members.items() for name in names}
    flags = tuple(f for f, on in (("colocate_all", colocate_all), ("colocate_actor_ref", colocate_actor_ref),
                                  ("colocate_critic_reward", colocate_critic_reward)) if on)
    return PlacementPlan(device=device, bundles=bundles, groups=groups, engines=tuple(engines), colocation=flags)


def _arithmetic(plan: PlacementPlan) -> str:
    """``4 engines x TP 2 = 8 GPUs plus actor 8 + ref 8 + ... without colocation = 40``."""
    unit = "GPU" if plan.device == "cuda" else "CPU"
    tp = plan.engine_tp
    n_eng = len(plan.engines)
    terms, engine_term = [], ""
    for key, n in plan.bundles.items():
        names = [g.name for g in plan.groups.values() if g.pg == key]
        if key.startswith("engine") and not names:
            continue
        shared = [e for e in plan.engines if e.pg == key]
        if shared:
            names.append(f"{len(shared)} engines x TP {tp}")
        terms.append(f"{' + '.join(names)} {n}" if len(names) == 1 else f"({' + '.join(names)} sharing {n})")
    separate = [e for e in plan.engines if e.pg.startswith("engine")]
    if separate:
        engine_term = f"{n_eng} engine{'s' if n_eng > 1 else ''} x TP {tp} = {n_eng * tp} {unit}s"
    how = ("without colocation" if not plan.colocation
           else "with " + " ".join(f"--train.{f}" for f in plan.colocation))
    models = " + ".join(terms)
    body = f"{engine_term} plus {models}" if engine_term and models else (engine_term or models)
    return f"{body} {how} = {plan.total_bundles}"


def _fitting_flags(plan: PlacementPlan, have: float) -> list[str] | None:
    """The fewest colocation flags (beyond the plan's own) with which the same sizes would fit."""
    sizes = {g.name: g.num_workers for g in plan.groups.values()}
    current = set(plan.colocation)
    for extra in (["colocate_actor_ref"], ["colocate_critic_reward"], ["colocate_actor_ref", "colocate_critic_reward"],
                  ["colocate_all"]):
        flags = current | set(extra)
        if flags == current:
            continue
        try:
            p = plan_placement(sizes, device=plan.device, num_engines=len(plan.engines), engine_tp=plan.engine_tp or 1,
                               **{f: True for f in flags})
        except ConfigError:
            continue
        if p.total_bundles <= have + 1e-9 and p.total_bundles < plan.total_bundles:
            return sorted(set(extra) - current)
    return None


def check_resources(plan: PlacementPlan, available: dict[str, float]) -> None:
    """Fail before creating anything when the cluster cannot hold the plan (Ray would wait forever)."""
    kind = "GPU" if plan.device == "cuda" else "CPU"
    need = plan.total_bundles
    have = float(available.get(kind, 0.0))
    if need > have + 1e-9:
        flags = _fitting_flags(plan, have)
        if flags:
            hint = "add " + " ".join(f"--train.{f}" for f in flags)
        else:
            hint = ("use fewer workers (--actor.num_gpus_per_node ...)"
                    + (", fewer engines (--vllm.num_engines)" if plan.engines else "") + " or a bigger cluster")
        raise ConfigError(f"the Ray workers need {need} {kind} bundle(s): {_arithmetic(plan)}; "
                          f"the Ray cluster has {have:g} free {kind}(s): {hint}")
    if kind == "GPU":  # each GPU bundle also asks for one CPU
        cpus = float(available.get("CPU", 0.0))
        if need > cpus + 1e-9:
            raise ConfigError(f"the Ray workers need {need} GPU bundle(s) of {plan.bundle()} ({plan.describe()}) "
                              f"but the Ray cluster has {cpus:g} free CPU(s) for them; add CPUs to the cluster")


def plan_sizes(cfg) -> dict[str, int]:
    """Ranks of each model a Ray run places (``num_nodes x num_gpus_per_node``): the actor, the reference
    (``cfg.uses_ref``), the critic (``cfg.uses_critic``), the reward model(s) (``uses_reward_model``)."""
    from rlhforge.config.rl_rules import uses_reward_model

    sizes = {"actor": cfg.actor.num_nodes * cfg.actor.num_gpus_per_node}
    if cfg.uses_ref:
        sizes["ref"] = cfg.ref.num_nodes * cfg.ref.num_gpus_per_node
    if cfg.uses_critic:
        sizes["critic"] = cfg.critic.num_nodes * cfg.critic.num_gpus_per_node
    if uses_reward_model(cfg):
        sizes["reward"] = cfg.reward.num_nodes * cfg.reward.num_gpus_per_node
    if cfg.uses_teacher:  # on-policy distillation's teacher (--teacher.*)
        sizes["teacher"] = cfg.teacher.num_nodes * cfg.teacher.num_gpus_per_node
    return sizes


def plan_from_config(cfg, device: str) -> PlacementPlan:
    """The plan of an RL config (models, reward model, engines, colocation flags): what a run builds
    and what ``--train.plan_only`` prints."""
    v = cfg.vllm
    return plan_placement(plan_sizes(cfg), device=device, colocate_all=cfg.train.colocate_all,
                          colocate_actor_ref=cfg.train.colocate_actor_ref,
                          colocate_critic_reward=cfg.train.colocate_critic_reward,
                          num_engines=v.num_engines or 0, engine_tp=v.tensor_parallel_size)
