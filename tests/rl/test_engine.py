"""The HF generation engine: seeded per request, log-probs match the trainer, stop tokens, weight sync."""

import asyncio

import pytest
import torch

from rlhforge.rollout.engine import SamplingParams
from rlhforge.rollout.hf_engine import HFEngine, filter_logits


@pytest.fixture(scope="module")
def engine_and_tok(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return HFEngine.from_pretrained(str(tiny_model_dir), tok, batch_size=4), tok


def _prompts(tok, texts):
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for t in texts]


def test_per_request_seeds_do_not_depend_on_the_batch(engine_and_tok):
    engine, tok = engine_and_tok
    prompts = _prompts(tok, ["What is 1 + 2?", "Reverse the letters: abc please", "hi"])
    params = [SamplingParams(max_new_tokens=8, temperature=1.0, seed=s) for s in (11, 12, 13)]
    together = asyncio.run(engine.generate(prompts, params))
    alone = [asyncio.run(engine.generate([p], [sp]))[0] for p, sp in zip(prompts, params)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    for a, b in zip(together, alone):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    again = asyncio.run(engine.generate(prompts, params))
    assert [o.token_ids for o in again] == [o.token_ids for o in together]
    other = asyncio.run(engine.generate(prompts, [SamplingParams(max_new_tokens=8, temperature=1.0, seed=99)] * 3))
    assert [o.token_ids for o in other] != [o.token_ids for o in together]


def test_logprobs_match_the_trainer_at_the_sampling_temperature(engine_and_tok):
    from rlhforge.models.forward import token_logprobs

    engine, tok = engine_and_tok
    prompts = _prompts(tok, ["What is 3 + 4?", "x"])
    outs = asyncio.run(engine.generate(prompts, [SamplingParams(max_new_tokens=6, temperature=0.7, seed=1)] * 2))
    for p, o in zip(prompts, outs):
        assert len(o.token_ids) == len(o.logprobs) and o.finish_reason in ("stop", "length")
        ids = torch.tensor([p + o.token_ids])
        lp = token_logprobs(engine.model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, 0.7)
        assert lp[0, len(p):].tolist() == pytest.approx(o.logprobs, abs=1e-4)


def test_stop_tokens_lengths_and_greedy(engine_and_tok):
    engine, tok = engine_and_tok
    prompts = _prompts(tok, ["What is 1 + 2?"])
    greedy = asyncio.run(engine.generate(prompts, [SamplingParams(max_new_tokens=5, temperature=0.0)]))[0]
    assert len(greedy.token_ids) <= 5
    stop_at = greedy.token_ids[1]
    stopped = asyncio.run(engine.generate(prompts, [SamplingParams(max_new_tokens=5, temperature=0.0,
                                                                   stop_token_ids=(stop_at,))]))[0]
    first = greedy.token_ids.index(stop_at)
    assert stopped.token_ids == greedy.token_ids[: first + 1] and stopped.finish_reason == "stop"
    if greedy.finish_reason == "length":
        assert len(greedy.token_ids) == 5


def test_top_k_top_p_filtering():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert torch.isinf(filter_logits(logits, 1.0, 2)[2:]).all() and not torch.isinf(filter_logits(logits, 1.0, 2)[:2]).any()
    kept = ~torch.isinf(filter_logits(logits, 0.5, -1))
    assert kept.tolist() == [True, False, False, False]  # p(top) = 0.64 >= 0.5


def test_update_weights_changes_the_engine(engine_and_tok, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    engine, tok = engine_and_tok
    new = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.5)
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    engine.update_weights(new.state_dict())
    assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in new.state_dict().items())
    with pytest.raises(ValueError, match="unexpected"):
        engine.update_weights({"nope": torch.zeros(1)})
    engine.update_weights(original)


def test_mixed_batch_seeds_greedy_and_logprobs(engine_and_tok):
    """One batch mixing greedy, temperatures, top-k/top-p and lengths (rows leave the batch at different
    steps): every request equals its run alone, in another order and another batch size, and its
    log-probs equal log_softmax(logits / T) of a separate forward."""
    from rlhforge.models.forward import token_logprobs

    engine, tok = engine_and_tok
    prompts = _prompts(tok, ["What is 1 + 2?", "Reverse: abc", "hi", "Count to five", "2 * 3 =", "ok"])
    params = [SamplingParams(max_new_tokens=9, temperature=1.0, seed=5),
              SamplingParams(max_new_tokens=3, temperature=0.0),
              SamplingParams(max_new_tokens=7, temperature=0.6, top_k=5, seed=6),
              SamplingParams(max_new_tokens=9, temperature=1.3, top_p=0.8, seed=7),
              SamplingParams(max_new_tokens=1, temperature=1.0, seed=8),
              SamplingParams(max_new_tokens=9, temperature=0.9, top_p=0.9, top_k=20, seed=9)]
    big = HFEngine(engine.model, pad_token_id=engine.pad_token_id, eos_token_id=list(engine.eos_token_ids), batch_size=8)
    together = big.generate_sync(prompts, params)
    order = [3, 0, 5, 1, 4, 2]
    shuffled = big.generate_sync([prompts[i] for i in order], [params[i] for i in order])
    for j, i in enumerate(order):
        assert shuffled[j].token_ids == together[i].token_ids
    for p, sp, o in zip(prompts, params, together):
        alone = big.generate_sync([p], [sp])[0]
        assert alone.token_ids == o.token_ids and alone.finish_reason == o.finish_reason
        assert 1 <= len(o.token_ids) <= sp.max_new_tokens
        ids = torch.tensor([p + o.token_ids])
        with torch.no_grad():
            lp = token_logprobs(engine.model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                                sp.temperature if sp.temperature > 0 else 1.0)
        torch.testing.assert_close(lp[0, len(p):], torch.tensor(o.logprobs), atol=1e-5, rtol=0)


def test_greedy_equals_transformers_generate(engine_and_tok):
    engine, tok = engine_and_tok
    prompts = _prompts(tok, ["What is 1 + 2?", "Reverse the letters: abc please", "hi"])
    outs = engine.generate_sync(prompts, SamplingParams(max_new_tokens=8, temperature=0.0))
    for p, o in zip(prompts, outs):
        ref = engine.model.generate(input_ids=torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                    max_new_tokens=8, do_sample=False, pad_token_id=engine.pad_token_id,
                                    eos_token_id=list(engine.eos_token_ids))[0, len(p):].tolist()
        assert o.token_ids == ref


def test_unseeded_requests_follow_the_global_rng(engine_and_tok):
    engine, tok = engine_and_tok
    prompts = _prompts(tok, ["hi", "ok"])
    sp = SamplingParams(max_new_tokens=6, temperature=1.0)
    torch.manual_seed(3)
    a = engine.generate_sync(prompts, sp)
    torch.manual_seed(3)
    b = engine.generate_sync(prompts, sp)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
