"""RL prompt data: records -> token ids + label + datasource, and a resumable prompt stream."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from rlhforge.data.errors import DataError

__all__ = ["Prompt", "load_prompts", "PromptStream", "GroupBuffer", "Gathered", "gather_groups"]


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    label: Any
    datasource: str | None
    index: int
    """Position in the loaded prompt list (stable across resumes)."""
    raw: Any = None
    """The record's prompt field as given (for agents that render their own conversation)."""
    vision: Any = None
    """A vision-language actor: the prompt's images (``data.images.VisionInput``; None: text only)."""


def _prompt_text(record, ref, tokenizer, data_cfg) -> tuple[Any, str]:
    """(the prompt field as given, the text the model sees); a wrong type names the record and field."""
    from rlhforge.data.errors import describe_value
    from rlhforge.data.records import get_field, get_messages
    from rlhforge.data.templates import format_prompt

    key = data_cfg.input_key
    raw = get_field(record, key, ref)
    if isinstance(raw, list):
        if not data_cfg.apply_chat_template:
            raise ref.error("is a list of messages; set --data.apply_chat_template to render it with the chat "
                            "template", field=key)
        prompt: Any = get_messages(record, key, ref, value=raw)
    elif isinstance(raw, str):
        if not raw.strip():
            raise ref.error("is an empty prompt", field=key)
        prompt = raw
    else:
        what = "a string or a list of messages" if data_cfg.apply_chat_template else "a string"
        raise ref.error(f"expected {what} (the prompt), got {describe_value(raw)}", field=key)
    try:
        text = format_prompt(tokenizer, prompt, input_template=data_cfg.input_template,
                             apply_chat_template=data_cfg.apply_chat_template)
    except (ValueError, TypeError) as err:
        raise ref.error(f"cannot be rendered as a prompt: {err}", field=key) from None
    return raw, text


def _to_prompts(dataset, tokenizer, data_cfg, prompt_max_len: int, what: str) -> list[Prompt]:
    """Records -> prompts. The label is the record's ``label_key`` value exactly as read (a string stays
    that string, a number that number, ``null`` is ``None``); a record without the key is an error."""
    from rlhforge.data.records import get_field, record_ref
    from rlhforge.data.templates import encode_prompt
    from rlhforge.data.vlm_prompts import vlm_prompt

    prompts, skipped = [], 0
    vlm = getattr(tokenizer, "image_processor", None) is not None  # a models.vlm.VisionProcessor
    for pos, record in enumerate(dataset):
        ref = record_ref(record, pos)
        vision = None
        if vlm:  # images placed by the chat template, image tokens expanded (data/vlm_prompts.py)
            raw, ids, vision = vlm_prompt(record, tokenizer, ref, input_key=data_cfg.input_key,
                                          image_key=data_cfg.image_key, max_images=data_cfg.max_images_per_prompt)
        else:
            raw, text = _prompt_text(record, ref, tokenizer, data_cfg)
            ids = encode_prompt(tokenizer, text, chat=data_cfg.apply_chat_template)
        if len(ids) > prompt_max_len:
            skipped += 1
            continue
        label = None
        if data_cfg.label_key:
            label = record[data_cfg.label_key] if data_cfg.label_key in record else get_field(
                record, data_cfg.label_key, ref)  # get_field raises "is missing", naming the record's keys
        source = record.get(data_cfg.datasource_key)
        prompts.append(Prompt(ids, label, None if source is None else str(source), len(prompts), raw, vision))
    if skipped:
        print(f"[rlhforge] {what}: skipped {skipped} prompts longer than {prompt_max_len} tokens (--data.prompt_max_len)")
    if not prompts:
        raise DataError(f"{what}: no usable prompts (all {skipped} are longer than {prompt_max_len} tokens?)")
    return prompts


def load_prompts(cfg, tokenizer) -> tuple[list[Prompt], list[Prompt]]:
    """Training and eval prompts of an :class:`~rlhforge.config.rl.RLConfig`."""
    from rlhforge.data.loading import load_dataset_spec

    d = cfg.data
    prompt_max_len = d.prompt_max_len or d.max_len - 1
    train = load_dataset_spec(d.prompt_dataset, d.prompt_probs, d.prompt_split, d.max_samples, seed=cfg.train.seed)
    train_prompts = _to_prompts(train, tokenizer, d, prompt_max_len, "prompts")
    eval_prompts: list[Prompt] = []
    if cfg.eval.dataset:
        evals = load_dataset_spec(cfg.eval.dataset, None, cfg.eval.split, cfg.eval.max_samples, seed=cfg.train.seed)
        eval_prompts = _to_prompts(evals, tokenizer, d, prompt_max_len, "eval prompts")
    return train_prompts, eval_prompts


