"""The reward sources: a Python ``reward_func`` file, built-in verifiers, an HTTP reward server, a
reward model. :func:`build_reward_source` picks one from ``--reward.remote_url`` /
``--reward.model_name_or_path``.

``--reward.remote_url`` accepts (comma-separated lists are allowed for HTTP servers only):

- ``path/to/file.py``: the file defines ``reward_func(queries, prompts, labels, **kwargs)``
  (sync or ``async``) returning ``{"rewards": [...], "scores": [...], "extra_logs": {...}}``
  (OpenRLHF's contract; values may be lists or tensors, ``extra_logs`` values one number per
  sample or one for the batch) or just the rewards (a list or a tensor). Keyword arguments it
  accepts among ``responses``, ``datasources``, ``finish_reasons`` are passed too. An OpenRLHF
  reward file runs unchanged: ``from openrlhf.utils import extract_boxed_answer, grade_answer``
  resolves to rlhforge's math check while the file is imported (:mod:`rlhforge.openrlhf_alias`);
- ``builtin:NAME`` (``builtin:arithmetic``, ``builtin:reverse``): the task's exact-answer check
  (reward = score = 1.0 for a correct answer, else 0.0); ``builtin:auto`` picks the task from each
  record's datasource;
- ``http://host:port/path``: an HTTP reward server speaking OpenRLHF's JSON protocol
  (``{"query", "prompts", "labels"}`` -> ``{"rewards", "scores", "extra_logs"}``);
- ``endpoints:path/to/file``: a live list of such servers (one URL per line), re-read before
  every reward call, so servers can be moved or replaced without stopping training; a bad or
  empty file keeps the last good list and warns (:mod:`rlhforge.net.endpoints`).

``--reward.model_name_or_path a[,b,...]`` (without ``--reward.remote_url``): one or more reward
models scoring the token ids, their rewards summed (:class:`RewardModelSource`); in this process,
or, with Ray workers, in a Ray reward group (:mod:`rlhforge.workers.reward`).
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
from pathlib import Path
from typing import Any, Callable

from rlhforge.rewards.base import RewardBatch, RewardError, RewardOutput

__all__ = ["FunctionReward", "BuiltinReward", "RemoteReward", "RewardModels", "RewardModelSource",
           "build_reward_source", "load_reward_func", "reward_model_paths", "combine_rewards"]

_OPTIONAL_KWARGS = ("responses", "datasources", "finish_reasons")


def load_reward_func(path: str | Path) -> Callable:
    """``reward_func`` from a Python file; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--reward.remote_url {path}: file not found")
    from rlhforge.openrlhf_alias import alias_hint, openrlhf_alias

    spec = importlib.util.spec_from_file_location(f"rlhforge_reward_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        with openrlhf_alias():
            spec.loader.exec_module(module)
    except Exception as err:  # noqa: BLE001
        raise RewardError(f"importing {path} failed: {type(err).__name__}: {err}{alias_hint(err)}") from err
    fn = getattr(module, "reward_func", None)
    if not callable(fn):
        raise RewardError(f"{path} defines no function reward_func(queries, prompts, labels, **kwargs)")
    return fn


class FunctionReward:
    """A Python callable with OpenRLHF's signature (sync or async)."""

    def __init__(self, fn: Callable, name: str):
        self.fn, self.name = fn, name
        sig = inspect.signature(fn)
        takes_var_kw = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        self._extra = [k for k in _OPTIONAL_KWARGS if takes_var_kw or k in sig.parameters]

    @classmethod
    def from_file(cls, path: str) -> "FunctionReward":
        return cls(load_reward_func(path), f"reward_func in {path}")

    async def __call__(self, batch: RewardBatch) -> Any:
        kwargs = {k: getattr(batch, k) for k in self._extra}
        result = self.fn(batch.queries, batch.prompts, batch.labels, **kwargs)
        if inspect.isawaitable(result):
            result = await result
        return _plain_result(result, len(batch))


def _plain_values(values: Any, n: int) -> Any:
    """Tensors / arrays as lists; a single number (or 0-d tensor) for a batch of one as ``[x]``."""
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
        values = values.tolist()
    if n == 1 and isinstance(values, (int, float)) and not isinstance(values, bool):
        values = [values]
    return values


def _plain_result(result: Any, n: int) -> Any:
    """A ``reward_func`` result with tensors turned into lists (checked by ``check_reward_output``)."""
    if isinstance(result, dict):
        out = dict(result)
        for key in ("rewards", "scores"):
            if out.get(key) is not None:
                out[key] = _plain_values(out[key], n)
        if isinstance(out.get("extra_logs"), dict):
            out["extra_logs"] = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in out["extra_logs"].items()}
        return out
    if result is None or isinstance(result, RewardOutput):
        return result
    return _plain_values(result, n)


