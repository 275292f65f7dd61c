"""Supervised fine-tuning samples: token ids plus a mask of the tokens to train on.

``build_sft_samples(dataset, tokenizer, ...)`` returns a plain ``list[SFTSample]`` (tokenised
eagerly, once; any sequence of them feeds :mod:`rlhforge.data.packing`). Mask convention:
``loss_mask[t] = 1`` means token ``t`` is a target, predicted from tokens ``< t``; the first token
never is. This lines up with :func:`rlhforge.models.forward.token_logprobs`, whose position ``t``
holds ``log p(input_ids[t] | < t)``.

Modes (the record fields are chosen by ``input_key``/``output_key``):

``apply_chat_template=False`` (default)
    prompt = ``input_template.format(record[input_key])`` (or the text as is), encoded with the
    tokenizer's special tokens (BOS if it adds one); response = ``record[output_key]`` encoded
    without special tokens, plus the EOS token id. Prompt and response are encoded separately
    and concatenated, so the prompt tokens are exactly what generation would see. Targets: the
    response tokens and EOS.
``apply_chat_template=True``
    the record becomes a conversation: ``record[input_key]`` is a string (one user message) or a
    list of messages; ``record[output_key]`` (optional when the input is already a conversation
    that ends with the assistant) is a string (one assistant message) or a list of messages
    appended to it (TRL's conversational prompt/completion). The conversation is rendered and
    tokenised whole; targets are the assistant tokens as the template marks them
    (:func:`rlhforge.data.templates.tokenize_conversation`; with ChatML: the reply and its
    ``<|im_end|>``). Without ``multiturn`` only the final assistant message is a target (it must
    be the last message); with ``multiturn`` every assistant message is. No EOS is appended: the
    template decides how a turn ends.
``pretrain_mode=True``
    text = ``record[input_key]`` (a string, or with ``apply_chat_template`` a conversation rendered
    whole) plus EOS; every token but the first is a target. ``input_template`` is not used.

Formats by key mapping: OpenRLHF ``{"input", "output"}`` -> ``input_key="input",
output_key="output"``; TRL ``{"prompt", "completion"}`` -> ``input_key="prompt",
output_key="completion"`` (strings, or lists of messages with ``apply_chat_template``); TRL
``{"messages"}`` -> ``input_key="messages", apply_chat_template=True``; ``{"text"}`` ->
``input_key="text", pretrain_mode=True``.

Truncation: samples longer than ``max_len`` keep their first ``max_len`` tokens (the prompt
start). A sample left with no target tokens (its response lies entirely beyond ``max_len``) is
dropped; the number dropped is logged as a warning, and if every sample is dropped a
``DataError`` is raised.

Bad records raise :class:`rlhforge.data.errors.DataError` naming the file, record and field:
missing key, wrong type (a number or list where text is expected, messages that are not a list
of ``{"role", "content"}``), an empty response, a conversation without an assistant reply.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from rlhforge.data.errors import describe_value
from rlhforge.data.records import RecordRef, check_truncation_drops, get_field, get_messages, get_text, record_ref
from rlhforge.data.templates import (
    check_input_template,
    encode_prompt,
    encode_text,
    render_chat,
    tokenize_conversation,
)

__all__ = ["SFTSample", "build_sft_samples", "sft_sample_from_record"]

logger = logging.getLogger(__name__)


@dataclass
class SFTSample:
    """One tokenised SFT example.

    ``input_ids`` and ``loss_mask`` have the same length; ``loss_mask[t] = 1`` marks token ``t`` as
    a target (predicted from tokens ``< t``), ``loss_mask[0] == 0``. ``source``/``index`` say where
    the record came from (for error messages).
    """

    input_ids: list[int]
    loss_mask: list[int]
    source: str | None = None
    index: int | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_targets(self) -> int:
        return sum(self.loss_mask)


def build_sft_samples(
    dataset: Iterable[Mapping[str, Any]],
    tokenizer,
    *,
    input_key: str = "input",
    output_key: str | None = None,
    input_template: str | None = None,
    apply_chat_template: bool = False,
    multiturn: bool = False,
    pretrain_mode: bool = False,
    max_len: int = 2048,
) -> list[SFTSample]:
    """Tokenise every record of ``dataset`` (a ``datasets.Dataset`` or any iterable of dicts).

    See the module docstring for the modes, key mapping and truncation rule.

    Raises:
        DataError: a bad record (file, record index and field in the message), or every sample
            truncated away.
        ValueError: bad options (``input_template`` without ``{}``, no chat template, ``max_len < 2``).
    """
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2 to hold a prompt token and a target (got {max_len})")
    check_input_template(input_template)
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token; SFT responses end with EOS")
    if apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "apply_chat_template is on but the tokenizer has no chat template; set one with "
            "--data.tokenizer_chat_template (a Jinja string or a .jinja file)"
        )
    samples: list[SFTSample] = []
    dropped: list[RecordRef] = []
    for position, record in enumerate(dataset):
        ref = record_ref(record, position)
        sample = sft_sample_from_record(
            record,
            tokenizer,
            ref=ref,
            input_key=input_key,
            output_key=output_key,
            input_template=input_template,
            apply_chat_template=apply_chat_template,
            multiturn=multiturn,
            pretrain_mode=pretrain_mode,
        )
        sample.input_ids = sample.input_ids[:max_len]
        sample.loss_mask = sample.loss_mask[:max_len]
        if sample.num_targets == 0:
            dropped.append(ref)
            continue
        samples.append(sample)
    check_truncation_drops(dropped, len(samples), what="SFT samples", max_len=max_len, logger=logger)
    return samples


def sft_sample_from_record(
    record: Mapping[str, Any],
    tokenizer,
    *,
    ref: RecordRef | None = None,
    input_key: str = "input",
    output_key: str | None = None,
    input_template: str | None = None,
    apply_chat_template: bool = False,
    multiturn: bool = False,
    pretrain_mode: bool = False,
) -> SFTSample:
    """One record -> one untruncated :class:`SFTSample` (see :func:`build_sft_samples`)."""
    ref = ref or record_ref(record, 0)
    eos = tokenizer.eos_token_id
    if pretrain_mode:
        ids = _pretrain_ids(record, tokenizer, ref, input_key, apply_chat_template)
        if not ids or ids[-1] != eos:
            ids.append(eos)
        mask = [0] + [1] * (len(ids) - 1)
    elif apply_chat_template:
        messages = _conversation(record, ref, input_key, output_key, multiturn)
        try:
            ids, spans = tokenize_conversation(tokenizer, messages, last_turn_only=not multiturn)
        except ValueError as err:
            raise ref.error(str(err), field=input_key) from None
        mask = [0] * len(ids)
        for start, end in spans:
            mask[start:end] = [1] * (end - start)
    else:
        if output_key is None:
            raise ref.error(
                "no output_key given: set output_key to the response field (or use pretrain_mode, or "
                "apply_chat_template with a list of messages)",
                field=input_key,
            )
        prompt = get_text(record, input_key, ref, allow_empty=True)
        response = get_text(record, output_key, ref)
        prompt_text = input_template.format(prompt) if input_template is not None else prompt
        prompt_ids = encode_prompt(tokenizer, prompt_text, chat=False) if prompt_text else []
        response_ids = encode_text(tokenizer, response) + [eos]
        ids = prompt_ids + response_ids
        mask = [0] * len(prompt_ids) + [1] * len(response_ids)
    if mask:
        mask[0] = 0
    return SFTSample(input_ids=ids, loss_mask=mask, source=ref.source, index=ref.index)


def _pretrain_ids(record, tokenizer, ref: RecordRef, key: str, chat: bool) -> list[int]:
    value = get_field(record, key, ref)
    if chat and isinstance(value, list):
        messages = get_messages(record, key, ref, value=value)
        try:
            return encode_text(tokenizer, render_chat(tokenizer, messages))
        except ValueError as err:
            raise ref.error(str(err), field=key) from None
    text = get_text(record, key, ref)
    return encode_prompt(tokenizer, text, chat=False)


def _conversation(record, ref: RecordRef, input_key: str, output_key: str | None, multiturn: bool) -> list[dict]:
    """The record as a list of messages; checks it ends (or, with multiturn, contains) an assistant reply."""
    value = get_field(record, input_key, ref)
    # origin of every message: the field name as an error would show it
    if isinstance(value, list):
        messages = get_messages(record, input_key, ref, value=value)
        origins = [f"{input_key}[{i}]" for i in range(len(messages))]
    elif not isinstance(value, str):
        raise ref.error(f"expected a list of {{'role', 'content'}} messages (or a string: one user message), got "
                        f"{describe_value(value)}", field=input_key)
    else:
        messages = [{"role": "user", "content": get_text(record, input_key, ref, allow_empty=True)}]
        origins = [input_key]
    if output_key is not None:
        out = get_field(record, output_key, ref)
        if isinstance(out, list):
            more = get_messages(record, output_key, ref, value=out)
            messages += more
            origins += [f"{output_key}[{i}]" for i in range(len(more))]
        else:
            messages.append({"role": "assistant", "content": get_text(record, output_key, ref)})
            origins.append(output_key)
    elif not isinstance(value, list):
        raise ref.error(
            "is a single prompt string but no output_key is given; set output_key to the response field, "
            "or point input_key at a list of messages",
            field=input_key,
        )
    roles = [m["role"] for m in messages]
    field = output_key if output_key is not None else input_key
    if "assistant" not in roles:
        raise ref.error(f"the conversation has no assistant message to train on (roles: {roles})", field=field)
    if not multiturn and roles[-1] != "assistant":
        raise ref.error(
            f"the last message must be the assistant's reply (roles: {roles}); set multiturn to train on "
            "earlier assistant turns",
            field=origins[-1],
        )
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or message.get("tool_calls"):
            continue
        trained = multiturn or i == len(messages) - 1
        if trained and isinstance(message.get("content"), str) and not message["content"].strip():
            raise ref.error("the assistant reply is an empty string", field=origins[i])
    return messages
