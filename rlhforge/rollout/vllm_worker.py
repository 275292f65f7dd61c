"""Weight-sync methods mixed into vLLM's worker (``LLM(worker_extension_cls=...)``).

vLLM imports this class by its qualified name inside each worker (in the engine-core process in
multiprocess mode, in this process otherwise) and adds its methods to the worker, so
``llm.collective_rpc("rlhforge_stage_bucket", args=(blob,))`` calls them by name: nothing has to be
pickled as code (no ``VLLM_ALLOW_INSECURE_SERIALIZATION``).

Why vLLM's layerwise reload and not a bare ``model.load_weights``: vLLM's CPU backend repacks linear
weights into kernel layouts after loading (and GPU layers post-process too: quantised layers, and bf16
MoE experts on Blackwell, which FlashInfer reorders in place). ``load_weights`` alone writes the
checkpoint-format tensors into parameters that the kernels no longer read (0.32.0's CPU kernels leave
an empty parameter without a loader: it raises at the first linear layer, after loading the embedding). The layerwise reload (``initialize_layerwise_reload`` ... ``model.load_weights`` ...
``finalize_layerwise_reload``, what ``model_runner.reload_weights`` runs) puts each layer back in the
checkpoint layout on the meta device, buffers what arrives, and when a layer has all its tensors
(q/k/v and gate/up are fused) materialises, loads and post-processes it and copies the result into the
original storage (CUDA-graph and sleep-pool addresses survive); the finalize puts the old tensors back
in layers that received nothing. Every call runs under ``set_current_vllm_config(self.vllm_config)``
(layers may look the config up while they post-process; ``Worker.reload_weights`` sets it only on
vLLM 0.32, so the worker methods here set it themselves).

One reload spans one sync:
- in-process tensors, RPC buckets (several tensors of safetensors bytes per RPC,
  :meth:`rlhforge_stage_bucket`, then one :meth:`rlhforge_load_staged`) and the sync group's broadcast
  each go through one ``model_runner.reload_weights`` call over the whole stream;
- CUDA IPC loads bucket by bucket in separate RPCs: the first bucket of a sync initializes the reload,
  every bucket goes through ``model.load_weights`` (:meth:`_rlhforge_load_bucket`, device-independent:
  tested on the CPU build), and :meth:`rlhforge_ipc_done` finalizes it.

A sync that stops partway (the receive raises ``SyncTimeout``, a load fails, an IPC sync's sender dies
before its last bucket) must not leave layers on the meta device with wrapped loaders:
:func:`_abort_layerwise_reload` gives layers that received only part of their tensors their previous
tensors back and finalizes, so the engine holds whole layers (each one the old or the new weights, none
half-loaded) and the next sync starts clean. An IPC sync left open is ended that way when a name
arrives a second time (a new sync began) or another path syncs.

Nothing here imports vLLM at module import time.
"""

from __future__ import annotations

from typing import Iterable, Iterator

from rlhforge.tracking.quiet import install_filters

__all__ = ["WeightSyncExtension", "EXTENSION_CLS"]

EXTENSION_CLS = "rlhforge.rollout.vllm_worker.WeightSyncExtension"

install_filters()  # known-harmless vLLM messages of every sync (tracking/quiet.py), in the worker's own process


def _repack_cpu_experts(model) -> int:
    """Redo the CPU MoE kernel's weight prepacking after a reload (vLLM 0.32's CPU build).

    vLLM's unquantized MoE method runs the experts' ``process_weights_after_loading`` (the CPU
    grouped-GEMM prepack) only on the first load: on a reload it copies the checkpoint-layout
    tensors in and skips the prepack, so the CPU kernel reads raw weights (greedy tokens then
    differ from HF's; found by tests/models/test_families.py). Every sync here reloads every
    layer, so each CPU experts layer is prepacked once more. Returns how many were.
    """
    done = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__module__.endswith(".cpu_moe") and hasattr(module, "w13_weight"):
            experts.process_weights_after_loading(module)
            done += 1
    return done


