"""The HF generation engine: batched decoding with ``transformers`` models and their KV cache.

The engine holds its own copy of the policy (``HFEngine.from_model`` deep-copies the trainer's
module; ``HFEngine.from_pretrained`` loads a folder), in the run's precision (``--ds.param_dtype``:
a bf16 run decodes with bf16 weights, as its vLLM engine would), and decodes a batch of left-padded prompts
token by token. Sampling (temperature, top-p, top-k) is done
for the whole batch at once (:func:`rlhforge.rollout.hf_generate.sample_batch`) with counter-based
noise keyed by each request's seed and response position, so each request's tokens depend only on
its prompt, parameters, seed and the weights - not on the other rows of the batch or on global RNG
state (a request without a seed draws one from the global torch RNG). The sampled tokens'
log-probs come from the same pass, and rows that finished leave the batch (and its KV cache).
``update_weights`` copies the trainer's state dict in (the weight sync).

**Decoding speed** (issue #13; the outputs are bit-identical either way). The KV cache is reserved
once per batch and written in place (:class:`rlhforge.rollout.kv_cache.PreallocatedCache`) where
``transformers.DynamicCache`` concatenates every layer's keys and values at each step
(``kv_cache="dynamic"`` keeps DynamicCache, as do models whose config declares non-attention cache
layers). On CPU a decoding step's grouped-query attention reads the un-repeated KV heads
(:mod:`rlhforge.rollout.decode_attention`) instead of copying them per query head
(``native_gqa=False`` keeps transformers' SDPA). The prefill computes the last position's logits only.

**Images.** A vision-language model's requests may carry images (``generate(..., vision=[VisionInput |
None per prompt])``, :class:`rlhforge.data.images.VisionInput`): the prefill gets their
``pixel_values`` / ``image_grid_thw`` and the M-RoPE positions the model's own ``get_rope_index``
computes over the left-padded batch (the positions the trainer's forward computes over the same
tokens); each decoding step then advances every row's positions by one. The image and video
placeholder tokens are never sampled (they are masked like a top-k filter: the log-prob stays that of
the unfiltered distribution), so a response never asks for image features it does not have.

Each decoding step holds the engine's lock, and so does ``update_weights``: a weight sync from
another thread (async training with ``--train.partial_rollout_enable``) lands between two decoding
steps, and the in-flight responses continue with the new weights (their KV cache so far was
computed with the old ones, as with vLLM's pause/resume).
"""

from __future__ import annotations

import contextlib
import copy
import threading
from typing import Iterable, Sequence

import torch

from rlhforge.rollout.engine import GenerationOutput, SamplingParams, params_per_prompt
from rlhforge.rollout.hf_generate import shared_prompts as _shared_prompts

__all__ = ["HFEngine", "filter_logits"]


