"""A KV cache for the HF engine's decode loop that writes in place instead of concatenating.

``transformers.DynamicCache`` grows every layer's keys and values with ``torch.cat`` at each decoding
step, so step ``t`` copies the whole cache so far (O(length) per step, a quarter of a small model's
decode time on CPU). :class:`PreallocatedCache` is a ``DynamicCache`` whose layers keep their keys and
values in a buffer reserved once for the whole generation ([batch, kv_heads, capacity, head_dim]); a
step writes its new keys/values into the next free slots and the attention sees a view of the filled
part - the same values, in the same order, as DynamicCache's tensors, so the outputs are bit-identical.

Everything else is DynamicCache's: the sequence length, the mask sizes, ``batch_select_indices``
(re-implemented here to keep the buffer) and the lazy one-layer-per-``update`` creation. Why not
transformers' ``StaticCache``: its layers cannot ``batch_select_indices`` (the engine drops finished
rows), and the attention would run over the whole reserved length every step.
"""

from __future__ import annotations

import functools

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

__all__ = ["PreallocatedCache", "PreallocatedLayer"]


class PreallocatedLayer(DynamicLayer):
    """A full-attention cache layer over a reserved buffer; ``keys`` / ``values`` are views of its filled part.

    The buffer is (re)allocated on the first ``update``, when a write would pass its end (it then doubles:
    a caller that under-estimated the length still works), and when a base-class method replaced
    ``keys`` by a tensor of its own (``crop``, ``reorder_cache``, ``batch_repeat_interleave``, offloading):
    the cache then continues from that tensor.
    """

    def __init__(self, capacity: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.capacity = int(capacity)
        self.buffer_dtype = dtype
        """The buffers' dtype (None: the first keys' own); a write of another dtype is cast. (Not ``dtype``:
        ``DynamicLayer.lazy_initialization`` sets that to the first keys' dtype.)"""
        self._k_buf: torch.Tensor | None = None
        self._v_buf: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        if not self._owns_views() or end > self._k_buf.shape[-2]:
            self._reserve(key_states, value_states, start, end)
        self._k_buf[:, :, start:end].copy_(key_states)
        self._v_buf[:, :, start:end].copy_(value_states)
        self._set_views(end)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (the buffer goes with them)."""
        if self.get_seq_length() == 0 or not self._owns_views():
            return super().batch_select_indices(indices)
        end = self.get_seq_length()
        self._k_buf, self._v_buf = self._k_buf[indices], self._v_buf[indices]
        self._set_views(end)

    def _owns_views(self) -> bool:
        """Whether ``keys`` / ``values`` are still the views of the buffer this layer handed out."""
        return (self._k_buf is not None and self.keys is not None and self.keys.numel() > 0
                and self.keys.data_ptr() == self._k_buf.data_ptr() and self.values.data_ptr() == self._v_buf.data_ptr()
                and self.keys.shape[0] == self._k_buf.shape[0])

    def _reserve(self, key_states: torch.Tensor, value_states: torch.Tensor, start: int, end: int) -> None:
        """A new buffer holding ``end`` tokens or more, the first ``start`` copied from the current keys/values."""
        self.capacity = max(self.capacity, end) if self._k_buf is None else max(self.capacity, 2 * end)
        b, h = key_states.shape[:2]
        k_buf = key_states.new_empty((b, h, self.capacity, key_states.shape[-1]), dtype=self.buffer_dtype)
        v_buf = value_states.new_empty((b, h, self.capacity, value_states.shape[-1]), dtype=self.buffer_dtype)
        if start:
            k_buf[:, :, :start].copy_(self.keys)
            v_buf[:, :, :start].copy_(self.values)
        self._k_buf, self._v_buf = k_buf, v_buf

    def _set_views(self, end: int) -> None:
        self.keys = self._k_buf[:, :, :end]
        self.values = self._v_buf[:, :, :end]


class PreallocatedCache(DynamicCache):
    """A ``DynamicCache`` of :class:`PreallocatedLayer` (one per attention layer, created on first use),
    each reserving ``capacity`` tokens: the prompt width plus the new tokens of one generation; with
    ``dtype``, keys and values are kept (and handed to the attention) in that dtype whatever the model's."""

    def __init__(self, capacity: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.layer_class_to_replicate = functools.partial(PreallocatedLayer, capacity, dtype)