def _abort_layerwise_reload(model, model_config) -> int:
    """End a layerwise reload that stopped partway (vLLM 0.32 ``model_loader/reload/layerwise.py``).

    A layer that received only some of its tensors is still on the meta device with its loads buffered;
    vLLM's finalize would materialise it from uninitialised memory plus the part that arrived and
    process that. Here its buffered loads are dropped first, so the finalize puts its previous (kernel)
    tensors back, as for a layer that received nothing; layers that got everything were already
    processed into their storage. Afterwards no layer is on the meta device and every loader is
    unwrapped. Run under ``set_current_vllm_config``. Returns how many layers kept their previous
    tensors that way."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    try:
        from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    except ImportError:  # not found: plain finalize (partial layers are then processed as they are)
        get_layerwise_info = None
    dropped = 0
    for layer in model.modules() if get_layerwise_info is not None else ():
        info = get_layerwise_info(layer)
        if info.can_load() and info.load_numel > 0 and info.kernel_tensors is not None:
            info.loaded_weights.clear()
            info.load_numel = 0
            dropped += 1
    finalize_layerwise_reload(model, model_config)
    return dropped


class WeightSyncExtension:
    """Methods on vLLM's worker (``self`` is the worker; ``self.model_runner`` exists)."""

    # -- the sync report (always on: rlhforge.backend.fingerprint) -------------------------------
    def _rlhforge_begin_sync(self):
        """Before a load: the model's parameter print and a fresh fingerprint of what will arrive."""
        from rlhforge.backend.fingerprint import Fingerprint, params_checksum

        self._rlhforge_params_before = params_checksum(self.model_runner.model)
        return Fingerprint()

    def _rlhforge_end_sync(self, fp) -> None:
        """After a load: what arrived, how many tensors, and whether the parameters changed."""
        from rlhforge.backend.fingerprint import SyncReport, params_checksum

        previous = getattr(self, "_rlhforge_fingerprint", None)
        self._rlhforge_fingerprint = fp.hexdigest()
        self._rlhforge_report = SyncReport(
            fingerprint=self._rlhforge_fingerprint, tensors=len(fp), previous=previous,
            params_changed=params_checksum(self.model_runner.model) != self._rlhforge_params_before)

    def rlhforge_sync_report(self) -> dict | None:
        """This worker's report of the last sync (None: never synced)."""
        rep = getattr(self, "_rlhforge_report", None)
        return dict(rep) if rep is not None else None

    def _rlhforge_config(self):
        """``set_current_vllm_config(self.vllm_config)``: layers may look the config up while they
        post-process, and ``get_current_vllm_config()`` asserts outside it."""
        from vllm.config import set_current_vllm_config

        return set_current_vllm_config(self.vllm_config)

    def _rlhforge_reload(self, named: Iterator) -> None:
        """``model_runner.reload_weights`` from the trainer's (name, tensor) pairs, under this worker's vLLM
        config, renamed to the checkpoint layout vLLM loads (transformers 5.x fuses MoE experts that
        checkpoints store per expert: :func:`rlhforge.models.moe.checkpoint_names`; dense models pass
        through). If the stream or the load raises partway, the reload is ended
        (:func:`_abort_layerwise_reload`) before the error goes on. An IPC sync left open is ended first."""
        from rlhforge.models.moe import checkpoint_names

        self._rlhforge_ipc_abort()
        skeleton = self._rlhforge_names_skeleton()
        with self._rlhforge_config():
            try:
                self.model_runner.reload_weights(weights_iterator=checkpoint_names(named, skeleton))
            except BaseException:
                _abort_layerwise_reload(self.model_runner.model, self.vllm_config.model_config)
                raise
        if skeleton is not None:
            _repack_cpu_experts(self.model_runner.model)

    def _rlhforge_names_skeleton(self):
        """Once per worker: the model class on the meta device for MoE models (whose live names differ
        from the checkpoint's), else None."""
        from rlhforge.models.moe import is_moe, meta_skeleton

        skeleton = getattr(self, "_rlhforge_skeleton", False)
        if skeleton is False:
            config = self.model_runner.model_config.hf_config
            skeleton = self._rlhforge_skeleton = meta_skeleton(config) if is_moe(config) else None
        return skeleton

    # -- in-process path: tensors are passed as they are ------------------------------------------
    def rlhforge_load_tensors(self, named: Iterable, fingerprint: bool = True) -> int:
        """Reload from (name, tensor) pairs (in-process engines: no copy, no serialisation). Every load
        records its sync report (``fingerprint`` is kept for callers of the old signature)."""
        fp = self._rlhforge_begin_sync()

        def it() -> Iterator:
            for name, tensor in named:
                yield name, fp.add(name, tensor)

        self._rlhforge_reload(it())
        self._rlhforge_end_sync(fp)
        return len(fp)

    # -- RPC path: buckets of safetensors bytes, then one reload ----------------------------------
    def rlhforge_stage_bucket(self, blob: bytes) -> int:
        """Keep one bucket (safetensors bytes of several tensors) until :meth:`rlhforge_load_staged`."""
        staged = getattr(self, "_rlhforge_staged", None)
        if staged is None:
            staged = self._rlhforge_staged = []
        staged.append(bytes(blob))
        return len(staged)

    def rlhforge_load_staged(self) -> int:
        """Reload from every staged bucket in one pass, then drop them."""
        from safetensors.torch import load

        staged = getattr(self, "_rlhforge_staged", None) or []
        self._rlhforge_staged = []
        fp = self._rlhforge_begin_sync()

        def it() -> Iterator:
            while staged:
                tensors = load(staged.pop(0))  # decode one bucket at a time
                for name, tensor in tensors.items():
                    yield name, fp.add(name, tensor)

        self._rlhforge_reload(it())
        self._rlhforge_end_sync(fp)
        return len(fp)

    def rlhforge_clear_staged(self) -> None:
        self._rlhforge_staged = []

    # -- collective path: a sync group with the actor's rank 0 (rlhforge.backend.collective) ------
    def rlhforge_join_sync_group(self, host: str, port: int, rank_base: int, world_size: int, backend: str,
                                 timeout_s: float) -> int:
        """Join the weight-sync group as member ``rank_base + this worker's rank in the engine``."""
        from rlhforge.backend.collective import SyncGroup

        rank = rank_base + int(getattr(self, "rank", 0) or 0)
        device = "cpu" if backend == "gloo" else str(getattr(self, "device", "cuda"))
        self._rlhforge_group = None  # the previous group, if any, goes first
        self._rlhforge_group = SyncGroup(host, port, rank, world_size, backend, device, timeout_s)
        return rank

    def rlhforge_receive_weights(self, fingerprint: bool = True) -> str:
        """Receive one broadcast from rank 0 bucket by bucket and reload from it in one pass; returns the
        fingerprint of what arrived (always: rlhforge.backend.fingerprint, cheap integer checksums)."""
        fp = self._rlhforge_begin_sync()

        def it() -> Iterator:
            for name, tensor in self._rlhforge_group.receive():
                yield name, fp.add(name, tensor)

        self._rlhforge_reload(it())
        self._rlhforge_end_sync(fp)
        return self._rlhforge_fingerprint

    def rlhforge_load_ipc(self, entries: list, handles_by_gpu: dict, fingerprint: bool = True) -> int:
        """CUDA IPC, one bucket (GPU; an engine sharing its GPUs with the actor's ranks): rebuild the bucket
        that the actor rank on this worker's GPU packed (:meth:`_rlhforge_ipc_buffer`; no copy through host
        memory), unpack it and load it into the sync's layerwise reload (:meth:`_rlhforge_load_bucket`);
        :meth:`rlhforge_ipc_done` ends the sync. ``entries`` and the handles arrive in their msgpack-safe
        form (:func:`~rlhforge.rollout.vllm_compat.load_ipc_payload`: vLLM's serializer takes nothing else
        when the engine core is its own process). Returns the number of tensors."""
        from rlhforge.backend.collective import unpack_bucket
        from rlhforge.rollout.vllm_compat import entries_from_wire

        if not entries:  # the closing call of a sync whose last bucket was already sent
            return 0
        buffer = self._rlhforge_ipc_buffer(handles_by_gpu)
        pairs = unpack_bucket(buffer, entries_from_wire(entries))  # copies: the sender may free its buffer after
        del buffer
        return self._rlhforge_load_bucket(pairs)

    def _rlhforge_ipc_buffer(self, handles_by_gpu: dict):
        """The bucket's flat uint8 buffer, rebuilt with ``rebuild_cuda_tensor`` from the handle made on this
        worker's GPU, found by the GPU's UUID (:func:`rlhforge.rollout.vllm_compat.handle_for_gpu`), with
        this worker's own device index. GPU only."""
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        from rlhforge.rollout.vllm_compat import gpu_uuid, handle_for_gpu, ipc_handle_from_wire

        device = torch.device(getattr(self, "device", None) or torch.device("cuda", torch.cuda.current_device()))
        rank = int(getattr(self, "rank", 0) or 0)
        wire = handle_for_gpu(handles_by_gpu, gpu_uuid(device), f"engine worker rank {rank} ({device})")
        index = device.index if device.index is not None else torch.cuda.current_device()
        return rebuild_cuda_tensor(*ipc_handle_from_wire(wire, index))

    def _rlhforge_load_bucket(self, pairs: list) -> int:
        """One bucket's unpacked (name, tensor) pairs into this IPC sync's layerwise reload, under the vLLM
        config: the first bucket of a sync records the sync report's starting point and runs
        ``initialize_layerwise_reload``; every bucket goes through ``model.load_weights`` (a layer is
        processed once all its tensors arrived, possibly over several buckets). A name that this sync
        already loaded means a new sync began without the last one's :meth:`rlhforge_ipc_done` (its sender
        failed): that one is ended first. On an error the sync is ended (:meth:`_rlhforge_ipc_abort`) and
        the error goes on. Device-independent (the CPU build runs it with CPU tensors). Returns
        ``len(pairs)``."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        from rlhforge.models.moe import checkpoint_names

        model = self.model_runner.model
        try:
            with self._rlhforge_config():
                names = getattr(self, "_rlhforge_ipc_names", None)
                if names is not None and any(name in names for name, _ in pairs):
                    self._rlhforge_ipc_abort()
                    names = None
                if names is None:  # the first bucket of this sync
                    self._rlhforge_ipc_fp = self._rlhforge_begin_sync()  # before the reload moves layers to meta
                    self._rlhforge_ipc_names = names = set()
                    initialize_layerwise_reload(model)
                for name, t in pairs:
                    self._rlhforge_ipc_fp.add(name, t)
                    names.add(name)
                model.load_weights(weights=checkpoint_names(pairs, self._rlhforge_names_skeleton()))
        except BaseException:
            self._rlhforge_ipc_abort()
            raise
        return len(pairs)

    def rlhforge_ipc_done(self) -> None:
        """End of an IPC sync: ``finalize_layerwise_reload`` (layers that received nothing get their tensors
        back, attention layers are processed), the CPU experts' repack and the runner's caches reset as
        ``model_runner.reload_weights`` does, then the sync report; the next bucket starts a new sync.
        No-op when no IPC sync is open."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        fp = getattr(self, "_rlhforge_ipc_fp", None)
        if getattr(self, "_rlhforge_ipc_names", None) is None or fp is None:
            return
        model = self.model_runner.model
        try:
            with self._rlhforge_config():
                finalize_layerwise_reload(model, self.vllm_config.model_config)
        except BaseException:
            self._rlhforge_ipc_abort()
            raise
        self._rlhforge_ipc_fp = self._rlhforge_ipc_names = None
        if self._rlhforge_names_skeleton() is not None:
            _repack_cpu_experts(model)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # where the runner has them
            fn = getattr(self.model_runner, reset, None)
            if fn is not None:
                fn()
        self._rlhforge_end_sync(fp)

    def _rlhforge_ipc_abort(self) -> bool:
        """End an IPC sync that did not reach :meth:`rlhforge_ipc_done` (:func:`_abort_layerwise_reload`; no
        sync report: the last complete sync's stays). False when none was open."""
        if getattr(self, "_rlhforge_ipc_names", None) is None:
            return False
        self._rlhforge_ipc_fp = self._rlhforge_ipc_names = None
        with self._rlhforge_config():
            _abort_layerwise_reload(self.model_runner.model, self.vllm_config.model_config)
        return True

    def rlhforge_fingerprint(self) -> str | None:
        """Fingerprint of the weights last loaded through a sync (None: still the folder's)."""
        return getattr(self, "_rlhforge_fingerprint", None)

    # -- checks -----------------------------------------------------------------------------------
    def rlhforge_api_signatures(self) -> dict[str, dict | None]:
        """Parameter names of the worker-side vLLM methods the sync calls by keyword, and whether each takes
        ``**kwargs`` (vLLM 0.26's V2 runner: ``reload_weights(self, *args, **kwargs)``), for the start-up check
        (:func:`rlhforge.rollout.vllm_compat.check_vllm_api`); None names a method that is missing."""
        import inspect

        out = {}
        for name, owner, attr in (("model_runner.reload_weights", self.model_runner, "reload_weights"),
                                  ("model.load_weights", self.model_runner.get_model(), "load_weights")):
            fn = getattr(owner, attr, None)
            params = None if fn is None else inspect.signature(fn).parameters.values()
            out[name] = None if params is None else {
                "params": [p.name for p in params],
                "var_keyword": any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)}
        return out

    def rlhforge_param_checksum(self) -> float:
        """Sum of all parameters (tests: did a reload change the weights the kernels read?)."""
        import torch

        total = 0.0
        with torch.no_grad():
            for p in self.model_runner.get_model().parameters():
                total += float(p.detach().float().sum())
        return total