class BuiltinReward:
    """Exact-answer verifiers of :mod:`rlhforge.data.builtin` (``task=None``: route by datasource)."""

    def __init__(self, task: str | None):
        from rlhforge.data.builtin import verifiable_tasks

        if task is not None and task not in verifiable_tasks():
            raise RewardError(f"unknown built-in reward builtin:{task}; available: auto, {', '.join(verifiable_tasks())}")
        self.task = task
        self.name = f"built-in reward builtin:{task or 'auto'}"

    async def __call__(self, batch: RewardBatch) -> RewardOutput:
        from rlhforge.data.builtin import check_answer

        scores = []
        for i, (response, label) in enumerate(zip(batch.responses, batch.labels)):
            task = self.task or batch.datasources[i]
            if task is None:
                raise RewardError(f"{self.name}: sample {i} has no datasource to route by (set --data.datasource_key)")
            if label is None:
                raise RewardError(f"{self.name}: sample {i} has no label (set --data.label_key, e.g. answer)")
            scores.append(float(check_answer(task, response, str(label))))
        return RewardOutput(rewards=list(scores), scores=scores)


class RemoteReward:
    """HTTP reward servers (OpenRLHF's JSON protocol); several URLs share the batch round-robin.

    ``endpoints`` is a list of URLs or an endpoint source with ``current()`` (e.g. an
    :class:`~rlhforge.net.endpoints.EndpointsFile`, consulted before every call). Each request
    follows ``policy`` (:class:`~rlhforge.net.client.RetryPolicy`: per-attempt timeout, retries,
    backoff; one log line per failed attempt). A shard whose server fails moves to the next server
    not yet failed; servers that failed are skipped by later calls while others are live
    (:class:`~rlhforge.net.client.ServerHealth`). When every server fails a
    :class:`~rlhforge.rewards.client.RewardServerError` names each URL and its cause."""

    def __init__(self, endpoints, timeout: float = 180.0, name: str | None = None, api_key: str | None = None, *,
                 policy=None, log: Callable[[str], None] | None = None):
        from rlhforge.net.client import RetryPolicy, ServerHealth
        from rlhforge.rewards.client import auth_headers
        from rlhforge.net.endpoints import StaticEndpoints

        self.endpoints = endpoints if hasattr(endpoints, "current") else StaticEndpoints(endpoints)
        self.policy = policy or RetryPolicy(timeout=timeout)
        self._headers = auth_headers(api_key)  # api_key None: $RLHFORGE_REWARD_API_KEY; never logged
        self.health = ServerHealth()
        self._log = log
        self.name = name or f"reward server {','.join(self.endpoints.current())}"

    @classmethod
    def from_config(cls, reward_cfg, endpoints, name: str | None = None) -> "RemoteReward":
        """From ``--reward.*`` (:class:`~rlhforge.config.rl.RewardConfig`): timeout, retries, backoff, key."""
        from rlhforge.net.client import RetryPolicy

        policy = RetryPolicy(timeout=reward_cfg.timeout, retries=reward_cfg.retries,
                             backoff_s=reward_cfg.retry_backoff_s)
        return cls(endpoints, name=name, api_key=reward_cfg.api_key, policy=policy)

    @property
    def timeout(self) -> float:
        return self.policy.timeout

    async def __call__(self, batch: RewardBatch) -> dict:
        import httpx

        from rlhforge.net.client import FailoverCall, httpx_timeout

        order = self.health.order(self.endpoints.current())
        live = [u for u in order if not self.health.cooling(u)] or order
        chunks = [list(range(i, len(batch), len(live))) for i in range(len(live))]
        call = FailoverCall()
        async with httpx.AsyncClient(timeout=httpx_timeout(self.policy.timeout), headers=self._headers) as http:
            results = await asyncio.gather(*[self._post(http, order, url, batch, idx, call)
                                             for url, idx in zip(live, chunks) if idx])
        rewards = [0.0] * len(batch)
        scores = [0.0] * len(batch)
        extra: dict[str, list[float]] = {}
        for idx, res in zip([c for c in chunks if c], results):
            for j, i in enumerate(idx):
                rewards[i] = res["rewards"][j]
                scores[i] = (res.get("scores") or res["rewards"])[j]
            for key, values in (res.get("extra_logs") or {}).items():
                col = extra.setdefault(key, [0.0] * len(batch))
                for j, i in enumerate(idx):
                    col[i] = values[j] if isinstance(values, list) else values
        return {"rewards": rewards, "scores": scores, "extra_logs": extra}

    async def _post(self, http, order: list[str], url: str, batch: RewardBatch, idx: list[int],
                    call) -> dict:
        from rlhforge.rewards.client import check_rewards_answer, post_with_failover

        payload = {"query": [batch.queries[i] for i in idx], "prompts": [batch.prompts[i] for i in idx],
                   "labels": [batch.labels[i] for i in idx]}
        kwargs = {"log": self._log} if self._log is not None else {}
        _url, res = await post_with_failover(http, order, payload, self.policy, start=url, health=self.health,
                                             call=call, check=lambda data: check_rewards_answer(data, len(idx)),
                                             **kwargs)
        return res


