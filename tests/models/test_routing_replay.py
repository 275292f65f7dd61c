"""MoE routing record and replay (rlhforge.models.routing, --train.routing_replay)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from rlhforge.workers.experience import ExperienceSample, collate_experience
from rlhforge.models.forward import token_logprobs
from rlhforge.models.routing import check_replayable, record_routing, replay_routing, routers
from rlhforge.rollout.engine import SamplingParams
from rlhforge.rollout.hf_engine import HFEngine

_SIZES = dict(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32, num_experts_per_tok=2)


def _qwen3_moe(norm_topk_prob=True):
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(**_SIZES, moe_intermediate_size=32, num_experts=4, norm_topk_prob=norm_topk_prob)
    return Qwen3MoeForCausalLM(cfg).eval()


def _mixtral():
    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(**_SIZES, num_local_experts=4)).eval()


MODELS = {"qwen3_moe": _qwen3_moe, "qwen3_moe_unnormalised": lambda: _qwen3_moe(False), "mixtral": _mixtral}


def test_routers_found_in_layer_order_and_none_in_a_dense_model():
    model = _qwen3_moe()
    assert routers(model) == [layer.mlp.gate for layer in model.model.layers]
    dense = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    assert routers(dense) == []
    with pytest.raises(ValueError, match="no MoE router"):
        check_replayable(dense, torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize("name", list(MODELS))
def test_replay_forces_the_given_experts_with_the_routers_own_gate_values(name):
    model = MODELS[name]()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    check_replayable(model, ids)  # replaying its own routing reproduces the logits bit for bit
    with record_routing(model) as rec:
        model(input_ids=ids, use_cache=False)
    own = rec.last().long()
    assert own.shape == (14, 2, 2)
    asked = (own + 1) % 4  # other experts for every token (top-2 of 4 stays two distinct experts)
    asked[3] = -1  # a token without a record routes freely
    seen = {}

    def spy(layer):
        def hook(_m, inputs, output):
            seen[layer] = (inputs[0].detach(), output)
        return hook

    with replay_routing(model, asked.to(torch.int16)):
        handles = [r.register_forward_hook(spy(i)) for i, r in enumerate(routers(model))]
        model(input_ids=ids, use_cache=False)
        for h in handles:
            h.remove()
    for layer, router in enumerate(routers(model)):
        hidden, (logits, scores, idx) = seen[layer]
        want = asked[:, layer].clone()
        want[3] = own[3, layer]
        assert torch.equal(idx.long(), want)
        # gate values: the router's own softmax at the replayed experts (renormalised when the family does)
        probs = torch.softmax((hidden.reshape(-1, 64) @ router.weight.T).float(), -1)
        gate = probs.gather(-1, want)
        if name != "qwen3_moe_unnormalised":
            gate = gate / gate.sum(-1, keepdim=True)
        torch.testing.assert_close(scores.float(), gate, rtol=1e-6, atol=1e-7)


def test_replay_lets_gradients_reach_the_router():
    model = _qwen3_moe().train()
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(2))
    with record_routing(model) as rec:
        model(input_ids=ids, use_cache=False)
    with replay_routing(model, (rec.last().long() + 1) % 4):
        model(input_ids=ids, use_cache=False).logits.square().mean().backward()
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers(model))


def test_hf_engine_records_the_routing_a_full_forward_computes():
    model = _qwen3_moe()
    engine = HFEngine(model, pad_token_id=0, eos_token_id=63, record_routing=True)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13]]  # different lengths: left padding in the prefill
    outs = engine.generate_sync(prompts, [SamplingParams(max_new_tokens=6, temperature=1.0, seed=i) for i in range(2)])
    for prompt, out in zip(prompts, outs):
        rec = out.extra["routed_experts"]
        total = len(prompt) + len(out.token_ids)
        assert rec.shape == (total, 2, 2) and rec.dtype == torch.int16
        assert (rec[-1] == -1).all()  # the last token was never fed back
        with record_routing(model) as full:
            model(input_ids=torch.tensor([prompt + out.token_ids]), use_cache=False)
        assert torch.equal(full.last()[:-1], rec[:-1])


def _samples(model, n=3):
    engine = HFEngine(model, pad_token_id=0, eos_token_id=63, record_routing=True)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]][:n]
    outs = engine.generate_sync(prompts, [SamplingParams(max_new_tokens=5, temperature=1.0, seed=i) for i in range(n)])
    samples = []
    for p, o in zip(prompts, outs):
        s = ExperienceSample(p + o.token_ids, [0] * len(p) + [1] * len(o.token_ids), 0.0, 0.0)
        s.routing = o.extra["routed_experts"].clone()
        samples.append(s)
    return samples


def test_replayed_logprobs_agree_padded_and_packed_and_follow_the_record():
    model = _qwen3_moe()
    samples = _samples(model)
    padded = collate_experience(samples, 0, packed=False, fields=(), routing=True)
    packed = collate_experience(samples, 0, packed=True, fields=(), routing=True)
    assert padded["routed_experts"].shape[:2] == padded["input_ids"].shape
    assert packed["routed_experts"].shape[:2] == packed["input_ids"].shape
    with torch.no_grad():
        free = token_logprobs(model, collate_experience(samples, 0, packed=False, fields=()))
        lp_pad = token_logprobs(model, padded)
        lp_pack = token_logprobs(model, packed)  # bounded rows: the record follows the row layout
    mask = padded["loss_mask"].bool()
    flat_pad = torch.cat([lp_pad[i, : len(s)] for i, s in enumerate(samples)])
    torch.testing.assert_close(flat_pad, lp_pack[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp_pad[mask], free[mask], rtol=1e-5, atol=1e-5)  # own routing: same numbers
    for s in samples:  # another routing: other log-probs
        s.routing = torch.where(s.routing >= 0, (s.routing + 1) % 4, s.routing)
    with torch.no_grad():
        moved = token_logprobs(model, collate_experience(samples, 0, packed=False, fields=(), routing=True))
    assert (moved[mask] - free[mask]).abs().max() > 1e-3
    # the reference's pass never replays: no routing without routing=True
    assert "routed_experts" not in collate_experience(samples, 0, packed=False, fields=())


def test_multi_turn_merge_keeps_the_earliest_record():
    from rlhforge.agents.episode import merge_routing

    first = torch.tensor([[[0, 1]], [[1, 2]], [[-1, -1]]], dtype=torch.int16)  # 3 tokens, last never fed
    second = torch.tensor([[[3, 2]], [[3, 2]], [[2, 3]], [[0, 3]], [[-1, -1]]], dtype=torch.int16)
    merged = merge_routing(first, second)
    assert merged.tolist() == [[[0, 1]], [[1, 2]], [[2, 3]], [[0, 3]], [[-1, -1]]]
    assert merge_routing(None, second) is second and merge_routing(first, None) is first
