"""The HF engine's static-shape decoding: a static KV cache, bucketed batch shapes and CUDA graphs.

For users without vLLM (a new GPU, AMD, an install that fails) and for the GPU checks here. The eager
decode loop (:class:`rlhforge.rollout.hf_engine.HFEngine`) launches a few hundred small kernels per token
step from Python; on a GPU that launch time, not the weights' bandwidth, sets the speed of a small model.
Here every decoding step has fixed shapes, so it is captured once as a CUDA graph and replayed:

- **static KV buffers** ``[bucket rows, kv heads, bucket length, head dim]`` per layer, reserved once per
  (rows, length) bucket and reused by every batch of that bucket (:class:`StaticStep`);
- **buckets**: a batch's rows are padded up to a power of two (1, 2, 4, ... 128, then multiples of 128)
  and its length (prompt width + new tokens) up to a multiple of 128 (:func:`buckets`), so a run's
  batches reuse a handful of graphs; the padding rows decode pad tokens that nobody reads;
- the step reads its inputs from **static tensors** (the token ids, their positions, the cache slot this
  step writes as a one-element tensor), writes the new keys/values with ``index_copy_`` and attends over
  the *whole* buffer with an additive mask (0 where a row has a token, -inf elsewhere; the step unmasks its
  own slot): no data-dependent shape, no ``.item()``, no branch on a tensor's value. Finished rows stay in
  place (their tokens are not recorded) instead of leaving the batch;
- the prefill is the eager engine's (the model's forward over the left-padded prompts, a GRPO group's
  prompt once), copied into the buffer; sampling (:func:`rlhforge.rollout.hf_generate.sample_batch`: greedy,
  temperature, top-k / top-p, per-request counter-based noise) runs outside the graph on the real rows.

On CUDA the step is captured with ``torch.cuda.CUDAGraph`` after a warm-up on a side stream (one graph per
bucket); elsewhere the same static step runs eagerly - that is how the CPU tests
hold it to the eager engine: the same greedy tokens, log-probs within float rounding (the attention sums
over a longer, masked row). The weights are read in place: a weight sync (``load_state_dict`` copies into
the same tensors) needs no new capture; parameters replaced by new tensors rebuild the graphs.
Applies to the families :class:`rlhforge.rollout.fast_decode.FastDecoder` runs (Llama, Qwen2, Qwen3,
Mistral without a window), text only, without MoE routing records.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from rlhforge.config.parsing import ConfigError
from rlhforge.rollout.engine import GenerationOutput, SamplingParams
from rlhforge.rollout.fast_decode import FastDecoder, grouped_decode_attention

__all__ = ["GraphDecoder", "StaticStep", "buckets", "MODES"]

MODES = ("auto", "graphs", "eager")
LENGTH_BUCKET = 128


def buckets(rows: int, length: int) -> tuple[int, int]:
    """(rows, length) padded up to their buckets: rows to a power of two up to 128 then to a multiple of 128,
    length to a multiple of :data:`LENGTH_BUCKET`."""
    b = 1
    while b < rows and b < 128:
        b *= 2
    if rows > 128:
        b = -(-rows // 128) * 128
    return b, -(-length // LENGTH_BUCKET) * LENGTH_BUCKET


class StaticStep:
    """One (rows, length) bucket: the static KV buffers, the step's static inputs and outputs, and on CUDA
    its captured graph. :meth:`__call__` runs one decoding step (replays the graph) and returns the logits
    ``[rows, V]`` (float32; a static tensor, overwritten by the next step)."""

    def __init__(self, fast: FastDecoder, rows: int, length: int, kv_heads: int, dtype: torch.dtype,
                 device: torch.device, graphs: bool, pool=None):
        self.fast, self.rows, self.length, self.kv_heads = fast, rows, length, kv_heads
        self.ids = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.pos = torch.zeros((rows, 1), dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.mask = torch.full((rows, 1, length), float("-inf"), dtype=dtype, device=device)
        """Additive attention mask, one row per sequence: 0 where the row holds a token."""
        dims = [p["head_dim"] for p in fast.layers]
        self.k = [torch.zeros((rows, kv_heads, length, d), dtype=dtype, device=device) for d in dims]
        self.v = [torch.zeros((rows, kv_heads, length, d), dtype=dtype, device=device) for d in dims]
        self.logits: torch.Tensor | None = None
        self.graph = None
        if graphs:
            self._capture(pool)

    @torch.no_grad()
    def _step(self) -> torch.Tensor:
        rows, kvh, length = self.rows, self.kv_heads, self.length
        self.mask.index_fill_(-1, self.slot, 0.0)  # this step's token: every row attends to it
        sdpa = torch.nn.functional.scaled_dot_product_attention
        bias = self.mask[:, None].expand(rows, kvh, 1, length).reshape(rows * kvh, 1, length) \
            if self.mask.device.type == "cpu" else None
        mask4d = self.mask[:, None]  # [rows, 1, 1, length]

        def attend(i, p, q, k, v):
            kb, vb = self.k[i], self.v[i]
            kb.index_copy_(2, self.slot, k.to(kb.dtype))
            vb.index_copy_(2, self.slot, v.to(vb.dtype))
            if kb.device.type == "cpu":  # the eager engine's CPU kernel (batched matmuls)
                return grouped_decode_attention(q.to(kb.dtype), kb, vb, bias, p["scaling"])
            # elsewhere SDPA's fused kernel (fp32 accumulation), each KV head's query heads as its query rows
            out = sdpa(q.to(kb.dtype).reshape(rows, kvh, -1, q.shape[-1]), kb, vb, attn_mask=mask4d,
                       scale=p["scaling"])
            return out.reshape(rows, 1, -1)
        return self.fast.run(self.ids, self.pos, attend).float()

    @torch.no_grad()
    def _capture(self, pool) -> None:
        """Warm up on a side stream (allocator, cuBLAS workspaces), then capture one step. The warm-up and the
        capture write slot 0 of the buffers; :meth:`load` resets the mask of every batch."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: a training thread's CUDA work (async runs) does not break the capture
        with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
            self.logits = self._step()

    def load(self, layers, width: int, attn: torch.Tensor, rows_of: torch.Tensor | None) -> None:
        """A new batch: the prefill's keys/values ``layers`` ([prefill rows, kv heads, width, D] each) into
        columns ``[0, width)`` (row ``r`` takes prefill row ``rows_of[r]``), the mask from ``attn`` [n, width]
        (1 on the prompt's tokens); every other column and the padding rows masked."""
        n = attn.shape[0]
        self.mask.fill_(float("-inf"))
        self.mask[:n, 0, :width].masked_fill_(attn.bool(), 0.0)
        for i, (k, v) in enumerate(layers):
            if rows_of is not None:
                k, v = k[rows_of], v[rows_of]
            self.k[i][:n, :, :width].copy_(k)
            self.v[i][:n, :, :width].copy_(v)
        self.ids.zero_()
        self.pos.zero_()

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slot: int) -> torch.Tensor:
        n = tokens.shape[0]
        self.ids[:n, 0].copy_(tokens)
        self.pos[:n, 0].copy_(positions)
        self.slot.fill_(slot)
        if self.graph is None:
            return self._step()
        self.graph.replay()
        return self.logits


