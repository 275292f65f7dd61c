"""``--train.plan_only``: the placement plan of an RL run and its memory per device, without weights.

The arithmetic is pure (:func:`train_memory`, :func:`frozen_memory`, :func:`engine_weight_bytes`,
:func:`memory_rows`, :func:`format_plan`); parameter counts come from a model folder's
``config.json`` through a model built on the meta device (:func:`count_parameters`), so nothing is
loaded. :func:`plan_only` is the command: validate, reach Ray, plan, check, create and remove the
placement groups, print. docs/distributed.md ("Placement plan") states the rules.

Memory per device, in GiB (2**30 bytes), ``p`` = bytes per parameter (bf16/fp16 2, fp32 4), ``N`` =
the model's ranks, ``T`` = trainable parameters (all of them, or LoRA's adapters):

- trained models (actor, critic): parameters ``P*p`` (``/N`` under ZeRO-3), gradients ``T*p`` (``/N``
  under ZeRO-2/3), Adam states ``T*12`` under mixed precision (fp32 master + 2 moments; ``T*8`` in
  fp32), ``/N`` under ZeRO-1/2/3, in host memory with ``--ds.adam_offload``;
- frozen models (ref, reward, teacher): parameters only, sharded like the actor under ZeRO-3;
- a vLLM engine: its weights ``P*p/TP`` per device, inside the ``--vllm.gpu_memory_utilization``
  fraction of the device it reserves (weights + KV cache).

Activations and fragmentation are not counted.

**Engines that share GPUs with models** (``--train.colocate_all`` on GPUs, or vLLM in the driver beside
the actor on ``cuda:0``): vLLM reserves ``--vllm.gpu_memory_utilization x device`` at start-up (weights,
activation peak, KV cache) and a wake from sleep re-maps exactly that allocation; nothing re-sizes it.
The models' parameters never leave the device (with ``--ds.enable_sleep`` their optimizer states and
gradients do). So start-up requires (:func:`engine_memory_check`)::

    util x device  <=  device - resident models - CUDA contexts

with ``resident`` the colocated models' bytes on the busiest device (parameters only under
``--ds.enable_sleep``, else parameters + gradients + optimizer) and one CUDA context
(:data:`CUDA_CONTEXT_GIB`) per model process on that device; ``--train.plan_only`` prints the same
arithmetic. (gpu-review-2 F1: at the default 0.95 any real model failed to wake the KV cache.)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from rlhforge.rewards.sources import reward_model_paths

__all__ = ["DTYPE_BYTES", "GIB", "CUDA_CONTEXT_GIB", "MemoryEstimate", "engine_memory_check", "check_engine_memory",
           "check_colocated_engines", "check_driver_engines", "gpu_memory", "shared_engine_group", "train_memory", "frozen_memory", "engine_weight_bytes",
           "count_parameters", "effective_zero_stage", "memory_rows", "format_plan", "plan_only"]

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
GIB = float(2 ** 30)
CUDA_CONTEXT_GIB = 0.5
"""Device memory one process's CUDA context takes outside the caching allocator (CUDA 12/13 with
torch's kernels loaded lazily: 0.3-0.6 GiB on H100-class GPUs); counted per model process that shares a
GPU with an engine."""
DEFAULT_GPU_GIB = 80.0
"""A GPU's memory when none is visible to measure (a CPU cluster declaring GPUs, planning a GPU run) and
``--train.gpu_memory_gib`` is not given: the 80 GB class (H100, A100-80GB); said in the check's text."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device (``host_optimizer``: bytes per rank in host memory)."""

    params: float
    grads: float = 0.0
    optimizer: float = 0.0
    host_optimizer: float = 0.0

    @property
    def device(self) -> float:
        return self.params + self.grads + self.optimizer


