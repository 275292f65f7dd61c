"""SFT tokenisation: the loss mask covers exactly the response / assistant tokens."""

from __future__ import annotations

import json
import logging

import pytest

from rlhforge.data.errors import DataError
from rlhforge.data.loading import load_dataset_spec
from rlhforge.data.sft import build_sft_samples
from rlhforge.models.tiny import CHATML_TEMPLATE


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def masked_text(tok, sample):
    return tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])


def masked_spans(tok, sample):
    spans, cur = [], []
    for t, m in zip(sample.input_ids, sample.loss_mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(tok.decode(cur))
            cur = []
    if cur:
        spans.append(tok.decode(cur))
    return spans


def test_plain_prompt_response_with_input_template(tok):
    records = [{"input": "What is 2 + 3?", "output": "5"}, {"input": "Reverse: abc", "output": "cba"}]
    samples = build_sft_samples(records, tok, input_key="input", output_key="output", input_template="Q: {}\nA: ")
    for record, s in zip(records, samples):
        prompt_ids = tok(f"Q: {record['input']}\nA: ").input_ids
        response_ids = tok(record["output"], add_special_tokens=False).input_ids
        assert s.input_ids == prompt_ids + response_ids + [tok.eos_token_id]
        assert s.loss_mask == [0] * len(prompt_ids) + [1] * (len(response_ids) + 1)
        assert masked_text(tok, s) == record["output"] + "<|im_end|>"
    assert samples[1].source == "<dataset>" and samples[1].index == 1


def test_trl_prompt_completion_via_key_mapping_and_chat_template(tok):
    ds = load_dataset_spec("builtin:arithmetic?n=8")
    plain = build_sft_samples(ds, tok, input_key="prompt", output_key="completion")
    chat = build_sft_samples(ds, tok, input_key="prompt", output_key="completion", apply_chat_template=True)
    msgs = build_sft_samples(ds, tok, input_key="messages", apply_chat_template=True)
    for record, p, c, m in zip(ds, plain, chat, msgs):
        assert masked_text(tok, p) == record["completion"] + "<|im_end|>"
        assert masked_text(tok, c) == record["completion"] + "<|im_end|>"
        # {"messages"} and {"prompt","completion"} give the same tokens through the template
        assert c.input_ids == m.input_ids and c.loss_mask == m.loss_mask
        rendered = tok.apply_chat_template(record["messages"], tokenize=False)
        assert c.input_ids == tok(rendered, add_special_tokens=False).input_ids
        assert c.loss_mask[0] == 0 and p.loss_mask[0] == 0
        assert (c.source, c.index) == (record["_source"], record["_index"])


CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 1 + 2?"},
    {"role": "assistant", "content": "3"},
    {"role": "user", "content": "and 2 + 2"},
    {"role": "assistant", "content": "four, I think"},
]


def test_multiturn_masks_exactly_the_assistant_turns(tok):
    [multi] = build_sft_samples([{"messages": CONVERSATION}], tok, input_key="messages",
                                apply_chat_template=True, multiturn=True)
    assert masked_spans(tok, multi) == ["3<|im_end|>", "four, I think<|im_end|>"]
    [last] = build_sft_samples([{"messages": CONVERSATION}], tok, input_key="messages", apply_chat_template=True)
    assert masked_spans(tok, last) == ["four, I think<|im_end|>"]
    assert last.input_ids == multi.input_ids


def test_prefix_rendering_matches_generation_markers(tok):
    """A template without {% generation %} falls back to prefix rendering; same masks on ChatML."""
    plain_template = CHATML_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert plain_template != CHATML_TEMPLATE
    original = tok.chat_template
    kwargs = dict(input_key="messages", apply_chat_template=True, multiturn=True)
    try:
        marked = build_sft_samples([{"messages": CONVERSATION}], tok, **kwargs)
        tok.chat_template = plain_template
        prefix = build_sft_samples([{"messages": CONVERSATION}], tok, **kwargs)
        tok.chat_template = "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m.content }}\n{% endfor %}"
        with pytest.raises(DataError, match=r"<dataset>, record 0, field 'messages': .*not prefix-preserving"):
            build_sft_samples([{"messages": CONVERSATION}], tok, **kwargs)
    finally:
        tok.chat_template = original
    assert prefix[0].input_ids == marked[0].input_ids
    assert prefix[0].loss_mask == marked[0].loss_mask


def test_pretrain_mode_trains_on_all_but_the_first_token(tok):
    [s] = build_sft_samples([{"text": "hello world, this is text"}], tok, input_key="text", pretrain_mode=True)
    assert s.input_ids == tok("hello world, this is text").input_ids + [tok.eos_token_id]
    assert s.loss_mask == [0] + [1] * (len(s.input_ids) - 1)