class GraphDecoder:
    """The static-shape decode loop of one engine: its buckets (:class:`StaticStep`, built on first use) and
    :meth:`generate`. ``graphs``: capture CUDA graphs (CUDA only); else the static step runs eagerly."""

    MAX_BUCKETS = 8

    def __init__(self, engine, fast: FastDecoder, graphs: bool):
        self.engine, self.fast, self.graphs = engine, fast, graphs
        self.steps: dict[tuple[int, int], StaticStep] = {}
        self._busy = threading.Lock()
        self.param_ptrs = _param_ptrs(engine.model)
        config = engine.model.config.get_text_config(decoder=True)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self.dtype = engine.cache_dtype or next(engine.model.parameters()).dtype

    @classmethod
    def build(cls, engine, mode: str) -> "GraphDecoder | None":
        """The decoder for ``--rollout.hf_decode mode`` (None: the eager loop). ``auto``: graphs on CUDA for a
        supported model, else eager; ``graphs``: the static step (captured on CUDA, eager elsewhere), an error
        for a model it does not support."""
        if mode not in MODES:
            raise ConfigError(f"--rollout.hf_decode must be one of {', '.join(MODES)}, got {mode!r}")
        if mode == "eager" or (mode == "auto" and engine.device.type != "cuda"):
            return None
        fast = FastDecoder.build(engine.model) if engine.kv_cache == "preallocated" and engine.padding_mask_4d else None
        rope = str(getattr(getattr(fast, "rotary", None), "rope_type", "default"))  # these update on the host
        if fast is None or engine.record_routing or engine.image_token_id is not None or "dynamic" in rope \
                or rope == "longrope":
            if mode == "auto":
                return None
            raise ConfigError(f"--rollout.hf_decode graphs: {type(engine.model).__name__} is not supported (text-only "
                             "Llama / Qwen2 / Qwen3 / Mistral without a sliding window, sdpa attention, no dynamic "
                             "or longrope RoPE, no routing replay); use --rollout.hf_decode eager or auto")
        decoder = cls(engine, fast, graphs=engine.device.type == "cuda")
        if mode == "auto":  # a capture that fails here (a driver, a kernel that cannot be captured): the eager loop
            try:
                decoder.step_for(1, 1)
            except Exception as err:  # noqa: BLE001 - auto falls back, and says so
                print(f"[rlhforge] note: --rollout.hf_decode auto: CUDA graph capture failed ({type(err).__name__}: "
                      f"{str(err)[:200]}); the HF engine decodes eagerly", flush=True)
                return None
        return decoder

    def step_for(self, rows: int, length: int) -> StaticStep:
        key = buckets(rows, length)
        if _param_ptrs(self.engine.model) != self.param_ptrs:  # parameters replaced: the graphs read the old ones
            self.fast = FastDecoder.build(self.engine.model)
            self.steps.clear()
            self.param_ptrs = _param_ptrs(self.engine.model)
        if key in self.steps:
            self.steps[key] = self.steps.pop(key)  # most recently used last
            return self.steps[key]
        # the KV buffers kept: at most as many bytes again as the new bucket's (oldest buckets go first)
        new = self.kv_bytes(*key)
        while self.steps and (len(self.steps) >= self.MAX_BUCKETS
                              or sum(self.kv_bytes(*k) for k in self.steps) > new):
            self.steps.pop(next(iter(self.steps)))
        self.steps[key] = StaticStep(self.fast, *key, self.kv_heads, self.dtype, self.engine.device, self.graphs)
        return self.steps[key]

    def kv_bytes(self, rows: int, length: int) -> int:
        """The KV buffers of a (rows, length) bucket, in bytes."""
        per_token = sum(2 * self.kv_heads * p["head_dim"] for p in self.fast.layers) * self.dtype.itemsize
        return rows * length * per_token

    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], seeds: Sequence[int],
                 check_every: int = 4) -> list[GenerationOutput] | None:
        """The engine's ``_generate_batch`` (same inputs, same outputs) on the static step, or None while another
        thread's generation holds the static buffers (the engine's generation pool runs several: that batch
        takes the eager loop). The host reads the finished rows every ``check_every`` steps (the steps in
        between decode rows that may have finished: their tokens are not recorded)."""
        if not self._busy.acquire(blocking=False):
            return None
        try:
            return self._generate(prompts, params, seeds, check_every)
        finally:
            self._busy.release()

    @torch.no_grad()
    def _generate(self, prompts, params, seeds, check_every: int) -> list[GenerationOutput]:
        from rlhforge.rollout.hf_generate import batch_sampling, left_padded, sample_batch, shared_prompts
        from rlhforge.rollout.kv_cache import PreallocatedCache

        eng, dev = self.engine, self.engine.device
        outputs = [GenerationOutput([], [], "length") for _ in prompts]
        rows = [i for i in range(len(prompts)) if params[i].max_new_tokens > 0]
        if not rows:
            return outputs
        ids, attn = left_padded([prompts[i] for i in rows], eng.pad_token_id)
        n, width = ids.shape
        b = batch_sampling([params[i] for i in rows], [seeds[i] for i in rows], eng.eos_token_ids, dev)
        temperature, top_p, top_k, keys, max_new, stops = (b[k] for k in ("temperature", "top_p", "top_k", "keys",
                                                                           "max_new", "stops"))
        flags = dict(all_greedy=b["all_greedy"], any_filter=b["any_filter"], any_greedy=b["any_greedy"],
                     banned=eng.banned if len(eng.banned) else None)
        ids, attn = ids.to(dev), attn.to(dev)
        steps = int(max(params[i].max_new_tokens for i in rows))
        position = (attn.cumsum(-1) - 1).clamp(min=0)
        firsts, copies = (None, None) if not eng.shared_prefill else shared_prompts([prompts[i] for i in rows], dev)
        pick = (lambda x: x) if firsts is None else (lambda x: x[firsts])
        cache = PreallocatedCache(width, dtype=eng.cache_dtype)
        with eng._lock, eng._attention():
            logits = eng.model(input_ids=pick(ids), attention_mask=pick(attn), position_ids=pick(position),
                               past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1, :].float()
        if copies is not None:
            logits = logits[copies]
        out_tokens = torch.zeros((n, steps), dtype=torch.long, device=dev)
        out_logps = torch.zeros((n, steps), dtype=torch.float32, device=dev)
        active = torch.ones(n, dtype=torch.bool, device=dev)
        stopped = torch.zeros(n, dtype=torch.bool, device=dev)
        lengths = torch.zeros(n, dtype=torch.long, device=dev)
        static = None
        prompt_len = attn.sum(-1)
        for t in range(steps):
            if t > 0:
                if static is None:
                    static = self.step_for(n, width + steps - 1)
                    static.load([(la.keys, la.values) for la in cache.layers], width, attn, copies)
                    del cache
                with eng._lock:
                    logits = static(tok, prompt_len + t - 1, width + t - 1)[:n]
            tok, logp = sample_batch(logits, temperature, top_p, top_k, keys, t, **flags)
            out_tokens[:, t] = torch.where(active, tok, 0)
            out_logps[:, t] = torch.where(active, logp, 0.0)
            lengths = torch.where(active, t + 1, lengths)
            is_stop = active & (tok[:, None] == stops).any(-1)
            stopped |= is_stop
            active = active & ~is_stop & (t + 1 < max_new)
            if (t + 1) % check_every == 0 and not bool(active.any()):  # the host sync, every few steps
                break
        tokens, logps = out_tokens.cpu().tolist(), out_logps.cpu().tolist()
        lengths_l, stopped_l = lengths.cpu().tolist(), stopped.cpu().tolist()
        for r, i in enumerate(rows):
            k = lengths_l[r]
            outputs[i] = GenerationOutput(tokens[r][:k], logps[r][:k], "stop" if stopped_l[r] else "length")
        return outputs


def _param_ptrs(model) -> tuple[int, ...]:
    return tuple(p.data_ptr() for p in model.parameters())