def reward_model_paths(value: str | None) -> list[str]:
    """``--reward.model_name_or_path a,b`` -> ``["a", "b"]`` (OpenRLHF's comma-separated ``--reward_pretrain``)."""
    return [p.strip() for p in (value or "").split(",") if p.strip()]


class RewardModels:
    """The reward models of ``paths`` in this process (the driver, or one rank of the Ray reward
    group): each loaded as a one-label sequence classifier and prepared as a frozen model
    (:class:`~rlhforge.backend.frozen.FrozenModel`: the actor's precision mechanism ``kind``,
    ZeRO-3 sharded under ZeRO-3, ``offload`` between uses). ``normalize``: each model's reward is
    normalised with the mean/std stored in *its own* config."""

    def __init__(self, paths, model_cfg, ds_cfg, device, *, pad_token_id: int, normalize: bool,
                 micro_batch_size: int = 8, value_head_prefix: str = "score", kind: str = "torch",
                 offload: bool = False, max_tokens: int | None = None):
        import dataclasses

        from rlhforge.backend.frozen import FrozenModel
        from rlhforge.models.reward import load_reward_model, reward_stats

        self.paths = list(paths)
        self.prefix, self.pad, self.device = value_head_prefix, pad_token_id, device
        self.micro_batch_size = micro_batch_size
        self.max_tokens = max_tokens  # --train.dynamic_batch_enable: token-budget micro-batches (None: fixed)
        self.models, self.stats = [], []
        for path in self.paths:
            model = load_reward_model(path, dataclasses.replace(model_cfg, model_name_or_path=path), ds_cfg, device,
                                      pad_token_id=pad_token_id, value_head_prefix=value_head_prefix)
            stats = reward_stats(model.config) if normalize else None
            if normalize and stats is None:
                raise RewardError(f"--reward.normalize_enable: {path} has no reward_mean/reward_std in its config.json")
            self.models.append(FrozenModel(model, ds_cfg, device, kind=kind, offload=offload))
            self.stats.append(stats)

    def score(self, seqs: list[list[int]]) -> list[list[float]]:
        """``[sample][model]`` rewards of the token-id sequences ``seqs``."""
        import torch

        from rlhforge.backend.device import dist_info
        from rlhforge.backend.strategy import all_reduce_tensor
        from rlhforge.data.balancing import micro_batch_groups
        from rlhforge.data.packing import collate_padded
        from rlhforge.models.reward import sequence_rewards

        world = dist_info().world_size  # a Ray reward group's ranks agree on the number of passes (ZeRO-3 gathers)
        groups = micro_batch_groups([len(q) for q in seqs], self.micro_batch_size, self.max_tokens,
                                    lambda k: int(all_reduce_tensor(torch.tensor(float(k)), "max", world)))
        per_model = []
        for frozen, stats in zip(self.models, self.stats):
            out: list[float] = [0.0] * len(seqs)
            with frozen.use() as model:
                for idx in groups:
                    chunk = [{"input_ids": list(seqs[i]), "loss_mask": [0] * len(seqs[i])} for i in idx]
                    b = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in collate_padded(chunk, self.pad).items()}
                    for i, r in zip(idx, sequence_rewards(model, b, self.prefix).float().cpu().tolist()):
                        out[i] = r
            if stats is not None:
                mean, std = stats
                out = [(r - mean) / max(std, 1e-8) for r in out]
            per_model.append(out)
        return [list(row) for row in zip(*per_model)]

    def offload_stats(self) -> list[dict]:
        return [m.stats() for m in self.models]


