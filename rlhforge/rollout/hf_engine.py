"""The HF generation engine: batched decoding with ``transformers`` models and their KV cache.

The engine holds its own copy of the policy (``HFEngine.from_model`` deep-copies the trainer's
module; ``HFEngine.from_pretrained`` loads a folder) and decodes a batch of left-padded prompts
token by token with the model's ``DynamicCache``. Sampling (temperature, top-p, top-k) is done
here, per row, with a ``torch.Generator`` seeded from the request, so each request's tokens depend
only on its prompt, parameters, seed and the weights - not on the other rows of the batch or on
global RNG state. ``update_weights`` copies the trainer's state dict in (the weight sync).

Each decoding step holds the engine's lock, and so does ``update_weights``: a weight sync from
another thread (async training with ``--train.partial_rollout_enable``) lands between two decoding
steps, and the in-flight responses continue with the new weights (their KV cache so far was
computed with the old ones, as with vLLM's pause/resume).
"""

from __future__ import annotations

import copy
import threading
from typing import Iterable, Sequence

import torch

from rlhforge.rollout.engine import GenerationOutput, SamplingParams

__all__ = ["HFEngine", "filter_logits"]


def filter_logits(logits: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """Mask (``-inf``) tokens outside top-k and the top-p nucleus of one row of logits [V]."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        cum = probs.cumsum(-1)
        remove = cum - probs >= top_p  # keep tokens until the mass before them reaches top_p
        remove[0] = False
        logits = logits.clone()
        logits[order[remove]] = float("-inf")
    return logits


class HFEngine:
    """In-process ``GenerationEngine`` over an HF causal LM."""

    def __init__(self, model: torch.nn.Module, *, pad_token_id: int, eos_token_id: int | Sequence[int],
                 batch_size: int = 64):
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.pad_token_id = int(pad_token_id)
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.eos_token_ids = tuple(int(e) for e in eos)
        self.batch_size = batch_size
        self.device = next(model.parameters()).device
        self._lock = threading.RLock()
        self.weight_updates = 0

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer, batch_size: int = 64) -> "HFEngine":
        """An engine with its own copy of ``model`` (the trainer's unwrapped module)."""
        return cls(copy.deepcopy(model), pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                   batch_size=batch_size)

    @classmethod
    def from_pretrained(cls, path: str, tokenizer, device: str | torch.device = "cpu", batch_size: int = 64,
                        dtype: torch.dtype = torch.float32) -> "HFEngine":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        return cls(model, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                   batch_size=batch_size)

    # -- the protocol -----------------------------------------------------------------------------
    async def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams] | SamplingParams
                       ) -> list[GenerationOutput]:
        return self.generate_sync(prompts, params)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]) -> None:
        state = dict(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
        with self._lock:
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            self.weight_updates += 1
        missing = [k for k in missing if k in dict(self.model.named_parameters())]
        if missing or unexpected:
            raise ValueError(f"weight sync: missing {missing[:5]}, unexpected {unexpected[:5]} (of {len(state)} tensors)")

    def sleep(self) -> None:  # nothing to release: the copy lives in host memory on CPU
        pass

    def wake_up(self) -> None:
        pass

    # -- decoding ---------------------------------------------------------------------------------
    def generate_sync(self, prompts, params) -> list[GenerationOutput]:
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        out: list[GenerationOutput] = []
        for start in range(0, len(prompts), self.batch_size):
            out.extend(self._generate_batch(prompts[start : start + self.batch_size], params[start : start + self.batch_size]))
        return out

    @torch.no_grad()
    def _generate_batch(self, prompts, params: Sequence[SamplingParams]) -> list[GenerationOutput]:
        from transformers import DynamicCache

        n = len(prompts)
        if any(len(p) == 0 for p in prompts):
            raise ValueError("cannot generate from an empty prompt")
        width = max(len(p) for p in prompts)
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
            attn[row, width - len(p):] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        gens = []
        for sp in params:
            if sp.seed is None:
                gens.append(None)
            else:
                g = torch.Generator(device="cpu")
                g.manual_seed(int(sp.seed) % (2**63))
                gens.append(g)
        stops = [set(sp.stop_token_ids) | set(self.eos_token_ids) for sp in params]
        max_new = max(sp.max_new_tokens for sp in params)
        tokens: list[list[int]] = [[] for _ in range(n)]
        logps: list[list[float]] = [[] for _ in range(n)]
        reasons = ["length"] * n
        done = [sp.max_new_tokens <= 0 for sp in params]
        cache = DynamicCache()
        position = (attn.cumsum(-1) - 1).clamp(min=0)
        step_ids = ids
        for _ in range(max_new):
            if all(done):
                break
            with self._lock:
                logits = self.model(input_ids=step_ids, attention_mask=attn, position_ids=position,
                                    past_key_values=cache, use_cache=True).logits[:, -1, :].float().cpu()
            next_ids = torch.full((n,), self.pad_token_id, dtype=torch.long)
            for row in range(n):
                if done[row]:
                    continue
                sp = params[row]
                row_logits = logits[row]
                if sp.temperature > 0:
                    scaled = row_logits / sp.temperature
                    logp_all = torch.log_softmax(scaled, dim=-1)
                    filtered = filter_logits(scaled, sp.top_p, sp.top_k)
                    probs = torch.softmax(filtered, dim=-1)
                    tok = int(torch.multinomial(probs, 1, generator=gens[row]).item())
                else:
                    logp_all = torch.log_softmax(row_logits, dim=-1)
                    tok = int(torch.argmax(row_logits).item())
                next_ids[row] = tok
                tokens[row].append(tok)
                logps[row].append(float(logp_all[tok]))
                if tok in stops[row]:
                    done[row], reasons[row] = True, "stop"
                elif len(tokens[row]) >= sp.max_new_tokens:
                    done[row] = True
            step_ids = next_ids[:, None].to(self.device)
            attn = torch.cat([attn, torch.ones((n, 1), dtype=attn.dtype, device=attn.device)], dim=1)
            position = position[:, -1:] + 1
        return [GenerationOutput(tokens[i], logps[i], reasons[i]) for i in range(n)]
