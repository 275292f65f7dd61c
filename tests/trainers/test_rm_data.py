"""Preference data: plain, conversational and implicit-prompt pairs, key mapping, margins,
truncation, errors naming file/record/field, the built-in generator and pair collation."""

from __future__ import annotations

import json

import pytest
import torch

from rlhforge.data.errors import DataError
from rlhforge.data.loading import load_dataset_spec
from rlhforge.data.preference import build_preference_samples, collate_pairs


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def response_text(tok, ids, mask):
    return tok.decode([t for t, m in zip(ids, mask) if m])


def test_plain_pairs_with_input_template(tok):
    records = [{"prompt": "What is 2 + 3?", "chosen": "5", "rejected": "I am not sure, maybe 7."}]
    (s,) = build_preference_samples(records, tok, prompt_key="prompt", input_template="Q: {}\nA: ")
    prompt_ids = tok("Q: What is 2 + 3?\nA: ").input_ids
    eos = tok.eos_token_id
    assert s.chosen_ids == prompt_ids + tok("5", add_special_tokens=False).input_ids + [eos]
    assert s.chosen_mask == [0] * len(prompt_ids) + [1] * (len(s.chosen_ids) - len(prompt_ids))
    assert response_text(tok, s.rejected_ids, s.rejected_mask) == "I am not sure, maybe 7.<|im_end|>"
    assert s.rejected_ids[: len(prompt_ids)] == prompt_ids and s.prompt_len == len(prompt_ids)
    assert s.margin == 0.0 and len(s) == len(s.chosen_ids) + len(s.rejected_ids)


def test_plain_pairs_without_prompt_train_on_the_whole_text(tok):
    (s,) = build_preference_samples([{"chosen": "good answer", "rejected": "bad answer"}], tok)
    assert s.chosen_ids == tok("good answer").input_ids + [tok.eos_token_id]
    assert s.chosen_mask == [0] + [1] * (len(s.chosen_ids) - 1)


def test_explicit_and_implicit_prompt_conversations_agree(tok):
    ds = load_dataset_spec("builtin:arithmetic_preference?n=6")
    explicit = build_preference_samples(ds, tok, prompt_key="prompt", apply_chat_template=True)
    implicit = build_preference_samples(ds, tok, chosen_key="chosen_messages", rejected_key="rejected_messages",
                                        apply_chat_template=True)
    listed = [{"prompt": [{"role": "user", "content": r["prompt"]}],
               "chosen": [{"role": "assistant", "content": r["chosen"]}],
               "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in ds]
    as_lists = build_preference_samples(listed, tok, prompt_key="prompt", apply_chat_template=True)
    for record, a, b, c in zip(ds, explicit, implicit, as_lists):
        assert (a.chosen_ids, a.chosen_mask, a.rejected_ids, a.rejected_mask) == \
               (b.chosen_ids, b.chosen_mask, b.rejected_ids, b.rejected_mask) == \
               (c.chosen_ids, c.chosen_mask, c.rejected_ids, c.rejected_mask)
        # targets: the reply and its end-of-turn token; the sequence ends there (reward read at EOS)
        assert response_text(tok, a.chosen_ids, a.chosen_mask) == record["chosen"] + "<|im_end|>"
        assert a.chosen_ids[-1] == a.rejected_ids[-1] == tok.eos_token_id
        assert tok.decode(a.chosen_ids[: a.prompt_len]).endswith("<|im_start|>assistant\n")


def test_multi_turn_implicit_prompt_uses_the_common_prefix(tok):
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "add 2 and 2"}]
    record = {"chosen": conv + [{"role": "assistant", "content": "4"}],
              "rejected": conv + [{"role": "assistant", "content": "no idea"}]}
    (s,) = build_preference_samples([record], tok, apply_chat_template=True)
    assert response_text(tok, s.chosen_ids, s.chosen_mask) == "4<|im_end|>"  # the earlier assistant turn is prompt
    assert response_text(tok, s.rejected_ids, s.rejected_mask) == "no idea<|im_end|>"


def test_key_mapping_and_margins(tok):
    records = [{"question": "q1", "good": "a", "bad": "b", "m": 2}, {"question": "q2", "good": "c", "bad": "d", "m": 0.5}]
    samples = build_preference_samples(records, tok, prompt_key="question", chosen_key="good", rejected_key="bad",
                                       margin_key="m", use_margin=True)
    assert [s.margin for s in samples] == [2.0, 0.5]
    with pytest.raises(DataError, match=r"<dataset>, record 1, field 'm'.*number"):
        build_preference_samples([records[0], {**records[1], "m": "big"}], tok, prompt_key="question",
                                 chosen_key="good", rejected_key="bad", margin_key="m", use_margin=True)
    # without use_margin the field is not needed
    assert build_preference_samples([{"chosen": "a", "rejected": "b"}], tok)[0].margin == 0.0


