"""The lm_head applied chunk by chunk (rlhforge.models.chunked_head): for every model family the
log-probs, the entropy and the gradients equal the full-logits path (the same token_logprobs with
``return_logits``, which keeps the head in the model), padded and packed, with chunks smaller than a
row; soft-capped models (gemma3_text) keep the full logits; no full-vocabulary tensor is made."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlhforge.algorithms.logprobs import entropy_from_logits
from rlhforge.models import chunked_head
from rlhforge.models.forward import prediction_mask, token_logprobs
from rlhforge.models.tiny import ARCHS, TinyModelSpec, build_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPEC = TinyModelSpec(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                     moe_intermediate_size=64, tie_word_embeddings=False)


@pytest.fixture(scope="module", params=ARCHS)
def family(request, tmp_path_factory):
    out = build_tiny_model(tmp_path_factory.mktemp(request.param) / "m", spec=SPEC, arch=request.param, seed=0)
    torch.manual_seed(0)
    return request.param, AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)


def _batches(vocab):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[2, 8:] = 0  # right padding
    padded = {"input_ids": ids * mask, "attention_mask": mask}
    lens = [5, 4, 6]
    packed = {"input_ids": torch.randint(3, vocab, (1, sum(lens)), generator=g),
              "position_ids": torch.cat([torch.arange(n) for n in lens])[None], "seq_lens": lens}
    return {"padded": padded, "packed": packed}


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_chunked_equals_full_logits_with_gradients(family, layout, monkeypatch):
    arch, model = family
    batch = _batches(model.config.vocab_size)[layout]
    capped = chunked_head.head_for(model) is None
    assert capped == (arch == "gemma3_text")  # Gemma's final-logit soft-cap keeps the full logits

    model.zero_grad()
    full, logits = token_logprobs(model, batch, 0.7, return_logits=True)
    predicted = prediction_mask(batch)[:, 1:].float()  # entropy is 0 where nothing is predicted, as log-probs
    ent_full = entropy_from_logits(logits[:, :-1], temperature=0.7) * predicted
    (full.sum() + 0.3 * ent_full.sum()).backward()
    g_full = _grads(model)

    monkeypatch.setattr(chunked_head, "CHUNK_ELEMENTS", model.config.vocab_size * 4)  # 16-row chunks
    model.zero_grad()
    made = []
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda m, i, o: made.append(tuple(o.shape)))
    try:
        lp, ent = token_logprobs(model, batch, 0.7, return_entropy=True)
    finally:
        hook.remove()
    (lp.sum() + 0.3 * ent[:, 1:].sum()).backward()
    g_chunk = _grads(model)

    torch.testing.assert_close(lp, full, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(ent[:, 1:], ent_full, atol=2e-6, rtol=1e-5)
    assert torch.all(ent[:, 0] == 0)
    assert g_chunk.keys() == g_full.keys()
    for name in g_full:
        torch.testing.assert_close(g_chunk[name], g_full[name], atol=2e-5, rtol=1e-4, msg=name)
    if not capped:  # the head ran on chunks of at most 16 positions, forward and recompute
        assert made and all(shape[0] <= 16 and len(shape) == 2 for shape in made)


def test_entropy_without_grad_and_no_grad_mode(family):
    arch, model = family
    batch = _batches(model.config.vocab_size)["padded"]
    lp, ent = token_logprobs(model, batch, 1.0, return_entropy=True, entropy_grad=False)
    assert lp.requires_grad and not ent.requires_grad
    with torch.no_grad():
        again = token_logprobs(model, batch, 1.0)
    torch.testing.assert_close(again, lp.detach())
    assert model.get_output_embeddings() is chunked_head.head_for(model)[0] if chunked_head.head_for(model) else True


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_needed_positions_only(family, layout):
    """``needed`` (RL's action mask): the head runs on those positions only; their log-probs, entropy and
    the gradients of a loss over them equal the all-positions path; every other position is 0."""
    arch, model = family
    batch = _batches(model.config.vocab_size)[layout]
    needed = torch.zeros_like(batch["input_ids"], dtype=torch.float32)
    needed[..., 5:9] = 1.0
    needed = needed * prediction_mask(batch).float()
    model.zero_grad()
    lp_all, ent_all = token_logprobs(model, batch, 0.7, return_entropy=True)
    ((lp_all * needed).sum() + 0.3 * (ent_all * needed).sum()).backward()
    g_all = _grads(model)
    model.zero_grad()
    rows = []
    hook = model.get_output_embeddings().register_forward_hook(lambda m, i, o: rows.append(o.shape[0]))
    try:
        lp, ent = token_logprobs(model, batch, 0.7, return_entropy=True, needed=needed)
    finally:
        hook.remove()
    (lp.sum() + 0.3 * ent.sum()).backward()
    g = _grads(model)
    torch.testing.assert_close(lp, lp_all * needed, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(ent, ent_all * needed, atol=2e-6, rtol=1e-5)
    assert torch.all(lp[needed == 0] == 0) and torch.all(ent[needed == 0] == 0)
    for name in g_all:
        torch.testing.assert_close(g[name], g_all[name], atol=2e-5, rtol=1e-4, msg=name)
    # only the needed positions went through the head (Mistral packed: its sliding-window config takes the
    # bounded-rows layout, where every position is computed and the others zeroed)
    if chunked_head.head_for(model) is not None and not (arch == "mistral" and layout == "packed"):
        assert rows and max(rows) == int(needed.sum())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize("keep", [True, False])
def test_fused_chunks_equal_the_checkpointed_ones(temperature, bias, dtype, entropy, keep, monkeypatch):
    """The plain head's log-prob with its hand-written backward (:class:`chunked_head._HeadLogprob`) gives the
    values and the hidden states' gradient of the checkpointed chunks' autograd graph bit for bit, fp32 and bf16
    weights; the weight's and bias's gradients too in one chunk, and over several chunks (accumulated in the
    matmul, ``addmm_``, instead of a gradient per chunk added by autograd) to the rounding of that sum; the
    entropy asked without its gradient (as the RL actor logs it) to rounding. Both with the probabilities kept
    from the forward (``keep``) and recomputed in the backward."""
    monkeypatch.setattr(chunked_head, "SAVED_PROBS_BYTES", 1 << 30 if keep else 0)
    torch.manual_seed(0)
    head = torch.nn.Linear(32, 997, bias=bias).to(dtype)
    hidden = torch.randn(45, 32, dtype=dtype)
    labels = torch.randint(0, 997, (45,))
    upstream = torch.randn(45)

    def run(chunk):
        head.zero_grad(set_to_none=True)
        h = hidden.clone().requires_grad_(True)
        lp, ent = chunked_head.head_logprobs(head, h, labels, temperature, chunk=chunk, entropy=entropy,
                                             entropy_grad=False)
        (lp * upstream).sum().backward()
        return lp.detach(), h.grad, head.weight.grad, (head.bias.grad if bias else None), ent

    assert chunked_head._plain_head(head, hidden)
    got = {chunk: run(chunk) for chunk in (16, 64)}  # the fused chunks: three, and one
    monkeypatch.setattr(chunked_head, "_plain_head", lambda *a: False)
    want = {chunk: run(chunk) for chunk in (16, 64)}  # the checkpointed chunks
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-3}
    for chunk in (16, 64):
        g, w = got[chunk], want[chunk]
        if entropy:
            assert not g[4].requires_grad and g[4].shape == (45,)
            torch.testing.assert_close(g[4], w[4], rtol=1e-5, atol=1e-5)
        else:
            assert g[4] is None and w[4] is None
        for i, (a, b) in enumerate(zip(g[:4], w[:4])):
            if b is None:
                continue
            assert a.dtype == b.dtype
            if i < 2 or chunk == 64:  # log-probs, the hidden states' gradient; every gradient of one chunk
                assert torch.equal(a, b), (chunk, i)
            else:
                torch.testing.assert_close(a, b, **tol)
        assert g[0].dtype == torch.float32 and g[2].abs().sum() > 0


def test_fused_chunk_is_kept_off_where_the_head_is_not_plain():
    """Entropy, autocast, hooks, a subclass of Linear or another dtype than the hidden states' keep the
    checkpointed chunk (which calls the head as a module)."""
    head = torch.nn.Linear(8, 50)
    hidden = torch.randn(4, 8)
    assert chunked_head._plain_head(head, hidden)
    assert not chunked_head._plain_head(head, hidden.bfloat16())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not chunked_head._plain_head(head, hidden)
    handle = head.register_forward_pre_hook(lambda *a: None)
    assert not chunked_head._plain_head(head, hidden)
    handle.remove()

    class Sub(torch.nn.Linear):
        pass

    assert not chunked_head._plain_head(Sub(8, 50), hidden)
    calls = []
    head.register_forward_hook(lambda *a: calls.append(1))
    lp, ent = chunked_head.head_logprobs(head, hidden.requires_grad_(True), torch.tensor([1, 2, 3, 4]), entropy=True)
    lp.sum().backward()
    assert ent is not None and calls  # the hooked head was called as a module (forward and recompute)


def test_chunks_are_even_and_bounded():
    """At most CHUNK_ELEMENTS logits a chunk, as few chunks as that allows, of near-equal sizes."""
    most = chunked_head.CHUNK_ELEMENTS // 151936
    assert chunked_head.chunk_rows(151936) == most
    assert chunked_head.chunk_rows(151936, positions=most) == most
    assert chunked_head.chunk_rows(151936, positions=most + 1) == -(-(most + 1) // 2)  # two near-equal chunks
    assert chunked_head.chunk_rows(151936, positions=512) == 171  # 3 chunks of 171, 171, 170 at 220 at most
    assert chunked_head.chunk_rows(1000, positions=5000) >= 5000  # a small vocabulary: one chunk
    assert chunked_head.chunk_rows(10**9) == 16  # the floor