def train_memory(num_params: int, trainable: int, *, world: int, zero_stage: int, dtype_bytes: int,
                 adam_offload: bool = False) -> MemoryEstimate:
    """A trained model's bytes per device under ZeRO ``zero_stage`` over ``world`` ranks."""
    params = num_params * dtype_bytes / (world if zero_stage >= 3 else 1)
    grads = trainable * dtype_bytes / (world if zero_stage >= 2 else 1)
    optim = trainable * (12 if dtype_bytes < 4 else 8) / (world if zero_stage >= 1 else 1)
    if adam_offload:
        return MemoryEstimate(params, grads, 0.0, optim)
    return MemoryEstimate(params, grads, optim)


def frozen_memory(num_params: int, *, world: int, zero_stage: int, dtype_bytes: int) -> MemoryEstimate:
    """A frozen model (ref, reward): parameters only, sharded over ``world`` ranks under ZeRO-3."""
    return MemoryEstimate(num_params * dtype_bytes / (world if zero_stage >= 3 else 1))


def engine_weight_bytes(num_params: int, *, tp: int, dtype_bytes: int) -> float:
    """One vLLM engine's weights on each of its ``tp`` devices."""
    return num_params * dtype_bytes / tp


def _lora_targets(name: str, module, targets: tuple[str, ...], heads: tuple[str, ...]) -> bool:
    import torch

    if not isinstance(module, torch.nn.Linear) or name.split(".")[-1] in heads:
        return False
    if tuple(targets) == ("all-linear",):
        return True
    return any(name == t or name.endswith("." + t) for t in targets)


def count_parameters(path: str | None, *, value_model: bool = False, lora_rank: int = 0,
                     lora_targets: tuple[str, ...] = ("all-linear",),
                     trust_remote_code: bool = False) -> tuple[int, int] | None:
    """``(parameters, trainable)`` of the model in ``path`` from its config.json alone (the model is built
    on the meta device: no weights are read or allocated). ``value_model``: a sequence classifier with
    one label (reward model, critic). ``trainable`` is every parameter, or with ``lora_rank > 0`` the
    adapters ``r x (in + out)`` of each targeted linear layer (plus a value model's head, trained in
    full). None when the config cannot be read or the model cannot be built."""
    if not path:
        return None
    try:
        import torch
        import transformers

        config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        auto = transformers.AutoModelForSequenceClassification if value_model else transformers.AutoModelForCausalLM
        if value_model:
            config.num_labels = 1
        with torch.device("meta"):
            model = auto.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - no folder, no config, an unknown architecture: "n/a"
        return None
    total = sum(p.numel() for p in model.parameters())
    if lora_rank <= 0:
        return total, total
    heads = ("lm_head", "score", "classifier")
    adapters = sum(lora_rank * (m.in_features + m.out_features) for n, m in model.named_modules()
                   if _lora_targets(n, m, lora_targets, heads))
    head = sum(p.numel() for n, p in model.named_parameters() if value_model and n.split(".")[0] in heads)
    return total, adapters + head


def effective_zero_stage(strategy: str, zero_stage: int) -> int:
    """The partitioning a resolved strategy gives: DeepSpeed its stage, FSDP2 full sharding (3), torch none."""
    return {"deepspeed": zero_stage, "fsdp2": 3}.get(strategy, 0)


def model_paths(cfg) -> dict[str, list[str]]:
    """Model -> its folder(s): every reward rank holds all the comma-separated reward models."""
    actor = cfg.actor.model_name_or_path
    rewards = reward_model_paths(cfg.reward.model_name_or_path)
    return {"actor": [actor], "ref": [actor], "reward": rewards,
            "critic": [cfg.critic.model_name_or_path or (rewards[0] if rewards else actor)],
            "teacher": [cfg.teacher.model_name_or_path or actor]}  # on-policy distillation: a frozen model


def dtype_name(param_dtype: str, device: str) -> str:
    return param_dtype if param_dtype != "auto" else ("bf16" if device == "cuda" else "fp32")


@dataclass(frozen=True)
class Row:
    """One line of the plan: a model or an engine, where it sits and its memory per device."""

    name: str
    pg: str
    bundles: tuple[int, ...]
    share: float
    num_params: int | None
    memory: MemoryEstimate | None
    engine_tp: int = 0