def combine_rewards(per_model: list[float]) -> float:
    """Several reward models: the sum of their rewards, as OpenRLHF 0.6.x's default ``reward_fn``
    (``torch.stack(rewards).sum(dim=0)`` in ``openrlhf/cli/train_ppo_ray.py``; 0.7+ takes one model)."""
    return float(sum(per_model))


class RewardModelSource:
    """Reward models scoring the token ids directly (no re-tokenisation). ``scorer.score(seqs)``
    returns ``[sample][model]`` rewards: :class:`RewardModels` in this process, or a Ray reward
    group's scorer (``remote=True``: called off the event loop). Several models: rewards are summed
    (:func:`combine_rewards`) and each model's reward is logged as ``reward_model_<k>``."""

    def __init__(self, scorer, paths, *, remote: bool = False):
        self.scorer, self.paths, self.remote = scorer, list(paths), remote
        where = " (Ray reward group)" if remote else ""
        self.name = (f"reward model {self.paths[0]}{where}" if len(self.paths) == 1
                     else f"reward models {', '.join(self.paths)} (summed){where}")

    async def __call__(self, batch: RewardBatch) -> RewardOutput:
        seqs = [list(p) + list(r) for p, r in zip(batch.prompt_ids, batch.response_ids)]
        per = await asyncio.to_thread(self.scorer.score, seqs) if self.remote else self.scorer.score(seqs)
        rewards = [combine_rewards(row) for row in per]
        extra = {}
        if len(self.paths) > 1:
            extra = {f"reward_model_{k}": [row[k] for row in per] for k in range(len(self.paths))}
        return RewardOutput(rewards=rewards, scores=list(rewards), extra_logs=extra)


def build_reward_source(cfg, *, device=None, pad_token_id: int | None = None):
    """The reward source that ``cfg`` (an :class:`~rlhforge.config.rl.RLConfig`) asks for."""
    url = cfg.reward.remote_url
    if url:
        if url.startswith("builtin:"):
            task = url.split(":", 1)[1]
            return BuiltinReward(None if task in ("", "auto") else task)
        if url.endswith(".py"):
            return FunctionReward.from_file(url)
        if url.startswith(("http://", "https://")):
            return RemoteReward.from_config(cfg.reward, [u.strip() for u in url.split(",") if u.strip()])
        if url.startswith("endpoints:"):
            from rlhforge.net.endpoints import EndpointsFile

            path = url.split(":", 1)[1]
            return RemoteReward.from_config(cfg.reward, EndpointsFile(path), name=f"reward servers listed in {path}")
        raise RewardError(
            f"--reward.remote_url {url!r}: expected a .py file with reward_func, an http(s):// URL, "
            "endpoints:FILE or builtin:NAME"
        )
    paths = reward_model_paths(cfg.reward.model_name_or_path)
    models = RewardModels(paths, reward_model_config(cfg), reward_ds_config(cfg), device, pad_token_id=pad_token_id,
                          normalize=cfg.reward.normalize_enable, micro_batch_size=cfg.rollout.micro_batch_size,
                          value_head_prefix=cfg.ds.value_head_prefix, offload=cfg.reward.offload,
                          max_tokens=cfg.token_budgets()[1])
    return RewardModelSource(models, paths)


def reward_model_config(cfg):
    """The :class:`~rlhforge.config.components.ModelConfig` reward models load with."""
    from rlhforge.config.components import ModelConfig

    return ModelConfig(model_name_or_path=cfg.reward.model_name_or_path, trust_remote_code=cfg.actor.trust_remote_code)


def reward_ds_config(cfg):
    """``cfg.ds`` without LoRA / 4-bit: a reward model is not trained."""
    import dataclasses

    from rlhforge.config.components import LoraConfig

    return dataclasses.replace(cfg.ds, lora=LoraConfig(), load_in_4bit=False)
