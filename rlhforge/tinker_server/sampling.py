"""Tinker sampling sessions over rlhforge's HF generation engine (:class:`rlhforge.rollout.hf_engine.HFEngine`).

A sampler holds its own copy of the base model with the LoRA adapter merged in
(:func:`rlhforge.models.export.merged_lora_state`, out of place), from a live training model (a snapshot taken
by ``save_weights_and_get_sampling_client``) or from a ``sampler_weights`` / ``weights`` checkpoint on disk.
Tied input/output embeddings are untied in the copy first, so merging an adapter on the output head never
changes the input embeddings.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from rlhforge.tinker_server.codec import PayloadError

__all__ = ["Sampler"]


def _untie(model) -> None:
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and emb is not None and head.weight.data_ptr() == emb.weight.data_ptr():
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        model.config.tie_word_embeddings = False
        if hasattr(model.config, "get_text_config"):
            model.config.get_text_config().tie_word_embeddings = False


class Sampler:
    def __init__(self, base_dir: str, *, device: torch.device, merged_state: dict[str, torch.Tensor] | None = None,
                 adapter_dir: Path | None = None):
        from transformers import AutoModelForCausalLM

        from rlhforge.models.export import merged_lora_state
        from rlhforge.models.loading import load_tokenizer
        from rlhforge.rollout.hf_engine import HFEngine

        self.base_dir = base_dir
        self.tokenizer = load_tokenizer(base_dir)
        if adapter_dir is not None:
            from peft import PeftModel

            peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                             str(adapter_dir))
            merged_state = merged_lora_state(peft.state_dict(), peft)
            del peft
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).to(device)
        _untie(model)
        self.engine = HFEngine(model, pad_token_id=self.tokenizer.pad_token_id,
                               eos_token_id=self.tokenizer.eos_token_id)
        if merged_state is not None:
            self.engine.update_weights({k: v.to(device) for k, v in merged_state.items()})

    @staticmethod
    def from_training(trained, device: torch.device) -> "Sampler":
        """A snapshot of a live :class:`~rlhforge.tinker_server.training.TrainedModel`'s current weights."""
        from rlhforge.models.export import merged_lora_state

        state = {k: v.detach() for k, v in trained.module.state_dict().items()}
        return Sampler(trained.base_dir, device=device, merged_state=merged_lora_state(state, trained.module))

    # ---------------------------------------------------------------------------------------------------
    def sample(self, prompt: list[int], num_samples: int, params: dict, prompt_logprobs: bool):
        """``num_samples`` sequences (``tokens``, ``logprobs``, ``stop_reason``) and, if asked, the prompt's
        log-probs (NaN at position 0)."""
        from rlhforge.rollout.engine import SamplingParams

        stop = params.get("stop")
        stop_strs: list[str] = []
        stop_ids: tuple[int, ...] = ()
        if isinstance(stop, str):
            stop_strs = [stop]
        elif stop:
            if all(isinstance(s, str) for s in stop):
                stop_strs = list(stop)
            elif all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
                stop_ids = tuple(int(s) for s in stop)
            else:
                raise PayloadError("sampling_params.stop", "must be a string, a list of strings or a list of token ids")
        seed = params.get("seed")
        base = [SamplingParams(max_new_tokens=int(params["max_tokens"]), temperature=float(params["temperature"]),
                               top_p=float(params["top_p"]), top_k=int(params["top_k"]), stop_token_ids=stop_ids,
                               seed=None if seed is None else (int(seed) + i) % 2**63)
                for i in range(num_samples)]
        outs = self.engine.generate_sync([list(prompt)] * num_samples, base)
        sequences = []
        for out in outs:
            tokens, logprobs, reason = list(out.token_ids), list(out.logprobs), out.finish_reason
            if stop_strs:
                cut = self._stop_string_cut(tokens, stop_strs)
                if cut is not None:
                    tokens, logprobs, reason = tokens[:cut], logprobs[:cut], "stop"
            sequences.append({"tokens": tokens, "logprobs": logprobs, "stop_reason": reason})
        return sequences, (self.prompt_logprobs(prompt) if prompt_logprobs else None)

    def _stop_string_cut(self, tokens: list[int], stops: list[str]) -> int | None:
        """Length of the shortest prefix whose text contains a stop string (the stop string kept)."""
        for n in range(1, len(tokens) + 1):
            text = self.tokenizer.decode(tokens[:n])
            if any(s in text for s in stops):
                return n
        return None

    @torch.no_grad()
    def prompt_logprobs(self, prompt: list[int]) -> np.ndarray:
        from rlhforge.models.forward import token_logprobs

        ids = torch.tensor([prompt], device=self.engine.device)
        lp = token_logprobs(self.engine.model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        out = lp[0].float().cpu().numpy().astype(np.float32)
        out[0] = np.nan
        return out