def memory_rows(plan, counts: dict[str, tuple[int, int] | None], *, dtype_bytes: int, zero_stage: int,
                adam_offload: bool) -> list[Row]:
    """``plan``: a :class:`~rlhforge.distributed.placement.PlacementPlan`; ``counts``: model name ->
    ``(parameters, trainable)`` or None (engines use the actor's)."""
    rows = []
    for name, g in plan.groups.items():
        c = counts.get(name)
        mem = None
        if c is not None:
            if name in ("actor", "critic"):
                mem = train_memory(c[0], c[1], world=g.num_workers, zero_stage=zero_stage, dtype_bytes=dtype_bytes,
                                   adam_offload=adam_offload)
            else:
                mem = frozen_memory(c[0], world=g.num_workers, zero_stage=zero_stage, dtype_bytes=dtype_bytes)
        rows.append(Row(name, g.pg, tuple(range(g.num_workers)), g.share, c[0] if c else None, mem))
    actor = counts.get("actor")
    for e in plan.engines:
        tp = len(e.bundle_indices)
        mem = MemoryEstimate(engine_weight_bytes(actor[0], tp=tp, dtype_bytes=dtype_bytes)) if actor else None
        rows.append(Row(f"engine {e.index}", e.pg, e.bundle_indices, e.share, actor[0] if actor else None, mem, tp))
    return rows


def _span(ix: tuple[int, ...]) -> str:
    return f"{ix[0]}-{ix[-1]}" if len(ix) > 1 else str(ix[0])


def _gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def _memory_text(row: Row, gpu_util: float | None) -> str:
    m = row.memory
    if m is None:
        return "n/a (config.json not readable)"
    if row.engine_tp:
        inside = f" inside vLLM's {gpu_util:g} x device memory" if gpu_util is not None else ""
        return f"weights {_gib(m.params)} GiB{inside}"
    parts = [f"params {_gib(m.params)}"]
    if m.grads or m.optimizer or m.host_optimizer:
        parts += [f"grads {_gib(m.grads)}", f"optimizer {_gib(m.optimizer)}"]
    text = " + ".join(parts) + f" = {_gib(m.device)} GiB"
    if m.host_optimizer:
        text += f" (+ optimizer {_gib(m.host_optimizer)} GiB per rank in host memory: --ds.adam_offload)"
    return text


def group_totals(plan, rows: list[Row]) -> dict[str, float | None]:
    """Placement group -> the models' bytes on its busiest device (colocated members summed; None: n/a)."""
    out: dict[str, float | None] = {}
    for key in plan.bundles:
        members = [r for r in rows if r.pg == key and not r.engine_tp]
        out[key] = None if any(r.memory is None for r in members) else sum(r.memory.device for r in members)
    return out


@dataclass(frozen=True)
class EngineMemory:
    """The colocation arithmetic of one shared device (bytes); ``fits``: the engine can wake beside the models."""

    device: float
    util: float
    models: tuple[tuple[str, float], ...]
    contexts: int
    model_sleep: bool
    measured: str
    engines: int = 1
    """Engines per device (1 on Ray bundles; ``--vllm.num_engines`` when the driver's engines share one GPU)."""

    @property
    def resident(self) -> float:
        return sum(b for _, b in self.models) + self.contexts * CUDA_CONTEXT_GIB * GIB

    @property
    def engine(self) -> float:
        return self.util * self.device * self.engines

    @property
    def fits(self) -> bool:
        return self.engine <= self.device - self.resident + 1.0

    @property
    def max_util(self) -> float:
        """The largest utilization (two decimals, rounded down) that fits."""
        import math

        return max(0.0, math.floor((self.device - self.resident) / self.device / self.engines * 100) / 100)

    def text(self) -> str:
        kept = "parameters (--ds.enable_sleep offloads the rest)" if self.model_sleep else \
            "parameters + gradients + optimizer (no --ds.enable_sleep)"
        models = " + ".join(f"{n} {_gib(b)}" for n, b in self.models)
        free = self.device - self.resident
        verdict = "fits" if self.fits else "does not fit"
        many = f" x {self.engines} engines" if self.engines > 1 else ""
        return (f"--vllm.gpu_memory_utilization {self.util:g} x {_gib(self.device)} GiB ({self.measured}){many} = "
                f"{_gib(self.engine)} GiB for the engines; the models beside it keep {_gib(self.resident)} GiB on the "
                f"busiest GPU ({models} GiB of {kept} + {self.contexts} CUDA context(s) x {CUDA_CONTEXT_GIB:g} GiB): "
                f"{_gib(self.device)} - {_gib(self.resident)} = {_gib(free)} GiB left for the engine: {verdict}")


