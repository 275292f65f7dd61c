"""``rlhforge serve-tinker``'s ``cispo``, ``dro`` and ``gspo`` (issue 41 item 4): the gradient the server accumulates
through the real SDK equals autograd of Tinker's documented formula, written out here, on an independent copy of the
weights (plain HF forward + log_softmax); ``loss_fn_config`` keys are Tinker's, checked (400 naming the key).

Tinker's formulas (tinker-docs "Loss functions"; ``logp`` the learner's log-probs of ``target_tokens``, ``q`` the
sampler's ``logprobs``, ``A`` the ``advantages``, summed over tokens):

- cispo: ``-sum(sg(clamp(exp(logp - q), clip_low_threshold, clip_high_threshold)) * logp * A)``;
- dro:   ``-sum(logp * A - 0.5 * beta * (logp - q) ** 2)``;
- gspo (GSPO-token): ``log_s = mean((sg(logp) - q)[sequence_ratio_mask != 0])``, ``r = exp(log_s + logp - sg(logp))``,
  ``-sum(min(r * A, clamp(r, clip_low_threshold, clip_high_threshold) * A))`` over every token.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.tinker.conftest import KEY, datum, token_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = ["the cat sat on the mat and looked at the dog", "one two three four five six seven eight nine"]


def tinker_cispo(logp, q, adv, lo=0.8, hi=1.2):
    clipped = torch.clamp(torch.exp(logp - q), lo, hi)
    return -(clipped.detach() * logp * adv)


def tinker_dro(logp, q, adv, beta=0.05):
    return -(logp * adv - 0.5 * beta * (logp - q) ** 2)


def tinker_gspo(logp, q, adv, mask, lo=0.8, hi=1.2):
    log_ratio = (logp.detach() - q)[mask != 0].mean()
    ratio = torch.exp(log_ratio + logp - logp.detach())
    return -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)


@pytest.fixture(scope="module")
def server(start_server):
    return start_server()


@pytest.mark.parametrize("loss_fn, config", [
    ("cispo", None),                                                    # Tinker's defaults: 0.8 / 1.2
    ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}),
    ("dro", None),                                                      # beta 0.05
    ("dro", {"beta": 0.7}),
    ("gspo", None),                                                     # 0.8 / 1.2
    ("gspo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}),
])
def test_gradient_matches_tinker_formula(tinker, server, service_client, tiny_model_dir, loss_fn, config):
    from peft import LoraConfig, get_peft_model
    from tinker import types
    from transformers import AutoModelForCausalLM

    tc = service_client(server).create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    tok = tc.get_tokenizer()
    ids = [token_ids(tok, t) for t in TEXTS]
    # one step first, so LoRA B is not zero and every adapter weight has a gradient
    tc.forward_backward([datum(tinker, i) for i in ids], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()

    # the sampler's log-probs: the model's own, moved by up to +-0.6 nats, so r = exp(logp - q) spans
    # about [0.55, 1.8] and the CISPO clip binds on both sides; for gspo the first sequence is shifted up
    # and the second down by 0.5 nats (s ~ 1.65 and ~ 0.6: outside the thresholds), its ratio is taken
    # over the tokens after the first three, and the advantages of those three are not 0 (they still count)
    now = tc.forward([datum(tinker, i) for i in ids], "cross_entropy").result()
    g = torch.Generator().manual_seed(1)
    q, adv, masks = [], [], []
    for k, o in enumerate(now.loss_fn_outputs):
        lp = o["logprobs"].to_torch()
        shift = (0.5 if k == 0 else -0.5) if loss_fn == "gspo" else 0.0
        q.append((lp - shift + (torch.rand(len(lp), generator=g) * 1.2 - 0.6)).tolist())
        adv.append(torch.randn(len(lp), generator=g).tolist())
        masks.append([0.0] * 3 + [1.0] * (len(lp) - 3))
    extra = [{"sequence_ratio_mask": m} if loss_fn == "gspo" else {} for m in masks]
    data = [datum(tinker, i, logprobs=qq, advantages=a, **e) for i, qq, a, e in zip(ids, q, adv, extra)]
    out = tc.forward_backward(data, loss_fn, config).result()

    served = server.app.state.tinker.models[tc.model_id].trained.module
    grads = {n: p.grad.clone() for n, p in served.named_parameters() if p.requires_grad}
    assert grads and all(g_.abs().sum() > 0 for g_ in grads.values())

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    targets = [n.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for n in grads if "lora_A" in n]
    ref = get_peft_model(base, LoraConfig(r=4, lora_alpha=32, target_modules=targets))
    ref.load_state_dict({n: p.detach() for n, p in served.named_parameters()}, strict=False)
    total, clipped = 0.0, 0
    for k, (i, qq, a, mask) in enumerate(zip(ids, q, adv, masks)):
        logits = ref(input_ids=torch.tensor([i[:-1]])).logits[0]
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(i[1:])[:, None])[:, 0]
        qt, at = torch.tensor(qq), torch.tensor(a)
        lo, hi = (config or {}).get("clip_low_threshold", 0.8), (config or {}).get("clip_high_threshold", 1.2)
        if loss_fn == "cispo":
            per_token = tinker_cispo(logp, qt, at, lo, hi)
            r = torch.exp(logp.detach() - qt)
            clipped += int(((r < lo) | (r > hi)).sum())
        elif loss_fn == "gspo":
            mt = torch.tensor(mask)
            per_token = tinker_gspo(logp, qt, at, mt, lo, hi)
            s = torch.exp((logp.detach() - qt)[mt != 0].mean())
            clipped += int((s < lo) | (s > hi))
        else:
            per_token = tinker_dro(logp, qt, at, (config or {}).get("beta", 0.05))
        torch.testing.assert_close(out.loss_fn_outputs[k]["elementwise_loss"].to_torch(), per_token.detach(),
                                   rtol=1e-4, atol=1e-5)
        loss = per_token.sum()
        loss.backward()
        total += float(loss.detach())
    if loss_fn in ("cispo", "gspo"):
        assert clipped > 0  # the thresholds matter in this batch
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-5, abs=1e-5)
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert set(ref_grads) == set(grads)
    for n in grads:  # float32 sums over the batch: the absolute tolerance scales with the tensor's magnitude
        scale = float(ref_grads[n].abs().max().clamp_min(1.0))
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6 * scale, msg=n)


# -- refusals -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers={"X-API-Key": KEY}, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def model_id(http):
    session = http.post("/api/v1/create_session", json={"tags": [], "sdk_version": "test"}).json()["session_id"]
    fut = http.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": "tiny",
                                                  "lora_config": {"rank": 2}}).json()
    res = http.post("/api/v1/retrieve_future", json={"request_id": fut["request_id"]}).json()
    assert "error" not in res, res
    return fut["model_id"]


def _post(tinker, http, model_id, loss_fn, config, **more):
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    ids = [7, 11, 13, 17]
    d = datum(tinker, ids, logprobs=[-1.0] * 3, advantages=[1.0, -1.0, 0.5], **more)
    req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
        data=[d], loss_fn=loss_fn, loss_fn_config=config), model_id=model_id, seq_id=1000)
    body = forward_backward_request_to_proto(req).SerializeToString()
    return http.post("/api/v1/forward_backward", content=body, headers={"Content-Type": "application/x-protobuf"})


@pytest.mark.parametrize("loss_fn, config, field", [
    ("cispo", {"clip_low_threshold": -0.1}, "loss_fn_config.clip_low_threshold"),
    ("cispo", {"clip_low_threshold": 1.5}, "loss_fn_config.clip_low_threshold"),
    ("cispo", {"clip_high_threshold": 0.9}, "loss_fn_config.clip_high_threshold"),
    ("cispo", {"beta": 0.1}, "loss_fn_config.beta"),                       # dro's key, not cispo's
    ("cispo", {"clip_high_threshold": "wide"}, "loss_fn_config.clip_high_threshold"),
    ("dro", {"beta": -0.01}, "loss_fn_config.beta"),
    ("dro", {"beta": float("inf")}, "loss_fn_config.beta"),
    ("dro", {"clip_low_threshold": 0.8}, "loss_fn_config.clip_low_threshold"),
    ("gspo", {"clip_low_threshold": 0.0}, "loss_fn_config.clip_low_threshold"),
    ("gspo", {"beta": 0.05}, "loss_fn_config.beta"),
])
def test_bad_loss_fn_config_names_the_key(tinker, http, model_id, loss_fn, config, field):
    more = {"sequence_ratio_mask": [1.0] * 3} if loss_fn == "gspo" else {}
    r = _post(tinker, http, model_id, loss_fn, config, **more)
    assert r.status_code == 400, r.text
    assert r.json()["detail"].startswith(field + ":"), r.json()


def test_gspo_mask_must_mark_a_token(tinker, http, model_id):
    r = _post(tinker, http, model_id, "gspo", None, sequence_ratio_mask=[0.0] * 3)
    assert r.status_code == 400 and r.json()["detail"].startswith(
        "data[0].loss_fn_inputs.sequence_ratio_mask: marks no token"), r.text
    r = _post(tinker, http, model_id, "gspo", None)
    assert r.status_code == 400 and r.json()["detail"].startswith(
        "data[0].loss_fn_inputs.sequence_ratio_mask: missing"), r.text


@pytest.mark.parametrize("loss_fn", ["not_a_loss", "stable_reinforce"])
def test_refused_loss_fn_names_the_allowed_ones(tinker, http, model_id, loss_fn):
    r = _post(tinker, http, model_id, loss_fn, None)
    assert r.status_code == 400, r.text
    detail = r.json()["detail"]
    assert detail.startswith(f"loss_fn: {loss_fn!r}: ")
    assert detail.endswith("supported: cross_entropy, importance_sampling, ppo, cispo, dro, gspo"), detail
