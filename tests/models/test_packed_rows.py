"""Packed batches are computed in bounded rows: same log-probs, logits and gradients as padding."""

from __future__ import annotations

import pytest
import torch

from rlhforge.data.packing import collate_packed, collate_padded
from rlhforge.models.forward import packed_rows, token_logprobs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# 11 samples: the longest (20) bounds each row, so the micro-batch spans several rows
LENGTHS = [9, 20, 4, 13, 7, 20, 2, 11, 16, 5, 8]


def _samples(vocab: int, lengths=LENGTHS) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(4, vocab, (n,), generator=g).tolist(),
             "loss_mask": [0] * min(3, n - 1) + [1] * (n - min(3, n - 1))} for n in lengths]


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                attn_implementation=request.param).eval()


def test_row_layout():
    batch = collate_packed(_samples(100))
    rows = packed_rows(batch)
    n_rows, width = rows.input_ids.shape
    assert 1 < n_rows < len(LENGTHS) and width == max(LENGTHS)  # never wider than the padded batch
    flat_ids, flat_pos = rows.input_ids.reshape(-1), rows.position_ids.reshape(-1)
    assert torch.equal(flat_ids[rows.index], batch["input_ids"][0])
    assert torch.equal(flat_pos[rows.index], batch["position_ids"][0])
    pad = torch.ones(n_rows * width, dtype=torch.bool)
    pad[rows.index] = False
    assert (flat_pos[pad] == 0).all() and (flat_ids[pad] == 0).all()
    # every sample sits whole inside one row
    starts = torch.cumsum(torch.tensor([0] + LENGTHS[:-1]), 0)
    for s, n in zip(starts.tolist(), LENGTHS):
        where = rows.index[s : s + n]
        assert (where // width).unique().numel() == 1 and torch.equal(where - where[0], torch.arange(n))
    assert packed_rows(batch, row_tokens=sum(LENGTHS)) is None  # one row is enough: no layout


@pytest.mark.parametrize("layout", ["auto", "rows"])
def test_bounded_rows_equal_padded_logprobs_logits_and_gradients(model, layout):
    """"rows": the bounded rows; "auto": on sdpa, attention sample by sample in the one row (eager: rows)."""
    samples = _samples(model.config.vocab_size)
    padded, packed = collate_padded(samples, pad_id=0), collate_packed(samples)
    assert packed_rows(packed).input_ids.shape[0] > 1
    seen = []  # the token layout the layers compute on
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    results = []
    for batch in (padded, packed):
        model.zero_grad()
        lp, logits = token_logprobs(model, batch, 0.8, return_logits=True, packed_layout=layout)
        loss = -(lp * batch["loss_mask"]).sum() + 1e-3 * (logits.float() ** 2).mean()
        loss.backward()
        results.append((lp.detach(), logits.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    model.zero_grad()
    hook.remove()
    one_row = layout == "auto" and model.config._attn_implementation == "sdpa"
    assert seen[1] == ((1, sum(LENGTHS)) if one_row else tuple(packed_rows(packed).input_ids.shape))
    (lp_pad, logits_pad, g_pad), (lp_pack, logits_pack, g_pack) = results
    assert lp_pack.shape == (1, sum(LENGTHS)) and logits_pack.shape == (1, sum(LENGTHS), model.config.vocab_size)
    at = 0
    for i, n in enumerate(LENGTHS):
        torch.testing.assert_close(lp_pack[0, at : at + n], lp_pad[i, :n], atol=1e-5, rtol=0)
        torch.testing.assert_close(logits_pack[0, at : at + n], logits_pad[i, :n], atol=1e-5, rtol=0)
        at += n
    # the loss above weights the logits term by each layout's own mean: compare the log-prob part only
    for batch in (padded, packed):
        model.zero_grad()
        (-(token_logprobs(model, batch, 0.8, packed_layout=layout) * batch["loss_mask"]).sum()).backward()
        results.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    model.zero_grad()
    torch.testing.assert_close(results[3], results[2], atol=1e-5, rtol=1e-4)


def test_row_budget_does_not_change_results(model):
    batch = collate_packed(_samples(model.config.vocab_size))
    with torch.no_grad():
        bounded = token_logprobs(model, batch)
        one_row = token_logprobs(model, batch, row_tokens=sum(LENGTHS))
        wider = token_logprobs(model, batch, row_tokens=33)
        explicit = token_logprobs(model, batch, block_mask="explicit")
        rows = token_logprobs(model, batch, packed_layout="rows")
    for other in (one_row, wider, explicit, rows):
        torch.testing.assert_close(bounded, other, atol=1e-5, rtol=0)


def test_layout_from_position_resets_alone(model):
    """Without seq_lens/cu_seqlens the rows come from the position-id resets."""
    batch = collate_packed(_samples(model.config.vocab_size))
    bare = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    assert torch.equal(packed_rows(bare).index, packed_rows(batch).index)
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(model, bare), token_logprobs(model, batch), atol=0, rtol=0)


def test_segment_attention_applies_only_where_it_is_exact(tiny_model_dir, tmp_path):
    """Sample-by-sample attention: CPU sdpa with plain causal layers only; a sliding window, eager or
    gradient checkpointing keep the rows (a recomputed layer would not attend sample by sample)."""
    from transformers import AutoModelForCausalLM

    from rlhforge.models.segment_attention import segments_apply
    from rlhforge.models.tiny import build_tiny_model

    ids = torch.zeros(1, 8, dtype=torch.long)
    sdpa = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager")
    assert segments_apply(sdpa, ids) and not segments_apply(eager, ids)
    gemma = AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "g", arch="gemma3_text"),
                                                 dtype=torch.float32, attn_implementation="sdpa")
    assert not segments_apply(gemma, ids)  # sliding-window layers: their window lives in the mask
    sdpa.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert not segments_apply(sdpa, ids)
    sdpa.gradient_checkpointing_disable()
    assert segments_apply(sdpa, ids)


