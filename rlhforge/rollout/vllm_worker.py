"""Weight-sync methods mixed into vLLM's worker (``LLM(worker_extension_cls=...)``).

vLLM imports this class by its qualified name inside each worker (in the engine-core process in
multiprocess mode, in this process otherwise) and adds its methods to the worker, so
``llm.collective_rpc("rlhforge_stage_bucket", args=(blob,))`` calls them by name: nothing has to be
pickled as code (no ``VLLM_ALLOW_INSECURE_SERIALIZATION``).

Why ``model_runner.reload_weights`` and not ``model.load_weights``: vLLM's CPU backend repacks
linear weights into kernel layouts after loading (and GPU quantised layers post-process too).
``load_weights`` writes the checkpoint-format tensors into parameters that the kernels no longer
read, so on CPU it has no visible effect; ``reload_weights`` restores the checkpoint layout,
loads, and re-runs that processing layer by layer.

``reload_weights`` processes a layer only once *all* of its checkpoint tensors arrived in the
same call (q/k/v and gate/up are fused), and puts the old tensors back for layers that received
nothing. So weights are loaded in one ``reload_weights`` call over everything; the transfer into
the worker is what is bucketed: several tensors per RPC (:meth:`rlhforge_stage_bucket`, safetensors
bytes), then one :meth:`rlhforge_load_staged`.

Nothing here imports vLLM at module import time.
"""

from __future__ import annotations

from typing import Iterable, Iterator

__all__ = ["WeightSyncExtension", "EXTENSION_CLS"]

EXTENSION_CLS = "rlhforge.rollout.vllm_worker.WeightSyncExtension"


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

    def _rlhforge_reload(self, named: Iterator) -> None:
        """``reload_weights`` from the trainer's (name, tensor) pairs, renamed to the checkpoint layout
        vLLM loads (transformers 5.x fuses MoE experts that checkpoints store per expert:
        :func:`rlhforge.models.moe.checkpoint_names`; dense models pass through)."""
        from rlhforge.models.moe import checkpoint_names

        skeleton = self._rlhforge_names_skeleton()
        self.model_runner.reload_weights(weights_iterator=checkpoint_names(named, skeleton))
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
        """CUDA IPC, one bucket (GPU; an engine sharing its GPUs with the actor's ranks): rebuild the
        bucket that the actor rank on this worker's GPU packed, found by the GPU's UUID
        (:func:`rlhforge.rollout.vllm_compat.handle_for_gpu`; no copy through host memory), and load its
        tensors with the model's ``load_weights`` (on GPU the kernels read the parameters as loaded; the
        CPU repacking that needs ``reload_weights`` does not apply). ``entries`` and the handles arrive in
        their msgpack-safe form (:func:`~rlhforge.rollout.vllm_compat.load_ipc_payload`: vLLM's serializer
        takes nothing else when the engine core is its own process) and the tensor is rebuilt here with
        this worker's own device index. Returns the number of tensors. GPU only: not run on CPU."""
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        from rlhforge.backend.collective import unpack_bucket
        from rlhforge.rollout.vllm_compat import entries_from_wire, gpu_uuid, handle_for_gpu, ipc_handle_from_wire

        if not entries:  # the closing call of a sync whose last bucket was already sent
            return 0
        if getattr(self, "_rlhforge_ipc_fp", None) is None:  # the first bucket of this sync
            self._rlhforge_ipc_fp = self._rlhforge_begin_sync()
        device = torch.device(getattr(self, "device", None) or torch.device("cuda", torch.cuda.current_device()))
        rank = int(getattr(self, "rank", 0) or 0)
        wire = handle_for_gpu(handles_by_gpu, gpu_uuid(device), f"engine worker rank {rank} ({device})")
        index = device.index if device.index is not None else torch.cuda.current_device()
        buffer = rebuild_cuda_tensor(*ipc_handle_from_wire(wire, index))
        pairs = unpack_bucket(buffer, entries_from_wire(entries))  # copies: the sender may free its buffer after
        from rlhforge.models.moe import checkpoint_names  # MoE: per-expert checkpoint names (not run: GPU only)

        for name, t in pairs:
            self._rlhforge_ipc_fp.add(name, t)
        self.model_runner.model.load_weights(weights=checkpoint_names(pairs, self._rlhforge_names_skeleton()))
        return len(pairs)

    def rlhforge_ipc_done(self) -> None:
        """End of an IPC sync: its report; the fingerprint of the next one starts afresh."""
        fp, self._rlhforge_ipc_fp = getattr(self, "_rlhforge_ipc_fp", None), None
        if fp is not None:
            self._rlhforge_end_sync(fp)

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