class PromptStream:
    """Endless, deterministic prompt order: one seeded shuffle per episode; ``position`` counts the
    prompts handed out so far (saved in checkpoints, so a resumed run continues the same order)."""

    def __init__(self, num_prompts: int, seed: int, position: int = 0):
        self.num_prompts, self.seed, self.position = num_prompts, seed, position
        self._episode, self._order = -1, []

    def _order_of(self, episode: int) -> list[int]:
        if episode != self._episode:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + episode)
            self._order, self._episode = torch.randperm(self.num_prompts, generator=g).tolist(), episode
        return self._order

    def index_at(self, position: int) -> int:
        """The prompt handed out at stream ``position`` (the stream does not move)."""
        episode, offset = divmod(position, self.num_prompts)
        return self._order_of(episode)[offset]

    def take(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            out.append(self.index_at(self.position))
            self.position += 1
        return out


# --------------------------------------------------------------------------------------------- oversampling

@dataclass
class GroupBuffer:
    """Prompt groups generated and accepted but not trained on yet (oversampling,
    ``--rollout.vllm_generate_batch_size`` above ``rollout.batch_size``), oldest first, each with
    its prompt-stream position. ``pending``: positions a checkpoint recorded as buffered; after a
    resume they are generated again (same request seeds) before any new prompt is taken, so a
    resumed run neither skips nor repeats a prompt."""

    groups: list[tuple[int, list]] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)

    def positions(self) -> list[int]:
        """What a checkpoint taken now records (``trainer_state["buffered_positions"]``)."""
        return [*self.pending, *(pos for pos, _ in self.groups)]


@dataclass
class Gathered:
    """One step's prompt groups and how they were obtained."""

    groups: list[list]
    """The step's groups (``n`` trajectories each), at most ``need``, oldest prompt first."""
    positions: list[int]
    """Their prompt-stream positions."""
    generated: list
    """Every trajectory generated during this call (groups dropped by a failure excluded)."""
    generated_groups: int
    passed_groups: int
    rounds: int
    """Engine calls made (0: the buffer alone filled the step)."""
    new_prompts: int
    """Prompts taken from the stream during this call."""
    from_buffer: int
    """Groups of this step that were generated at an earlier step (or regenerated after a resume)."""


#: generate(prompt indices, stream positions) -> one group (list of n trajectories) per position,
#: or None where the group was dropped (a failed environment / reward, a registry filter)
Generate = Callable[[list[int], list[int]], list]


def gather_groups(stream: PromptStream, buffer: GroupBuffer, *, need: int, round_size: int | None,
                  generate: Generate, accept: Callable[[list], bool] | None, max_refills: int) -> Gathered:
    """Fill one step with ``need`` prompt groups: first the buffer (a resume's pending positions are
    generated again first), then engine calls of ``round_size`` new prompts (None: just the
    missing number). ``accept`` (dynamic filtering; None: keep every group) decides which generated
    groups count; with it, up to ``max_refills`` extra calls replace rejected groups. Accepted
    groups beyond ``need`` stay in ``buffer`` for the next step. Every prompt taken from the stream
    ends up trained on, buffered, or rejected (filtered / dropped): none is taken twice."""
    generated: list = []
    counts = {"generated": 0, "passed": 0}

    def run(idx: list[int], positions: list[int]) -> list[tuple[int, list]]:
        out = []
        for pos, group in zip(positions, generate(idx, positions)):
            if group is None:
                continue
            generated.extend(group)
            counts["generated"] += 1
            if accept is None or accept(group):
                counts["passed"] += 1
                out.append((pos, group))
        return out

    kept: list[tuple[int, list]] = []
    if buffer.pending:
        positions, buffer.pending = list(buffer.pending), []
        kept.extend(run([stream.index_at(p) for p in positions], positions))
    kept.extend(buffer.groups)
    from_buffer = len(kept)
    buffer.groups = []
    start, rounds = stream.position, 0
    missing = need - len(kept)
    if missing > 0:
        size = round_size or missing
        max_rounds = math.ceil(missing / size) + (max_refills if accept is not None else 0)
        while len(kept) < need and rounds < max_rounds:
            size = round_size or need - len(kept)
            first = stream.position
            idx = stream.take(size)
            kept.extend(run(idx, list(range(first, first + size))))
            rounds += 1
    buffer.groups = kept[need:]
    used = kept[:need]
    return Gathered([g for _, g in used], [p for p, _ in used], generated, counts["generated"], counts["passed"],
                    rounds, stream.position - start, min(from_buffer, need))
