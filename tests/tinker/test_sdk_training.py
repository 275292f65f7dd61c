"""The tinker SDK's TrainingClient against ``rlhforge serve-tinker`` on the tiny model: the loss falls, the
importance-sampling gradient is the formula's, and a run resumed on a new server equals the run straight through."""

from __future__ import annotations

import math

import pytest
import torch

from tests.tinker.conftest import datum, token_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = ["the cat sat on the mat and looked at the dog", "one two three four five six seven eight nine",
         "a b c d e f g h i j k l m n o p", "red green blue yellow red green blue yellow"]


def test_cross_entropy_loss_falls(tinker, start_server, service_client):
    from tinker import types

    server = start_server()
    tc = service_client(server).create_lora_training_client(base_model="tiny", rank=8, seed=0).result()
    info = tc.get_info()
    assert info.lora_rank == 8 and info.model_data.model_name == "tiny"
    tok = tc.get_tokenizer()
    data = [datum(tinker, token_ids(tok, t)) for t in TEXTS]
    n_tokens = sum(len(d.loss_fn_inputs["target_tokens"].data) for d in data)
    losses = []
    for _ in range(8):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=5e-3))
        out = fb.result()
        opt.result()
        losses.append(out.metrics["loss:sum"])
        # loss:sum is -sum(weights * logprobs) of the per-token log-probs the server sends back
        lp = sum(float(o["logprobs"].to_torch().sum()) for o in out.loss_fn_outputs)
        assert out.metrics["loss:sum"] == pytest.approx(-lp, rel=1e-5)
    assert losses[0] / n_tokens > math.log(100)  # an untrained 1k-vocabulary model
    assert losses[-1] < 0.6 * losses[0], losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


def _server_module(server, model_id):
    return server.app.state.tinker.models[model_id].trained.module


def test_importance_sampling_gradient_matches_formula(tinker, start_server, service_client, tiny_model_dir):
    """The gradient the server accumulates for importance_sampling equals autograd of
    -sum(exp(logp - q) * A) on an independent copy of the same weights (plain HF forward + log_softmax)."""
    from peft import get_peft_model, LoraConfig
    from transformers import AutoModelForCausalLM
    from tinker import types

    server = start_server()
    tc = service_client(server).create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    tok = tc.get_tokenizer()
    ids = [token_ids(tok, t) for t in TEXTS[:2]]
    # one step first, so LoRA B is not zero and every adapter weight has a gradient
    tc.forward_backward([datum(tinker, i) for i in ids], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()

    g = torch.Generator().manual_seed(0)
    q = [(-3.0 - torch.rand(len(i) - 1, generator=g)).tolist() for i in ids]
    adv = [torch.randn(len(i) - 1, generator=g).tolist() for i in ids]
    data = [datum(tinker, i, logprobs=qq, advantages=a) for i, qq, a in zip(ids, q, adv)]
    out = tc.forward_backward(data, "importance_sampling").result()

    served = _server_module(server, tc.model_id)
    grads = {n: p.grad.clone() for n, p in served.named_parameters() if p.requires_grad}
    assert grads and all(g_.abs().sum() > 0 for g_ in grads.values())

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    targets = [n.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for n in grads if "lora_A" in n]
    ref = get_peft_model(base, LoraConfig(r=4, lora_alpha=32, target_modules=targets))
    ref.load_state_dict({n: p.detach() for n, p in served.named_parameters()}, strict=False)
    total = 0.0
    for i, qq, a in zip(ids, q, adv):
        logits = ref(input_ids=torch.tensor([i[:-1]])).logits[0]
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(i[1:])[:, None])[:, 0]
        loss = -(torch.exp(logp - torch.tensor(qq)) * torch.tensor(a)).sum()
        loss.backward()
        total += float(loss.detach())
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-5, abs=1e-5)
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert set(ref_grads) == set(grads)
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)


def _train(tinker, tc, steps):
    from tinker import types

    tok = tc.get_tokenizer()
    losses = []
    for s in steps:
        d = [datum(tinker, token_ids(tok, TEXTS[s % 4])), datum(tinker, token_ids(tok, TEXTS[(s + 1) % 4]))]
        fb = tc.forward_backward(d, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=3e-3, weight_decay=0.01, grad_clip_norm=1.0))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    probe = tc.forward([datum(tinker, token_ids(tok, TEXTS[0]))], "cross_entropy").result()
    return losses, probe.loss_fn_outputs[0]["logprobs"].to_torch()


def test_resume_on_a_new_server_equals_straight_run(tinker, start_server, service_client):
    straight_server = start_server()
    tc = service_client(straight_server).create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    straight, straight_lp = _train(tinker, tc, range(4))

    first = start_server()
    tc = service_client(first).create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    before, _ = _train(tinker, tc, range(2))
    path = tc.save_state("half").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/half")
    first.stop()

    second = start_server()  # a new server instance: nothing in memory, the checkpoint on disk
    tc2 = service_client(second).create_training_client_from_state_with_optimizer(path).result()
    after, resumed_lp = _train(tinker, tc2, range(2, 4))
    torch.testing.assert_close(torch.tensor(before + after), torch.tensor(straight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(resumed_lp, straight_lp, rtol=1e-5, atol=1e-5)
    assert straight[-1] < straight[0]