def shared_engine_group(plan) -> str | None:
    """The placement group in which GPU engines share their devices with models, or None."""
    if plan.device != "cuda":
        return None
    models = {g.pg for g in plan.groups.values()}
    return next((e.pg for e in plan.engines if e.pg in models), None)


def engine_memory_check(plan, rows: list[Row], *, device_bytes: float, util: float, model_sleep: bool,
                        measured: str = "measured", engines: int = 1) -> EngineMemory | None:
    """The arithmetic for engines that share their GPUs with models (None: no engine shares a GPU, or a
    model's size is unknown). ``rows`` from :func:`memory_rows`; rank ``i`` of every colocated model sits on
    bundle ``i``, so bundle 0 holds one rank of each: the busiest device."""
    key = shared_engine_group(plan)
    if key is None:
        return None
    members = [r for r in rows if r.pg == key and not r.engine_tp]
    if any(r.memory is None for r in members):
        return None
    models = tuple((r.name, r.memory.params if model_sleep else r.memory.device) for r in members)
    return EngineMemory(float(device_bytes), float(util), models, len(members), model_sleep, measured, engines)


def check_engine_memory(check: EngineMemory | None) -> None:
    """Refuse at start-up (ConfigError, exit 2) an engine utilization that cannot wake beside the models."""
    if check is None or check.fits:
        return
    from rlhforge.config.parsing import ConfigError

    fix = (f"use --vllm.gpu_memory_utilization {check.max_util:g} or less" if check.max_util >= 0.05 else
           "the models alone fill the GPU: use more GPUs (ZeRO-3 shards them), --ds.enable_sleep, or no colocation")
    raise ConfigError(f"colocated vLLM engines cannot wake their KV cache beside the models: {check.text()}. A waking "
                      f"engine re-maps the allocation it made at start-up (vLLM does not re-size it), so the first "
                      f"generation would die with CUDA out-of-memory; {fix}")


def format_plan(plan, rows: list[Row], *, dtype: str, zero_stage: int, strategy: str, adam_offload: bool,
                gpu_util: float | None = None, engine_sleep: bool = False, available: dict | None = None) -> str:
    """The printout of ``--train.plan_only`` (docs/distributed.md shows one)."""
    unit = "GPU" if plan.device == "cuda" else "CPU"
    p = DTYPE_BYTES[dtype]
    have = "" if available is None else (f"; the Ray cluster has {available.get('GPU', 0):g} GPU(s), "
                                         f"{available.get('CPU', 0):g} CPU(s) free")
    lines = [f"[rlhforge] placement plan: {plan.total_bundles} {unit} bundle(s) in {len(plan.bundles)} placement "
             f"group(s){have}",
             f"  memory per device: {dtype} parameters ({p} bytes), {strategy} with ZeRO-{zero_stage} partitioning "
             f"over each model's ranks, Adam {12 if p < 4 else 8} bytes per trained parameter"
             f"{' in host memory (--ds.adam_offload)' if adam_offload else ''}; activations not counted",
             f"  {'member':<10} {'group':<8} {'bundles':<8} {unit + ' each':<9} {'params':>8}  memory per device (GiB)"]
    for r in rows:
        params = "n/a" if r.num_params is None else f"{r.num_params / 1e9:.2f}B"
        where = f"TP {r.engine_tp}" if r.engine_tp else f"x{len(r.bundles)}"
        lines.append(f"  {r.name:<10} {r.pg:<8} {_span(r.bundles) + ' ' + where:<8} {r.share:<9.3g} {params:>8}  "
                     f"{_memory_text(r, gpu_util)}")
    totals = group_totals(plan, rows)
    for key, n in plan.bundles.items():
        engines = [r for r in rows if r.pg == key and r.engine_tp]
        members = [r.name for r in rows if r.pg == key and not r.engine_tp]
        total = totals[key]
        shown = "n/a" if total is None else _gib(total)
        text = [f"{shown} GiB of models ({' + '.join(members)})"] if members else []
        if engines:
            text.append(f"vLLM's {gpu_util:g} x device memory ({len(engines)} engine(s) x TP {engines[0].engine_tp})")
        lines.append(f"  total per device, group {key} ({n} bundle(s)): {' + '.join(text)}")
    if engine_sleep and any(r.engine_tp for r in rows):
        lines.append("  --vllm.enable_sleep: the engines release their memory while the models train")
    return "\n".join(lines)