def filter_logits(logits: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """Mask (``-inf``) tokens outside top-k and the top-p nucleus of one row of logits [V]."""
    from rlhforge.rollout.hf_generate import filter_logits_batch

    return filter_logits_batch(logits[None], torch.tensor([float(top_p)]), torch.tensor([int(top_k or 0)]))[0]


class HFEngine:
    """In-process ``GenerationEngine`` over an HF causal LM."""

    def __init__(self, model: torch.nn.Module, *, pad_token_id: int, eos_token_id: int | Sequence[int],
                 batch_size: int = 64, record_routing: bool = False, image_token_id: int | None = None,
                 banned_token_ids: Sequence[int] = (), kv_cache: str = "preallocated", native_gqa: bool = True,
                 shared_prefill: bool = True, padding_mask_4d: bool = True, fast_decode: bool = True,
                 decode_kernel: str = "bmm", hf_decode: str = "eager", shared: bool = False):
        if kv_cache not in ("preallocated", "dynamic"):
            raise ValueError(f"kv_cache must be 'preallocated' or 'dynamic', got {kv_cache!r}")
        self.shared = bool(shared)
        """The model is the trainer's own module (:meth:`from_model` with ``share=True``): no copy, so nothing
        to sync; each call switches it to eval mode and back, and its parameters keep their gradients."""
        self.model = model if self.shared else model.eval()
        if not self.shared:
            for p in self.model.parameters():
                p.requires_grad_(False)
        self.pad_token_id = int(pad_token_id)
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.eos_token_ids = tuple(int(e) for e in eos)
        self.batch_size = batch_size
        self.device = next(model.parameters()).device
        self._lock = threading.RLock()
        self.weight_updates = 0
        self.record_routing = record_routing
        """MoE: put each output's expert choices in ``extra["routed_experts"]`` ([prompt + response tokens,
        MoE layers, top_k] int16, -1 on the last token; :mod:`rlhforge.models.routing`)."""
        self.image_token_id = image_token_id
        """A vision-language model: its image token (requests may then carry images)."""
        self.banned = torch.tensor(sorted(set(int(t) for t in banned_token_ids)), dtype=torch.long, device=self.device)
        """Tokens never sampled (a VLM's image / video placeholders)."""
        self.kv_cache = kv_cache if _attention_only(model) else "dynamic"
        """``preallocated``: the decode loop's KV cache is reserved once per batch and written in place
        (same outputs as ``dynamic``, transformers' DynamicCache, without its per-step concatenation)."""
        self.native_gqa = native_gqa
        """Decoding steps on CPU use SDPA's own grouped-query attention (no ``repeat_kv`` copy)."""
        self.padding_mask_4d = padding_mask_4d and _padding_mask_is_enough(model)
        """Decoding steps get the padding mask as SDPA's ``[B, 1, 1, L]`` directly (plain causal sdpa
        models: a one-token query's causal mask is the padding mask), not rebuilt by transformers."""
        self.fast_decode = fast_decode and self.padding_mask_4d and self.kv_cache == "preallocated"
        """Decoding steps of plain decoder LMs skip transformers' forward machinery
        (:class:`rlhforge.rollout.fast_decode.FastDecoder`: the model's own submodules; bit-identical logits
        with ``decode_kernel="sdpa"``, equal up to float rounding with the default)."""
        if decode_kernel not in ("bmm", "sdpa"):
            raise ValueError(f"decode_kernel must be 'bmm' or 'sdpa', got {decode_kernel!r}")
        self.decode_kernel = decode_kernel
        """The lean decoding step's attention: ``bmm`` (batched matmuls, ~2x faster than CPU's fused SDPA at
        128 rows; equal up to float rounding) or ``sdpa`` (bit-identical to transformers' forward)."""
        low = next(model.parameters()).dtype in (torch.bfloat16, torch.float16)
        plain = self.native_gqa and self.padding_mask_4d and self.kv_cache == "preallocated"  # plain causal sdpa
        self.cache_dtype = torch.float32 if low and self.device.type == "cpu" and plain else None
        """A bf16/fp16 model on CPU keeps its KV cache in fp32 and attends in fp32: CPU's SDPA kernels are
        several times slower in bf16 than in fp32 (a 16 x 8 x 64 generation of the benchmark's model spends
        56% of its time in bf16 attention), while the projections gain from bf16 weights."""
        self.shared_prefill = shared_prefill
        """Requests with the same prompt in one batch (a GRPO group) share one prefill; its KV cache is
        copied to each of them before the first token is sampled (same outputs, a fraction of the work)."""
        from rlhforge.rollout.graph_decode import GraphDecoder

        with self.eval_mode():
            self.graphs = GraphDecoder.build(self, hf_decode)
        """``--rollout.hf_decode``: the static-shape decode loop (CUDA graphs on a GPU,
        :mod:`rlhforge.rollout.graph_decode`), or None: the loop below."""

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer, batch_size: int = 64, record_routing: bool = False,
                   kv_cache: str = "preallocated", dtype: torch.dtype | None = None, hf_decode: str = "eager",
                   share: bool = False) -> "HFEngine":
        """An engine with its own copy of ``model`` (the trainer's unwrapped module), in ``dtype`` if given
        (a bf16 run's engine decodes with bf16 weights, as a vLLM engine of that run would); ``share``: with
        ``model`` itself (no copy; ``dtype`` must then be the model's), as TRL generates with the model it
        trains."""
        if share:
            if dtype is not None and dtype != next(model.parameters()).dtype:
                raise ValueError(f"an engine sharing the trainer's module decodes in its dtype, not {dtype}")
            engine_model = model
        else:
            engine_model = copy.deepcopy(model)
            if dtype is not None:
                engine_model = engine_model.to(dtype)
        return cls(engine_model, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                   batch_size=batch_size, record_routing=record_routing, kv_cache=kv_cache, hf_decode=hf_decode,
                   shared=share, **_vision_kwargs(tokenizer))

    @contextlib.contextmanager
    def eval_mode(self):
        """The model in eval mode for one call; a shared module's modes are put back as they were after it."""
        if not self.shared:
            yield
            return
        modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        try:
            yield
        finally:
            for m, training in modes:
                m.training = training

    @classmethod
    def from_pretrained(cls, path: str, tokenizer, device: str | torch.device = "cpu", batch_size: int = 64,
                        dtype: torch.dtype = torch.float32, record_routing: bool = False,
                        kv_cache: str = "preallocated", hf_decode: str = "eager") -> "HFEngine":
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        vision = _vision_kwargs(tokenizer)
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        model = auto.from_pretrained(path, dtype=dtype).to(device)
        if torch.device(device).type == "cpu":  # as the trainers' models (rlhforge/models/cpu_linear.py)
            from rlhforge.models.cpu_linear import use_cpu_linear

            use_cpu_linear(model)
        return cls(model, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                   batch_size=batch_size, record_routing=record_routing, kv_cache=kv_cache, hf_decode=hf_decode,
                   **vision)

    # -- the protocol -----------------------------------------------------------------------------
    async def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams] | SamplingParams,
                       vision: Sequence | None = None) -> list[GenerationOutput]:
        return self.generate_sync(prompts, params, vision)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]) -> None:
        from rlhforge.backend.fingerprint import SyncReport, params_checksum, state_fingerprint

        if self.shared:
            raise RuntimeError("this HF engine generates with the trainer's own module: there are no weights to "
                               "load into it (the trainer skips the sync of such an engine)")
        state = dict(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
        with self._lock:  # reuse: what was checksummed before and is unchanged since is not read again (the
            # sender's fingerprint of these very tensors in this process; the parameters as the last load left them)
            before = params_checksum(self.model, reuse=True)
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            self.weight_updates += 1
            previous = self._report["fingerprint"] if self._report else None
            self._report = SyncReport(fingerprint=state_fingerprint(state, reuse=True), tensors=len(state),
                                      previous=previous, params_changed=params_checksum(self.model, reuse=True) != before)
        missing = [k for k in missing if k in dict(self.model.named_parameters())]
        if missing or unexpected:
            raise ValueError(f"weight sync: missing {missing[:5]}, unexpected {unexpected[:5]} (of {len(state)} tensors)")

    _report: dict | None = None

    def sync_reports(self) -> list[tuple[str, list]]:
        """The last sync's report (rlhforge.backend.fingerprint.SyncReport), as the other engines give it."""
        return [("HF engine", [dict(self._report) if self._report else None])]

    #: padded tokens of one probe forward (the probe is ``train.sync_probe_tokens``, 128 by default, long)
    PROBE_BATCH_TOKENS = 128

    @torch.no_grad()
    def probe_logprobs(self, prompts: Sequence[Sequence[int]]) -> list[tuple[str, list[list[float]]]]:
        """The post-sync check's scoring (rlhforge.backend.sync_probe): for each sequence, the log-prob of
        every token after the first under the engine's weights as they are now (temperature 1, no
        filtering). Sequences go through plain forwards a few at a time (:func:`probe_batches`), padded on
        the right: a causal model's real tokens never see the padding after them."""
        rows: list[list[float] | None] = [None] * len(prompts)
        with self._lock, self.eval_mode():
            for group in probe_batches([len(p) for p in prompts], self.PROBE_BATCH_TOKENS):
                width = max(len(prompts[i]) for i in group)
                x = torch.full((len(group), width), self.pad_token_id, dtype=torch.long, device=self.device)
                mask = torch.zeros_like(x)
                for r, i in enumerate(group):
                    x[r, : len(prompts[i])] = torch.tensor(list(prompts[i]), dtype=torch.long)
                    mask[r, : len(prompts[i])] = 1
                logits = self.model(input_ids=x, attention_mask=mask if len(group) > 1 else None).logits
                for r, i in enumerate(group):
                    n = len(prompts[i])
                    lp = torch.log_softmax(logits[r, : n - 1].float(), -1).gather(-1, x[r, 1:n, None])[:, 0]
                    rows[i] = lp.cpu().tolist()
        return [("HF engine", rows)]

    def sleep(self) -> None:  # nothing to release: the copy lives in host memory on CPU
        pass

    def wake_up(self) -> None:
        pass

    # -- decoding ---------------------------------------------------------------------------------
    def generate_sync(self, prompts, params, vision: Sequence | None = None) -> list[GenerationOutput]:
        params = params_per_prompt(prompts, params)
        if vision is not None and any(v is not None for v in vision):
            if len(vision) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(vision)} image entries")
            if self.image_token_id is None:
                raise ValueError("this engine's model is not a vision-language model: it cannot take images")
        else:
            vision = None
        out: list[GenerationOutput] = []
        with self.eval_mode():
            for start in range(0, len(prompts), self.batch_size):
                end = start + self.batch_size
                out.extend(self._generate_batch(prompts[start:end], params[start:end],
                                                None if vision is None else vision[start:end]))
        return out

    @torch.no_grad()
    def _generate_batch(self, prompts, params: Sequence[SamplingParams], vision=None) -> list[GenerationOutput]:
        from rlhforge.rollout.hf_generate import batch_sampling, left_padded, row_uniforms, sample_batch

        n = len(prompts)
        if any(len(p) == 0 for p in prompts):
            raise ValueError("cannot generate from an empty prompt")
        # a request without a seed draws one from the global torch RNG (reproducible under manual_seed)
        seeds = [int(sp.seed) if sp.seed is not None else int(torch.randint(0, 2**62, ())) for sp in params]
        if self.graphs is not None and vision is None:  # None: another thread's batch holds the static buffers
            got = self.graphs.generate(prompts, params, seeds)
            if got is not None:
                return got
        outputs = [GenerationOutput([], [], "length") for _ in range(n)]
        rows = [i for i in range(n) if params[i].max_new_tokens > 0]
        if not rows:
            return outputs
        dev = self.device
        ids, attn = left_padded([prompts[i] for i in rows], self.pad_token_id)
        width = ids.shape[1]
        b = batch_sampling([params[i] for i in rows], [seeds[i] for i in rows], self.eos_token_ids, dev)
        temperature, top_p, top_k, keys, max_new, stops = (b[k] for k in ("temperature", "top_p", "top_k", "keys",
                                                                           "max_new", "stops"))
        all_greedy, any_filter, any_greedy = b["all_greedy"], b["any_filter"], b["any_greedy"]
        steps = int(max_new.max())
        uniforms = None if all_greedy else row_uniforms(keys, steps)  # every step's draws at once: [B, steps]
        out_tokens = torch.zeros((len(rows), steps), dtype=torch.long, device=dev)
        out_logps = torch.zeros((len(rows), steps), dtype=torch.float32, device=dev)
        lengths = torch.zeros(len(rows), dtype=torch.long, device=dev)
        stopped = torch.zeros(len(rows), dtype=torch.bool, device=dev)
        alive = torch.arange(len(rows), device=dev)  # output row of each row of the running batch
        active = torch.ones(len(rows), dtype=torch.bool, device=dev)  # still decoding (else carried until compaction)
        ids, attn = ids.to(dev), attn.to(dev)
        cache = self._new_cache(width + steps - 1)  # the last sampled token is never fed back
        position = (attn.cumsum(-1) - 1).clamp(min=0)
        pixels = {}  # prefill only: the images' pixel inputs, positions from the model's M-RoPE
        if vision is not None and any(vision[i] is not None for i in rows):
            pixels, position = self._vision_prefill(ids, attn, [vision[i] for i in rows])
        step_ids = ids
        route = _RouteLog(self.model, len(rows), width, steps) if self.record_routing else None
        banned = self.banned if len(self.banned) else None
        # the prefill runs each distinct prompt once (a GRPO group's samples share it) and its cache is copied
        firsts, copies = ((None, None) if pixels or route or not self.shared_prefill
                          else _shared_prompts([prompts[i] for i in rows], dev))
        fast = None
        if self.fast_decode and not pixels and route is None:
            from rlhforge.rollout.fast_decode import FastDecoder

            fast = FastDecoder.build(self.model, self.decode_kernel)  # per batch: the current parameter tensors
        for t in range(steps):
            step_attn, step_pos = attn, position
            if t > 0 and self.padding_mask_4d:
                step_attn = attn.bool()[:, None, None, :]
            if t == 0 and firsts is not None:
                step_ids, step_attn, step_pos = ids[firsts], attn[firsts], position[firsts]
            if t > 0 and fast is not None:
                with self._lock:
                    logits = fast.step(step_ids, step_pos, step_attn, cache).float()
            else:
                with self._lock, self._attention(), (route.recorder if route else contextlib.nullcontext()):
                    logits = self.model(input_ids=step_ids, attention_mask=step_attn, position_ids=step_pos,
                                        past_key_values=cache, use_cache=True, logits_to_keep=1,  # prefill: last only
                                        **pixels).logits[:, -1, :].float()
            if t == 0 and firsts is not None:
                logits = logits[copies]
                cache.batch_select_indices(copies)
            pixels = {}
            if route is not None:
                route.add(t, alive)
            tok, logp = sample_batch(logits, temperature[alive], top_p[alive], top_k[alive], keys[alive], t,
                                     all_greedy=all_greedy, any_filter=any_filter, any_greedy=any_greedy,
                                     banned=banned, uniforms=None if uniforms is None else uniforms[alive, t])
            out_tokens[alive, t] = torch.where(active, tok, out_tokens[alive, t])
            out_logps[alive, t] = torch.where(active, logp, out_logps[alive, t])
            lengths[alive] = torch.where(active, t + 1, lengths[alive])
            is_stop = active & (tok[:, None] == stops[alive]).any(-1)
            stopped[alive] |= is_stop
            active = active & ~is_stop & (t + 1 < max_new[alive])
            n_active = int(active.sum())  # the one host sync per step
            if n_active == 0:
                break
            if len(active) - n_active >= max(1, len(active) // 4):  # drop finished rows (and their KV cache)
                kept = active.nonzero()[:, 0]
                cache.batch_select_indices(kept)
                alive, tok, attn = alive[kept], tok[kept], attn[kept]
                position = position.index_select(-2, kept)  # [B, 1] or M-RoPE's [3, B, 1]
                active = active[kept]
            step_ids = tok[:, None]
            attn = torch.cat([attn, torch.ones((attn.shape[0], 1), dtype=attn.dtype, device=attn.device)], dim=1)
            position = position[..., -1:] + 1
        tokens, logps = out_tokens.cpu().tolist(), out_logps.cpu().tolist()
        lengths_l, stopped_l = lengths.cpu().tolist(), stopped.cpu().tolist()
        for r, i in enumerate(rows):
            k = lengths_l[r]
            outputs[i] = GenerationOutput(tokens[r][:k], logps[r][:k], "stop" if stopped_l[r] else "length")
            if route is not None:
                outputs[i].extra["routed_experts"] = route.row(r, len(prompts[i]), k)
        return outputs

    def _new_cache(self, capacity: int):
        """The KV cache of one batch: ``capacity`` tokens per row (prompt width + new tokens)."""
        if self.kv_cache == "dynamic":
            from transformers import DynamicCache

            return DynamicCache()
        from rlhforge.rollout.kv_cache import PreallocatedCache

        return PreallocatedCache(capacity, dtype=self.cache_dtype)

    def _attention(self):
        """The attention the model's forward uses (:func:`rlhforge.rollout.decode_attention.decode_attention`)."""
        if not self.native_gqa:
            return contextlib.nullcontext()
        from rlhforge.rollout.decode_attention import decode_attention

        return decode_attention(self.model)

    def _vision_prefill(self, ids: torch.Tensor, attn: torch.Tensor, visions) -> tuple[dict, torch.Tensor]:
        """The prefill's pixel inputs and M-RoPE positions [3, B, W] of a left-padded batch."""
        from rlhforge.data.images import vision_batch
        from rlhforge.models.vlm import mrope_positions

        inputs = vision_batch(ids, visions, self.image_token_id)
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        return inputs, mrope_positions(self.model, ids, attn, inputs)


def _padding_mask_is_enough(model) -> bool:
    """Whether the decoding steps of ``model`` can take the padding mask as a 4-D boolean mask."""
    from rlhforge.models.segment_attention import plain_causal

    config = model.config.get_text_config(decoder=True)
    return getattr(config, "_attn_implementation_internal", None) == "sdpa" and plain_causal(config)


def _attention_only(model) -> bool:
    """Whether every cache layer of ``model`` is (full, sliding or chunked) attention: hybrids with linear
    attention / conv states keep transformers' DynamicCache."""
    config = model.config.get_text_config(decoder=True)
    types = getattr(config, "layer_types", None) or ()
    return all(t in ("full_attention", "sliding_attention", "chunked_attention") for t in types)


def probe_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices of ``lengths`` in groups, in order, each group's ``rows x longest`` at most ``budget`` (a
    sequence longer than that goes alone)."""
    groups: list[list[int]] = []
    width = 0
    for i, n in enumerate(lengths):
        if groups and (len(groups[-1]) + 1) * max(width, n) <= budget:
            groups[-1].append(i)
            width = max(width, n)
        else:
            groups.append([i])
            width = n
    return groups


def _vision_kwargs(tokenizer) -> dict:
    """A :class:`rlhforge.models.vlm.VisionProcessor`'s image token and never-sampled placeholders."""
    if getattr(tokenizer, "image_processor", None) is None:
        return {}
    return {"image_token_id": tokenizer.image_token_id, "banned_token_ids": tokenizer.placeholder_token_ids}


class _RouteLog:
    """The experts each router chose for every token a batch fed through the model: the prefill (the
    left-padded prompts) and each decoding step's one token per running row."""

    def __init__(self, model, n_rows: int, width: int, steps: int):
        from rlhforge.models.routing import record_routing, routers

        found = routers(model)
        if not found:
            raise ValueError("routing replay needs an MoE model: this engine's model has no top-k router")
        self.recorder = record_routing(model)
        self.width = width
        self.log = torch.full((n_rows, width + steps, len(found), int(found[0].top_k)), -1, dtype=torch.int16)

    def add(self, t: int, alive: torch.Tensor) -> None:
        got = self.recorder.last().cpu()
        self.recorder.calls.clear()
        if t == 0:
            self.log[:, : self.width] = got.view(self.log.shape[0], self.width, *got.shape[1:])
        else:  # step t fed the token sampled at step t - 1 (response position t - 1)
            self.log[alive.cpu(), self.width + t - 1] = got

    def row(self, r: int, prompt_len: int, n_new: int) -> torch.Tensor:
        """[prompt_len + n_new, layers, top_k]: the last token was never fed (-1)."""
        out = self.log[r, self.width - prompt_len: self.width + n_new].clone()
        if n_new:
            out[-1] = -1
        return out