def test_truncation_keeps_the_start_and_drops_samples_without_targets(tok, caplog):
    records = [{"input": "short", "output": "a fairly long answer that will be cut"},
               {"input": "a much longer prompt " * 4, "output": "x"}]
    full = build_sft_samples(records, tok, output_key="output", max_len=4096)
    prompt_len = full[0].loss_mask.index(1)
    max_len = prompt_len + 3
    assert len(full[1]) > max_len and full[1].loss_mask.index(1) >= max_len
    with caplog.at_level(logging.WARNING, logger="rlhforge.data.sft"):
        cut = build_sft_samples(records, tok, output_key="output", max_len=max_len)
    assert len(cut) == 1 and cut[0].index == 0
    assert cut[0].input_ids == full[0].input_ids[:max_len] and cut[0].loss_mask == full[0].loss_mask[:max_len]
    assert sum(cut[0].loss_mask) == 3
    assert "dropped 1 of 2 SFT samples" in caplog.text and "record 1" in caplog.text
    with pytest.raises(DataError, match=r"all 1 SFT samples have their response beyond max_len"):
        build_sft_samples(records[1:], tok, output_key="output", max_len=max_len)


def test_bad_records_name_file_record_and_field(tmp_path, tok):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"input": "ok", "output": "fine"},
        {"input": "n", "output": 5},
    ]) + "\n")
    ds = load_dataset_spec(str(path))
    with pytest.raises(DataError, match=rf"{path}, record 1, field 'output': expected a string, got int \(5\)") as err:
        build_sft_samples(ds, tok, output_key="output")
    assert (err.value.source, err.value.index, err.value.field) == (str(path), 1, "output")

    cases = [
        ({"input": "a"}, {}, r"record 0, field 'output': is missing \(record has: input\)"),
        ({"prompt": "a", "completion": "b"}, {}, r"field 'input': is missing .*input_key='prompt', output_key='completion'"),
        ({"input": "a", "output": "  "}, {}, r"field 'output': is an empty string"),
        ({"input": ["a"], "output": "b"}, {}, r"field 'input': expected a string, got list .*apply_chat_template"),
        ({"messages": "hi"}, dict(input_key="messages", output_key=None, apply_chat_template=True), r"'messages': is a single prompt string"),
        ({"messages": 7}, dict(input_key="messages", output_key=None, apply_chat_template=True), r"'messages': expected a list of .* messages \(or a string: one user message\), got int"),
        ({"messages": ["hi"]}, dict(input_key="messages", output_key=None, apply_chat_template=True), r"'messages\[0\]': expected a \{'role', 'content'\} dict"),
        ({"messages": [{"role": "user"}]}, dict(input_key="messages", output_key=None, apply_chat_template=True), r"'messages\[0\]': missing 'content'"),
        ({"messages": [{"role": "user", "content": "a"}]}, dict(input_key="messages", output_key=None, apply_chat_template=True), "no assistant message"),
        ({"messages": CONVERSATION[:4]}, dict(input_key="messages", output_key=None, apply_chat_template=True), r"'messages\[3\]': the last message must be the assistant's"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]},
         dict(input_key="messages", output_key=None, apply_chat_template=True), r"'messages\[1\]': the assistant reply is an empty string"),
        ({"input": "a", "output": "b"}, dict(output_key=None), "no output_key given"),
    ]
    for record, kwargs, message in cases:
        opts = {"output_key": "output", **kwargs}
        with pytest.raises(DataError, match=message):
            build_sft_samples([record], tok, **opts)


def test_input_template_without_placeholder_is_rejected(tok):
    with pytest.raises(ValueError, match=r"has no '\{\}' placeholder"):
        build_sft_samples([{"input": "a", "output": "b"}], tok, output_key="output", input_template="Q: A:")


def test_messages_from_jsonl_with_uneven_keys(tmp_path, tok):
    """Arrow fills keys absent from some messages with None; they must not reach the template."""
    path = tmp_path / "chat.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": "hi", "name": "bob"}, {"role": "assistant", "content": "hello"}]},
        {"messages": CONVERSATION},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ds = load_dataset_spec(str(path))
    assert ds[1]["messages"][0].get("name", "absent") in (None, "absent")
    samples = build_sft_samples(ds, tok, input_key="messages", apply_chat_template=True, multiturn=True)
    direct = build_sft_samples(rows, tok, input_key="messages", apply_chat_template=True, multiturn=True)
    assert [s.input_ids for s in samples] == [s.input_ids for s in direct]
    assert masked_spans(tok, samples[1]) == ["3<|im_end|>", "four, I think<|im_end|>"]
