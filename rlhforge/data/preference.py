"""Preference pairs for reward models and DPO: chosen and rejected token ids plus response masks.

``build_preference_samples(dataset, tokenizer, ...)`` returns a plain ``list[PreferenceSample]``
(tokenised eagerly, once). Each side (chosen, rejected) is one sequence ``prompt + response``
ending with the EOS token; ``mask[t] = 1`` marks response token ``t`` (predicted from tokens
``< t``, the convention of :mod:`rlhforge.data.sft` and :func:`rlhforge.models.forward.token_logprobs`).
A reward model reads its reward at the last token of each sequence (the EOS); DPO sums the
log-probs of the masked tokens. :func:`collate_pairs` stacks chosen and rejected into one batch
(chosen first), so both run in one forward pass, padded or packed.

Formats (fields chosen by ``prompt_key``/``chosen_key``/``rejected_key``):

Plain text (``apply_chat_template=False``)
    ``{"prompt": str, "chosen": str, "rejected": str}``: the prompt (wrapped by ``input_template``
    if given) is encoded with the tokenizer's special tokens, each response without them, plus EOS
    (unless the response already ends with it). Without ``prompt_key`` each of chosen/rejected is a
    whole text: every token but the first is a target. (Shared leading tokens of chosen and rejected
    cancel in the DPO loss, so this gives the same DPO gradient as splitting off the prompt.)
Conversational, explicit prompt (``apply_chat_template=True``, ``prompt_key`` set)
    the prompt is a string (one user message) or a list of messages; chosen/rejected are a string
    (one assistant message) or a list of messages appended to the prompt (a list that repeats the
    prompt messages first is accepted too).
Conversational, implicit prompt (``apply_chat_template=True``, no ``prompt_key``)
    chosen/rejected are whole conversations; their common leading messages are the prompt.

With a chat template the conversation is rendered and tokenised whole
(:func:`rlhforge.data.templates.tokenize_conversation`); the targets are the assistant tokens after
the prompt as the template marks them (ChatML: the reply and its ``<|im_end|>``), and the sequence
ends at the end of the last assistant turn (template text after it, such as ChatML's newline, is
dropped, so the last token is the end-of-turn token).

Margin: with ``use_margin`` the record's ``margin_key`` field (a number, or a string that spells one, as
CSV cells are) is required and stored;
otherwise the field is ignored and the margin is 0.

Truncation: each sequence keeps its first ``max_len`` tokens. With ``force_eos=True`` (reward
models) a truncated sequence's last token is replaced by EOS, so the reward is always read at an
EOS. A pair where either side has no response token left is dropped (a warning counts them; if
every pair is dropped a ``DataError`` is raised).

Bad records raise :class:`rlhforge.data.errors.DataError` naming the file, record and field.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from rlhforge.data.errors import describe_value
from rlhforge.data.records import RecordRef, check_truncation_drops, get_field, get_messages, get_text, record_ref
from rlhforge.data.templates import check_input_template, encode_prompt, encode_text, render_chat, tokenize_conversation

__all__ = ["PreferenceSample", "build_preference_samples", "preference_sample_from_record", "collate_pairs"]

logger = logging.getLogger(__name__)


@dataclass
class PreferenceSample:
    """One tokenised preference pair.

    ``chosen_ids``/``chosen_mask`` (and the rejected ones) have equal lengths; ``mask[t] = 1`` marks
    a response token; ``mask[0] == 0``. ``margin`` is 0 unless margins were requested.
    ``prompt_len`` is the number of leading prompt tokens (shared by both sides).
    """

    chosen_ids: list[int]
    chosen_mask: list[int]
    rejected_ids: list[int]
    rejected_mask: list[int]
    margin: float = 0.0
    prompt_len: int = 0
    source: str | None = None
    index: int | None = None

    @property
    def chosen(self) -> dict[str, list[int]]:
        return {"input_ids": self.chosen_ids, "loss_mask": self.chosen_mask}

    @property
    def rejected(self) -> dict[str, list[int]]:
        return {"input_ids": self.rejected_ids, "loss_mask": self.rejected_mask}

    def __len__(self) -> int:
        """Tokens of the pair (chosen + rejected): what a micro-batch of it costs."""
        return len(self.chosen_ids) + len(self.rejected_ids)


def build_preference_samples(
    dataset: Iterable[Mapping[str, Any]],
    tokenizer,
    *,
    prompt_key: str | None = None,
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    margin_key: str = "margin",
    use_margin: bool = False,
    input_template: str | None = None,
    apply_chat_template: bool = False,
    max_len: int = 512,
    force_eos: bool = False,
) -> list[PreferenceSample]:
    """Tokenise every record of ``dataset`` (a ``datasets.Dataset`` or any iterable of dicts).

    See the module docstring for formats, margins and truncation.

    Raises:
        DataError: a bad record (file, record index and field in the message), or every pair
            truncated away.
        ValueError: bad options (``input_template`` without ``{}``, no EOS token, ``max_len < 2``).
    """
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2 to hold a prompt token and a target (got {max_len})")
    check_input_template(input_template)
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token; preference sequences end with EOS")
    samples: list[PreferenceSample] = []
    dropped: list[RecordRef] = []
    eos = tokenizer.eos_token_id
    for position, record in enumerate(dataset):
        ref = record_ref(record, position)
        sample = preference_sample_from_record(
            record, tokenizer, ref=ref, prompt_key=prompt_key, chosen_key=chosen_key, rejected_key=rejected_key,
            margin_key=margin_key, use_margin=use_margin, input_template=input_template,
            apply_chat_template=apply_chat_template,
        )
        sample.chosen_ids, sample.chosen_mask = _truncate(sample.chosen_ids, sample.chosen_mask, max_len, force_eos, eos)
        sample.rejected_ids, sample.rejected_mask = _truncate(
            sample.rejected_ids, sample.rejected_mask, max_len, force_eos, eos
        )
        if not any(sample.chosen_mask) or not any(sample.rejected_mask):
            dropped.append(ref)
            continue
        samples.append(sample)
    check_truncation_drops(dropped, len(samples), what="preference pairs", max_len=max_len, logger=logger)
    return samples


def _truncate(ids: list[int], mask: list[int], max_len: int, force_eos: bool, eos: int) -> tuple[list[int], list[int]]:
    if len(ids) <= max_len:
        return ids, mask
    ids, mask = ids[:max_len], mask[:max_len]
    if force_eos:
        ids[-1] = eos
    return ids, mask


def preference_sample_from_record(
    record: Mapping[str, Any],
    tokenizer,
    *,
    ref: RecordRef | None = None,
    prompt_key: str | None = None,
    chosen_key: str = "chosen",
    rejected_key: str = "rejected",
    margin_key: str = "margin",
    use_margin: bool = False,
    input_template: str | None = None,
    apply_chat_template: bool = False,
) -> PreferenceSample:
    """One record -> one untruncated :class:`PreferenceSample` (see :func:`build_preference_samples`)."""
    ref = ref or record_ref(record, 0)
    if apply_chat_template:
        prompt, chosen, rejected, origins = _conversations(record, ref, prompt_key, chosen_key, rejected_key)
        c_ids, c_mask, p_len = _chat_sequence(tokenizer, prompt, chosen, ref, origins[0])
        r_ids, r_mask, _ = _chat_sequence(tokenizer, prompt, rejected, ref, origins[1])
    else:
        prompt_ids: list[int] = []
        if prompt_key is not None:
            prompt = get_text(record, prompt_key, ref, allow_empty=True)
            text = input_template.format(prompt) if input_template is not None else prompt
            prompt_ids = encode_prompt(tokenizer, text, chat=False) if text else []
        c_ids, c_mask = _plain_sequence(tokenizer, prompt_ids, get_text(record, chosen_key, ref))
        r_ids, r_mask = _plain_sequence(tokenizer, prompt_ids, get_text(record, rejected_key, ref))
        p_len = len(prompt_ids)
    margin = 0.0
    if use_margin:
        margin = _margin(get_field(record, margin_key, ref), ref, margin_key)
    return PreferenceSample(c_ids, c_mask, r_ids, r_mask, margin=margin, prompt_len=p_len,
                            source=ref.source, index=ref.index)


def _margin(value, ref: RecordRef, key: str) -> float:
    """A number, or a string that spells one (CSV cells are strings); finite."""
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
        raise ref.error(f"expected a finite number (the pair's margin), got {describe_value(value)}", field=key)
    return float(number)


def _plain_sequence(tokenizer, prompt_ids: list[int], response: str) -> tuple[list[int], list[int]]:
    eos = tokenizer.eos_token_id
    if prompt_ids:
        response_ids = encode_text(tokenizer, response)
    else:  # the whole text: encoded like a prompt (BOS if the tokenizer adds one)
        response_ids = encode_prompt(tokenizer, response, chat=False)
    if not response_ids or response_ids[-1] != eos:
        response_ids = response_ids + [eos]
    ids = list(prompt_ids) + response_ids
    mask = [0] * len(prompt_ids) + [1] * len(response_ids)
    mask[0] = 0
    return ids, mask


def _as_messages(record, key: str, ref: RecordRef, role: str) -> list[dict]:
    value = get_field(record, key, ref)
    if isinstance(value, list):
        return get_messages(record, key, ref, value=value)
    if isinstance(value, str):
        if role == "assistant" and not value.strip():
            raise ref.error("is an empty string", field=key)
        return [{"role": role, "content": value}]
    raise ref.error(f"expected a string or a list of messages, got {describe_value(value)}", field=key)


def _same_message(a: Mapping, b: Mapping) -> bool:
    return a.get("role") == b.get("role") and a.get("content") == b.get("content") and a.get("tool_calls") == b.get(
        "tool_calls"
    )


def _conversations(record, ref: RecordRef, prompt_key, chosen_key, rejected_key):
    """(prompt messages, chosen response messages, rejected response messages, (chosen field, rejected field))."""
    if prompt_key is not None:
        prompt = _as_messages(record, prompt_key, ref, "user")
        chosen = _as_messages(record, chosen_key, ref, "assistant")
        rejected = _as_messages(record, rejected_key, ref, "assistant")
        # a response list may repeat the prompt messages first (whole conversations plus a prompt field)
        for response in (chosen, rejected):
            if len(response) > len(prompt) and all(_same_message(a, b) for a, b in zip(prompt, response)):
                del response[: len(prompt)]
        return prompt, chosen, rejected, (chosen_key, rejected_key)
    c_val, r_val = get_field(record, chosen_key, ref), get_field(record, rejected_key, ref)
    for key, value in ((chosen_key, c_val), (rejected_key, r_val)):
        if not isinstance(value, list):
            raise ref.error(
                f"is {describe_value(value)}, but with apply_chat_template and no prompt_key chosen/rejected must be "
                "whole conversations (lists of messages); set prompt_key to the prompt field",
                field=key,
            )
    chosen = get_messages(record, chosen_key, ref, value=c_val)
    rejected = get_messages(record, rejected_key, ref, value=r_val)
    common = 0
    while common < min(len(chosen), len(rejected)) and _same_message(chosen[common], rejected[common]):
        common += 1
    if common == len(chosen) and common == len(rejected):
        raise ref.error("chosen and rejected are the same conversation", field=chosen_key)
    for key, conv in ((chosen_key, chosen), (rejected_key, rejected)):
        if common == len(conv):
            raise ref.error(
                f"is a prefix of the other conversation: it has no response of its own after the {common} shared "
                "prompt message(s)",
                field=key,
            )
    return chosen[:common], chosen[common:], rejected[common:], (chosen_key, rejected_key)


def _chat_sequence(tokenizer, prompt: list[dict], response: list[dict], ref: RecordRef, field: str):
    """Token ids, response mask and prompt length of ``prompt + response`` rendered by the chat template."""
    if not any(m["role"] == "assistant" for m in response):
        raise ref.error(
            f"has no assistant message after the prompt (roles: {[m['role'] for m in response]})", field=field
        )
    for i, message in enumerate(response):
        if message["role"] == "assistant" and isinstance(message.get("content"), str) and not message.get(
            "tool_calls"
        ) and not message["content"].strip():
            raise ref.error("the assistant reply is an empty string", field=f"{field}[{i}]" if len(response) > 1 else field)
    try:
        ids, spans = tokenize_conversation(tokenizer, prompt + response)
        prompt_ids: list[int] = []
        if prompt:
            generation_prompt = response[0]["role"] == "assistant"
            prompt_ids = encode_text(tokenizer, render_chat(tokenizer, prompt, add_generation_prompt=generation_prompt))
    except ValueError as err:
        raise ref.error(str(err), field=field) from None
    p_len = len(prompt_ids)
    if ids[:p_len] != prompt_ids:
        raise ref.error(
            "the chat template is not prefix-preserving: the rendered prompt does not tokenise to a prefix of the "
            "rendered conversation, so the response tokens cannot be located",
            field=field,
        )
    spans = [(max(start, p_len), end) for start, end in spans if end > p_len]
    if not spans:
        raise ref.error("the chat template marked no assistant tokens after the prompt", field=field)
    end = spans[-1][1]
    ids = ids[:end]
    mask = [0] * end
    for start, stop in spans:
        mask[start:stop] = [1] * (stop - start)
    mask[0] = 0
    return ids, mask, p_len


def collate_pairs(samples: Sequence[PreferenceSample], pad_id: int, *, packed: bool) -> dict[str, Any]:
    """One batch of ``2 B`` sequences: ``B`` chosen then ``B`` rejected (layouts of
    :mod:`rlhforge.data.packing`), plus ``margin`` [B] (float32) and ``num_pairs``."""
    import torch

    from rlhforge.data.packing import collate_packed, collate_padded

    sequences = [s.chosen for s in samples] + [s.rejected for s in samples]
    batch = collate_packed(sequences) if packed else collate_padded(sequences, pad_id)
    batch["margin"] = torch.tensor([s.margin for s in samples], dtype=torch.float32)
    batch["num_pairs"] = len(samples)
    return batch
