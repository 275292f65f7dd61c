"""Sampling through the tinker SDK: after ``save_weights_for_sampler`` the sampler uses the new weights, and its
log-probs equal what rlhforge computes directly on the checkpoint written to disk."""

from __future__ import annotations

import pytest
import torch

from tests.tinker.conftest import datum, token_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _saved_logprobs(tiny_model_dir, adapter_dir, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) under base + the adapter on disk (peft, unmerged), by rlhforge's token_logprobs."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rlhforge.models.forward import token_logprobs

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                      str(adapter_dir)).eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        return token_logprobs(model, {"input_ids": x, "attention_mask": torch.ones_like(x)})[0]


def test_sampler_uses_saved_weights(tinker, start_server, service_client, tiny_model_dir, ckpt_dir):
    from tinker import types

    server = start_server()
    client = service_client(server)
    tc = client.create_lora_training_client(base_model="tiny", rank=8, seed=0).result()
    tok = tc.get_tokenizer()
    target = token_ids(tok, "the cat sat on the mat and looked at the dog")
    prompt, continuation = target[:4], target[4:]
    params = types.SamplingParams(max_tokens=len(continuation), temperature=1.0, seed=7, stop=[])

    base = client.create_sampling_client(base_model="tiny").result()
    before = base.sample(types.ModelInput.from_ints(prompt), 2, params).result().sequences
    before_lp = base.compute_logprobs(types.ModelInput.from_ints(target)).result()

    for _ in range(30):  # learn the sentence
        tc.forward_backward([datum(tinker, target)], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=3e-3))
    saved = tc.save_weights_for_sampler("trained").result()
    assert saved.path.endswith("/sampler_weights/trained")
    sampler = client.create_sampling_client(model_path=saved.path).result()
    after = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result().sequences
    after_lp = sampler.compute_logprobs(types.ModelInput.from_ints(target)).result()

    # the sentence became much likelier (nats per token), and the same seed now draws other tokens
    gain = (sum(after_lp[1:]) - sum(before_lp[1:])) / (len(target) - 1)
    assert gain > 2.0, gain
    assert [s.tokens for s in after] != [s.tokens for s in before]
    assert sum(after[0].logprobs) > sum(before[0].logprobs)

    # the served log-probs are those of the checkpoint on disk, computed directly
    run, _, name = saved.path.removeprefix("tinker://").split("/")
    adapter_dir = ckpt_dir / run / "sampler_weights" / name
    for seq in after:
        direct = _saved_logprobs(tiny_model_dir, adapter_dir, prompt + seq.tokens)[len(prompt):]
        torch.testing.assert_close(torch.tensor(seq.logprobs), direct, rtol=1e-4, atol=1e-4)
    other = token_ids(tok, "one two three four five")
    served = sampler.compute_logprobs(types.ModelInput.from_ints(other)).result()
    assert served[0] is None
    direct = _saved_logprobs(tiny_model_dir, adapter_dir, other)
    torch.testing.assert_close(torch.tensor(served[1:]), direct[1:], rtol=1e-4, atol=1e-4)

    # the ephemeral sampler of the live model agrees with the one loaded from disk
    live = tc.save_weights_and_get_sampling_client().result()
    again = live.sample(types.ModelInput.from_ints(prompt), 2, params).result().sequences
    assert [s.tokens for s in again] == [s.tokens for s in after]
    torch.testing.assert_close(torch.tensor(again[0].logprobs), torch.tensor(after[0].logprobs), rtol=1e-5, atol=1e-5)


def test_stop_tokens_and_strings(tinker, start_server, service_client):
    from tinker import types

    client = service_client(start_server())
    sampler = client.create_sampling_client(base_model="tiny").result()
    prompt = types.ModelInput.from_ints([5, 6, 7])
    free = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=12, seed=3, stop=[])).result().sequences[0]
    assert free.stop_reason == "length" and len(free.tokens) == 12
    stop_at = free.tokens[5]
    first = free.tokens.index(stop_at)
    cut = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=12, seed=3, stop=[stop_at])).result().sequences[0]
    assert cut.stop_reason == "stop" and cut.tokens == free.tokens[: first + 1]
    assert cut.logprobs == pytest.approx(free.logprobs[: first + 1], abs=1e-6)
