"""Faulty weight-sync extensions for tests/rl/test_sync_probe.py: each loads the trainer's weights into vLLM's
worker so that the fingerprint check passes (what arrived is what was sent, the parameters changed) but the
kernels do not compute with them. Passed to an in-process vLLM engine by qualified name, as
``worker_extension_cls`` (the test patches ``rlhforge.rollout.vllm_engine.EXTENSION_CLS``)."""

from __future__ import annotations

from rlhforge.rollout.vllm_worker import WeightSyncExtension

SKIPPED_REPACK = "tests.rl.sync_probe_faults.SkippedRepackExtension"
PUT_BACK = "tests.rl.sync_probe_faults.PutBackExtension"


class SkippedRepackExtension(WeightSyncExtension):
    """(a) A sync that skips the post-load processing. vLLM's CPU build repacks every linear weight into its
    kernel's layout after loading (``dispatch_cpu_unquantized_gemm``, from each layer's
    ``process_weights_after_loading``) and the kernels read only that packed copy. Here the reload runs
    with the repack skipped: the checkpoint-format weights are loaded (the embedding and norms change, so
    the report says the parameters changed) and the kernels keep the copy packed at start-up.

    (The literal bare ``model.load_weights`` after start-up is not silent on vLLM 0.32's CPU build: the
    repack left the linear parameters empty, without their loaders, so it raises AttributeError.)"""

    def _rlhforge_reload(self, named) -> None:
        import torch
        import vllm.model_executor.layers.utils as layer_utils

        repack = layer_utils.dispatch_cpu_unquantized_gemm

        def skip_repack(layer, remove_weight: bool) -> None:  # what the repack leaves behind, minus the repack
            if remove_weight:
                layer.weight = torch.nn.Parameter(torch.empty(0, dtype=layer.weight.dtype), requires_grad=False)

        layer_utils.dispatch_cpu_unquantized_gemm = skip_repack
        try:
            super()._rlhforge_reload(named)
        finally:
            layer_utils.dispatch_cpu_unquantized_gemm = repack


class PutBackExtension(WeightSyncExtension):
    """(b) A sync whose weights are never applied: every sync loads properly and reports honestly, then the
    weights of the first sync (those the engine started with) are put back, as a wake that maps a stale
    copy would. (A load that leaves the parameters unchanged is caught by the fingerprint check already:
    tests/rl/test_vllm_sync_check.py.)"""

    def _rlhforge_reload(self, named) -> None:
        pairs = [(name, t.detach().clone()) for name, t in named]
        if getattr(self, "_first_weights", None) is None:
            self._first_weights = pairs
        super()._rlhforge_reload(iter(pairs))

    def _rlhforge_end_sync(self, fp) -> None:
        super()._rlhforge_end_sync(fp)
        super()._rlhforge_reload(iter(self._first_weights))