def test_bad_records_name_file_record_and_field(tok, tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = [{"prompt": "p", "chosen": "a", "rejected": "b"}, {"prompt": "p", "chosen": "a", "rejected": ""}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    ds = load_dataset_spec(str(path))
    with pytest.raises(DataError, match=r"pairs.jsonl, record 1, field 'rejected': is an empty string"):
        build_preference_samples(ds, tok, prompt_key="prompt")
    with pytest.raises(DataError, match=r"record 0, field 'answer': is missing .*record has: prompt, chosen, rejected"):
        build_preference_samples(ds, tok, prompt_key="prompt", chosen_key="answer")
    with pytest.raises(DataError, match=r"field 'chosen'.*whole conversations"):
        build_preference_samples(ds, tok, apply_chat_template=True)  # strings but no prompt_key
    same = [{"chosen": [{"role": "user", "content": "x"}], "rejected": [{"role": "user", "content": "x"}]}]
    with pytest.raises(DataError, match="record 0, field 'chosen': chosen and rejected are the same"):
        build_preference_samples(same, tok, apply_chat_template=True)
    no_reply = [{"prompt": "x", "chosen": [{"role": "user", "content": "y"}], "rejected": "z"}]
    with pytest.raises(DataError, match="field 'chosen': has no assistant message"):
        build_preference_samples(no_reply, tok, prompt_key="prompt", apply_chat_template=True)


def test_truncation_keeps_eos_for_reward_models_and_drops_empty_pairs(tok, caplog):
    long = " ".join(["word"] * 40)
    records = [{"prompt": "short", "chosen": long, "rejected": "no"}, {"prompt": long, "chosen": "a", "rejected": "b"}]
    rm = build_preference_samples(records, tok, prompt_key="prompt", max_len=12, force_eos=True)
    assert len(rm) == 1  # the second pair's responses lie beyond max_len
    assert len(rm[0].chosen_ids) == 12 and rm[0].chosen_ids[-1] == tok.eos_token_id
    dpo = build_preference_samples(records[:1], tok, prompt_key="prompt", max_len=12)
    assert dpo[0].chosen_ids[-1] != tok.eos_token_id  # DPO never trains on a fake EOS
    with pytest.raises(DataError, match="all 1 preference pairs"):
        build_preference_samples(records[1:], tok, prompt_key="prompt", max_len=12)


def test_builtin_preference_generator_is_deterministic_and_splits_are_disjoint():
    a = load_dataset_spec("builtin:arithmetic_preference?n=200&seed=3")
    b = load_dataset_spec("builtin:arithmetic_preference?n=200&seed=3")
    test = load_dataset_spec("builtin:arithmetic_preference?n=50@test")
    assert a.to_list() == b.to_list()
    assert not {r["prompt"] for r in a} & {r["prompt"] for r in test}
    for r in a:
        assert r["answer"] in r["chosen"] and r["chosen"] != r["rejected"] and r["margin"] == 1.0
    hard = load_dataset_spec("builtin:arithmetic_preference?n=200&hard=100")
    assert {r["margin"] for r in hard} == {0.5}
    with pytest.raises(DataError, match="unknown parameter 'bogus'.*allowed: hard, max, n, seed"):
        load_dataset_spec("builtin:arithmetic_preference?bogus=1")


@pytest.mark.parametrize("packed", [False, True])
def test_collate_pairs_puts_chosen_first(tok, packed):
    records = [{"prompt": "p", "chosen": "a b c", "rejected": "d"}, {"prompt": "q", "chosen": "e", "rejected": "f g"}]
    samples = build_preference_samples(records, tok, prompt_key="prompt", use_margin=False)
    batch = collate_pairs(samples, tok.pad_token_id, packed=packed)
    assert batch["num_pairs"] == 2 and batch["margin"].tolist() == [0.0, 0.0]
    order = [samples[0].chosen_ids, samples[1].chosen_ids, samples[0].rejected_ids, samples[1].rejected_ids]
    if packed:
        assert batch["seq_lens"] == [len(o) for o in order]
        assert batch["input_ids"][0].tolist() == [t for o in order for t in o]
    else:
        for row, ids in zip(batch["input_ids"], order):
            assert row[: len(ids)].tolist() == ids
        assert torch.equal(batch["attention_mask"].sum(-1), torch.tensor([len(o) for o in order]))
