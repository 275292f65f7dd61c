"""Unpaired preference data for KTO (``rlhforge kto``): one completion per record with a boolean label.

Record fields (keys set by ``--data.prompt_key``, ``--data.completion_key``, ``--data.label_key``)::

    {"prompt": "What is 12 + 7?", "completion": "19", "label": true}

``label``: ``true``/``false`` (JSON booleans), ``1``/``0``, or the strings ``"true"``/``"false"`` (CSV cells);
anything else is a data error naming the file, record and field. The prompt and completion are tokenised as a
DPO pair's prompt and response are (plain text with ``--data.input_template``, or the chat template with
``--data.apply_chat_template``; :mod:`rlhforge.data.preference`).

Each :class:`UnpairedSample` also carries its *mismatched* sequence, as TRL's KTO does: the same prompt with
the completion of the previous record (record 0 takes the last one's), whose log-ratio estimates
KL(pi || pi_ref) for KTO's reference point. The two run as one pair: ``chosen`` = the example, ``rejected`` =
the mismatched sequence, so the DPO pipeline (collation, packing, reference models, precomputing) carries
KTO unchanged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from rlhforge.data.errors import describe_value
from rlhforge.data.preference import PreferenceSample, _truncate, preference_sample_from_record
from rlhforge.data.records import RecordRef, check_truncation_drops, get_field, record_ref
from rlhforge.data.templates import check_input_template

__all__ = ["UnpairedSample", "build_unpaired_samples", "parse_label"]

logger = logging.getLogger(__name__)
_KL_KEY = "__mismatched_completion"
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


@dataclass
class UnpairedSample(PreferenceSample):
    """A KTO example (``chosen_*``) with its mismatched sequence (``rejected_*``) and its label."""

    desirable: bool = True


def parse_label(value: Any, ref: RecordRef, key: str) -> bool:
    """A record's desirable/undesirable label (see the module docstring)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise ref.error(f"expected a boolean label (true: desirable, false: undesirable), got {describe_value(value)}",
                    field=key)


def build_unpaired_samples(
    dataset: Iterable[Mapping[str, Any]],
    tokenizer,
    *,
    prompt_key: str = "prompt",
    completion_key: str = "completion",
    label_key: str = "label",
    input_template: str | None = None,
    apply_chat_template: bool = False,
    max_len: int = 512,
) -> list[UnpairedSample]:
    """Tokenise every record (and its mismatched sequence); records whose completion is truncated away are
    dropped as DPO drops pairs (a warning, or a DataError when none is left)."""
    if max_len < 2:
        raise ValueError(f"max_len must be >= 2 to hold a prompt token and a target (got {max_len})")
    check_input_template(input_template)
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token; sequences end with EOS")
    records = list(dataset)
    refs = [record_ref(r, i) for i, r in enumerate(records)]
    labels = [parse_label(get_field(r, label_key, ref), ref, label_key) for r, ref in zip(records, refs)]
    completions = [get_field(r, completion_key, ref) for r, ref in zip(records, refs)]
    samples: list[UnpairedSample] = []
    dropped: list[RecordRef] = []
    for i, (record, ref) in enumerate(zip(records, refs)):
        paired = {**record, _KL_KEY: completions[i - 1]}  # the previous record's completion (0: the last one's)
        pair = preference_sample_from_record(
            paired, tokenizer, ref=ref, prompt_key=prompt_key, chosen_key=completion_key, rejected_key=_KL_KEY,
            input_template=input_template, apply_chat_template=apply_chat_template,
        )
        eos = tokenizer.eos_token_id
        c_ids, c_mask = _truncate(pair.chosen_ids, pair.chosen_mask, max_len, False, eos)
        r_ids, r_mask = _truncate(pair.rejected_ids, pair.rejected_mask, max_len, False, eos)
        if not any(c_mask) or not any(r_mask):
            dropped.append(ref)
            continue
        samples.append(UnpairedSample(c_ids, c_mask, r_ids, r_mask, prompt_len=pair.prompt_len, source=ref.source,
                                      index=ref.index, desirable=labels[i]))
    check_truncation_drops(dropped, len(samples), what="KTO examples", max_len=max_len, logger=logger)
    return samples