def plan_only(cfg, log=print) -> int:
    """``--train.plan_only``: plan the run on the Ray cluster it reaches, prove Ray can place it, print it."""
    import ray

    from rlhforge.config.rl_rules import rl_strategy
    from rlhforge.distributed.launch import init_ray, ray_device, wait_for_resources
    from rlhforge.distributed.placement import plan_from_config
    from rlhforge.distributed.ray_group import create_placement_groups
    from ray.util.placement_group import remove_placement_group

    init_ray()
    device = ray_device(cfg.train.device)
    plan = plan_from_config(cfg, device)
    # at once when the whole cluster is too small; else up to 30 s for what a run or probe a moment ago in this
    # process still holds (Ray frees removed groups and finished tasks asynchronously)
    wait_for_resources(plan)
    available = ray.available_resources()
    text, memory = report(cfg, plan, available=available, strategy=rl_strategy(cfg))
    if memory is not None and not memory.fits:
        log(text)
        check_engine_memory(memory)  # exit 2 with the arithmetic (gpu-review-2 F1)
    pgs = create_placement_groups(plan)
    try:
        log(text)
        log(f"[rlhforge] plan_only: Ray placed {len(pgs)} placement group(s) ({plan.describe()}); removed them; "
            f"no weights loaded")
    finally:
        for pg in pgs.values():
            remove_placement_group(pg)
        _wait_released(ray, "GPU" if device == "cuda" else "CPU", available)
    sys.stdout.flush()
    return 0


def _wait_released(ray, kind: str, before: dict, timeout_s: float = 10.0) -> None:
    """Ray frees a removed group's resources asynchronously; return once they are back (bounded)."""
    import time

    deadline = time.monotonic() + timeout_s
    while ray.available_resources().get(kind, 0.0) + 1e-9 < before.get(kind, 0.0) and time.monotonic() < deadline:
        time.sleep(0.05)


def gpu_memory(cfg, log=None) -> tuple[float, str]:
    """Bytes of one GPU and where the number came from: ``--train.gpu_memory_gib``; the driver's GPU; a
    one-off Ray task on a cluster GPU (30 s at most); else :data:`DEFAULT_GPU_GIB`, assumed."""
    if cfg.train.gpu_memory_gib:
        return cfg.train.gpu_memory_gib * GIB, "--train.gpu_memory_gib"
    import torch

    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory), "measured"
    try:
        import ray

        if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0:
            probe = ray.remote(num_gpus=0.01, num_cpus=0)(_device_memory)
            found = ray.get(probe.remote(), timeout=30)
            if found:
                return float(found), "measured on a cluster GPU"
    except Exception as err:  # noqa: BLE001 - a busy or CPU-only cluster: fall back to the assumption
        if log is not None:
            log(f"[rlhforge] could not measure a cluster GPU's memory ({type(err).__name__}); assuming "
                f"{DEFAULT_GPU_GIB:g} GiB")
    return DEFAULT_GPU_GIB * GIB, f"assumed: no GPU visible to measure; set --train.gpu_memory_gib"