def test_segment_attention_leaves_the_model_as_it_was(model):
    """After the forward the model attends as before (sdpa/eager), and the samples never see each other."""
    before = model.config._attn_implementation
    batch = collate_packed(_samples(model.config.vocab_size))
    with torch.no_grad():
        together = token_logprobs(model, batch)
        first = token_logprobs(model, collate_packed(_samples(model.config.vocab_size)[:1]))
    assert model.config._attn_implementation == before
    torch.testing.assert_close(together[0, : LENGTHS[0]], first[0], atol=1e-5, rtol=0)


def test_pieces_are_one_split_with_the_slices_values():
    """Per-sample attention cuts q/k/v with one ``split`` (one backward node for all pieces; a slice per
    sample would add a zero-filled gradient of the whole row per sample), equal to the slices; bounds that
    do not cover the row are an error, not a shorter output."""
    from rlhforge.models.segment_attention import _pieces

    x = torch.randn(1, 2, 10, 3, requires_grad=True)
    cover = _pieces(x, [0, 4, 4, 9, 10])
    assert [p.shape[2] for p in cover] == [4, 0, 5, 1]
    assert {type(p.grad_fn).__name__ for p in cover} == {"SplitWithSizesBackward0"}
    for p, (a, b) in zip(cover, [(0, 4), (4, 4), (4, 9), (9, 10)]):
        assert torch.equal(p, x[:, :, a:b])
    sum(p.sum() * (k + 1) for k, p in enumerate(cover)).backward()
    assert x.grad[0, 0, :, 0].tolist() == [1.0] * 4 + [3.0] * 5 + [4.0]
    with pytest.raises(ValueError, match="must cover the row of 10 tokens"):
        _pieces(x, [2, 5, 7])


def test_low_precision_attention_runs_in_fp32_on_cpu():
    """Under bf16 autocast the per-sample and shared-prefix attention get mixed inputs (rotary embeddings
    promote queries and keys to fp32, values stay bf16); they attend in fp32 - CPU's bf16 SDPA kernels
    are slower - and return what autocast would have: bf16. Equal to fp32 SDPA of the same values per
    sample, and the gradients reach every input in its own dtype."""
    from rlhforge.models.segment_attention import _segment_sdpa

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 4, 9, 8, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 2, 9, 8, generator=g).bfloat16().requires_grad_()
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    k2 = k[:, :2]  # grouped-query: 4 query heads over 2 kv heads
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = _segment_sdpa(None, q, k2, v, None, cu_seq_lens_q=cu)
    assert out.dtype == torch.bfloat16 and out.shape == (1, 9, 4, 8)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    want = torch.cat([sdpa(q[:, :, a:b], k2[:, :, a:b], v.float()[:, :, a:b], is_causal=True, enable_gqa=True)
                      for a, b in ((0, 4), (4, 9))], dim=2).transpose(1, 2).bfloat16()
    assert torch.equal(out, want)
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and v.grad.dtype == torch.bfloat16 and k.grad[:, :2].abs().sum() > 0
    # without autocast, fp32 inputs go to the kernel as they are (fp32 out)
    out32, _ = _segment_sdpa(None, q.detach(), k2.detach(), v.detach().float(), None, cu_seq_lens_q=cu)
    assert out32.dtype == torch.float32 and torch.allclose(out32.bfloat16().float(), want.float(), atol=1e-2)


def test_padded_bf16_forwards_on_cpu_attend_in_fp32(tiny_model_dir):
    """A padded batch under bf16 autocast goes through the same fp32 attention (the block is entered for
    it, and left as it was): its log-probs agree with those of the batch's samples one at a time under
    autocast (no padding, the per-sample path) up to the bf16 matmuls' rounding."""
    from transformers import AutoModelForCausalLM

    from rlhforge.models.segment_attention import NAME, segment_attention

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()

    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (7, 11, 4)]
    batch = collate_padded([{"input_ids": s, "loss_mask": [1] * len(s)} for s in seqs], pad_id=0)
    seen = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        with segment_attention(model, kwargs):
            seen.append(model.config._attn_implementation_internal)
        padded = token_logprobs(model, batch)
        alone = [token_logprobs(model, collate_packed([{"input_ids": s, "loss_mask": [1] * len(s)}]))[0]
                 for s in seqs]
    assert seen == [NAME] and model.config._attn_implementation_internal == "sdpa"
    for row, mask, one in zip(padded, batch["attention_mask"].bool(), alone):
        assert torch.allclose(row[mask], one, atol=2e-2)  # bf16 matmuls of other shapes; attention alike
