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


class WeightSyncExtension:
    """Methods on vLLM's worker (``self`` is the worker; ``self.model_runner`` exists)."""

    # -- in-process path: tensors are passed as they are ------------------------------------------
    def rlhforge_load_tensors(self, named: Iterable) -> int:
        """Reload from (name, tensor) pairs (in-process engines: no copy, no serialisation)."""
        count = [0]

        def it() -> Iterator:
            for name, tensor in named:
                count[0] += 1
                yield name, tensor

        self.model_runner.reload_weights(weights_iterator=it())
        return count[0]

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
        count = [0]

        def it() -> Iterator:
            while staged:
                tensors = load(staged.pop(0))  # decode one bucket at a time
                for name, tensor in tensors.items():
                    count[0] += 1
                    yield name, tensor

        self.model_runner.reload_weights(weights_iterator=it())
        return count[0]

    def rlhforge_clear_staged(self) -> None:
        self._rlhforge_staged = []

    # -- checks -----------------------------------------------------------------------------------
    def rlhforge_param_checksum(self) -> float:
        """Sum of all parameters (tests: did a reload change the weights the kernels read?)."""
        import torch

        total = 0.0
        with torch.no_grad():
            for p in self.model_runner.get_model().parameters():
                total += float(p.detach().float().sum())
        return total