def _device_memory() -> int | None:
    import torch

    return int(torch.cuda.get_device_properties(0).total_memory) if torch.cuda.is_available() else None


def report(cfg, plan, *, available=None, strategy: str = "deepspeed", device_memory: tuple[float, str] | None = None,
           engines_per_device: int = 1) -> tuple[str, EngineMemory | None]:
    """The plan of ``cfg`` as :func:`format_plan` prints it (parameter counts from the config.json files),
    and the arithmetic of engines sharing GPUs with models (None where none do; ``device_memory``:
    :func:`gpu_memory`'s answer, asked for when needed)."""
    dtype = dtype_name(cfg.ds.param_dtype, plan.device)
    stage = effective_zero_stage(strategy, cfg.ds.zero_stage)
    lora = cfg.ds.lora
    paths = model_paths(cfg)
    cache: dict[tuple, tuple[int, int] | None] = {}
    counts = {}
    for name in plan.groups:
        value = name in ("critic", "reward")
        rank = lora.rank if name in ("actor", "critic") else 0
        found = []
        for path in paths[name]:
            key = (path, value, rank)
            if key not in cache:
                cache[key] = count_parameters(path, value_model=value, lora_rank=rank,
                                              lora_targets=tuple(lora.target_modules),
                                              trust_remote_code=cfg.actor.trust_remote_code)
            found.append(cache[key])
        counts[name] = None if not found or None in found else (sum(c[0] for c in found), sum(c[1] for c in found))
    offload = cfg.ds.adam_offload and stage >= 1  # DeepSpeed's offload_optimizer (ZeRO-1 and up)
    rows = memory_rows(plan, counts, dtype_bytes=DTYPE_BYTES[dtype], zero_stage=stage, adam_offload=offload)
    text = format_plan(plan, rows, dtype=dtype, zero_stage=stage, strategy=strategy, adam_offload=offload,
                       gpu_util=cfg.vllm.gpu_memory_utilization if plan.engines else None,
                       engine_sleep=cfg.vllm.enable_sleep, available=available)
    check = None
    if shared_engine_group(plan) is not None:
        size, where = device_memory or gpu_memory(cfg)
        check = engine_memory_check(plan, rows, device_bytes=size, util=cfg.vllm.gpu_memory_utilization,
                                    model_sleep=cfg.ds.enable_sleep, measured=where, engines=engines_per_device)
        text += "\n  engines sharing GPUs: " + (check.text() if check is not None else
                                                 "not checked (a model's config.json is not readable)")
    return text, check


def check_colocated_engines(cfg, plan, strategy: str, log=print) -> None:
    """Start-up (Ray): engines on the models' GPUs must fit beside them, or exit 2 with the arithmetic."""
    if shared_engine_group(plan) is not None:
        _check_and_say(cfg, plan, strategy, log)


def check_driver_engines(cfg, strategy: str, log=print) -> None:
    """Start-up (no Ray): the driver's vLLM engines and every model share one GPU; same rule, same exit 2."""
    from rlhforge.distributed.placement import plan_placement, plan_sizes

    plan = plan_placement({name: 1 for name in plan_sizes(cfg)}, device="cuda", colocate_all=True, num_engines=1)
    _check_and_say(cfg, plan, strategy, log, engines_per_device=cfg.vllm.num_engines or 1)


def _check_and_say(cfg, plan, strategy: str, log, engines_per_device: int = 1) -> None:
    _, memory = report(cfg, plan, strategy=strategy, device_memory=gpu_memory(cfg, log),
                       engines_per_device=engines_per_device)
    check_engine_memory(memory)
    if memory is not None:
        log("[rlhforge] engines sharing GPUs: " + memory.text())
