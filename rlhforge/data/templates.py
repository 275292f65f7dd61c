"""Chat templates and prompt templates: overriding, rendering, and assistant-token spans.

Two ways to turn a prompt into text (OpenRLHF's flags):

- ``apply_chat_template=True``: render ``[{"role": "user", "content": prompt}]`` (or a list of
  messages as given) with the tokenizer's chat template and ``add_generation_prompt=True``.
  ``--data.tokenizer_chat_template`` overrides the template (:func:`load_chat_template`,
  :func:`set_chat_template`).
- otherwise ``input_template.format(prompt)`` when ``input_template`` is set (it must contain one
  ``{}``; literal braces are written ``{{`` ``}}``), else the prompt text unchanged.

Tokenisation. Rendered chat text already holds the template's special tokens, so it is encoded
with ``add_special_tokens=False``; a plain (non-chat) prompt is encoded with
``add_special_tokens=True`` so a tokenizer that adds BOS keeps doing so
(:func:`encode_prompt`).

Assistant spans (:func:`tokenize_conversation`) mark which tokens of a rendered conversation the
assistant wrote:

1. If the template has ``{% generation %}`` markers, ``apply_chat_template(...,
   return_assistant_tokens_mask=True)`` gives them directly (exactly the marked text, e.g. the
   reply plus ``<|im_end|>`` in ChatML).
2. Otherwise each assistant turn *i* spans from the end of ``render(messages[:i],
   add_generation_prompt=True)`` to the end of ``render(messages[:i+1])``; both renderings must
   tokenise to a prefix of the full conversation's ids (a *prefix-preserving* template), else a
   ``ValueError`` says so (the sample builders re-raise it as a ``DataError`` naming the
   record). Tokens after the last EOS inside a span (e.g. ChatML's trailing newline) are
   template formatting, not targets, and are dropped, so both methods agree on ChatML.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence


__all__ = [
    "load_chat_template",
    "set_chat_template",
    "check_input_template",
    "format_prompt",
    "render_chat",
    "encode_text",
    "encode_prompt",
    "has_generation_markers",
    "tokenize_conversation",
    "chat_feedback",
]

_TEMPLATE_FILE_SUFFIXES = (".jinja", ".jinja2", ".j2", ".txt", ".tmpl")
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


def load_chat_template(value: str | None) -> str | None:
    """A chat-template override as Jinja text: ``value`` itself, or the contents of the file it names.

    ``None``/empty returns ``None`` (keep the tokenizer's template). A string ending in
    ``.jinja``/``.j2``/``.txt`` (or naming an existing file) is read from disk; a missing file is an
    error. Anything else must look like Jinja (contain ``{{`` or ``{%``).
    """
    if not value:
        return None
    candidate = Path(value).expanduser()
    looks_like_path = "\n" not in value and len(value) < 4096 and "{" not in value
    if looks_like_path and (candidate.suffix.lower() in _TEMPLATE_FILE_SUFFIXES or candidate.is_file()):
        if not candidate.is_file():
            raise FileNotFoundError(f"chat template file not found: {value}")
        text = candidate.read_text(encoding="utf-8")
        if not text.strip():
            raise ValueError(f"chat template file {value} is empty")
        return text
    if "{{" not in value and "{%" not in value:
        raise ValueError(
            f"chat template {value[:80]!r} is neither an existing file nor a Jinja template "
            "(expected '{{ ... }}' / '{% ... %}' or a path to a .jinja file)"
        )
    return value


def set_chat_template(tokenizer, value: str | None):
    """Apply :func:`load_chat_template` ``(value)`` to ``tokenizer`` (in place) and return it."""
    template = load_chat_template(value)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def check_input_template(template: str | None) -> str | None:
    """Validate an ``input_template``: it must contain ``{}`` and format with one argument."""
    if template is None:
        return None
    if "{}" not in template:
        raise ValueError(
            f"input_template {template!r} has no '{{}}' placeholder for the prompt "
            "(example: 'User: {}\\nAssistant: ')"
        )
    try:
        template.format("x")
    except (IndexError, KeyError, ValueError) as err:
        raise ValueError(
            f"input_template {template!r} cannot be formatted with one prompt ({err}); it must contain exactly "
            "one '{}' and write literal braces as '{{' and '}}'"
        ) from None
    return template


def has_generation_markers(tokenizer_or_template) -> bool:
    """Whether a chat template (or a tokenizer's) contains ``{% generation %}`` blocks."""
    template = tokenizer_or_template
    if not isinstance(template, str):
        template = getattr(tokenizer_or_template, "chat_template", None)
    if isinstance(template, dict):  # named templates
        template = template.get("default", "")
    return bool(template) and bool(_GENERATION_TAG.search(template))


def _require_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "apply_chat_template is on but the tokenizer has no chat template; set one with "
            "--data.tokenizer_chat_template (a Jinja string or a .jinja file)"
        )


def render_chat(tokenizer, messages: Sequence[dict], *, add_generation_prompt: bool = False, **kwargs) -> str:
    """The chat template's text for ``messages`` (``tokenize=False``); extra kwargs (``tools``...) pass through."""
    _require_template(tokenizer)
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )


def format_prompt(
    tokenizer,
    prompt: str | Sequence[dict],
    *,
    input_template: str | None = None,
    apply_chat_template: bool = False,
    add_generation_prompt: bool = True,
    **chat_kwargs,
) -> str:
    """The prompt text the model sees.

    With ``apply_chat_template``: a string becomes one user message, a list of messages is used
    as is; rendered with ``add_generation_prompt``. Without: ``input_template.format(prompt)`` or
    the prompt itself (a list of messages is then an error).
    """
    if apply_chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        return render_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt, **chat_kwargs)
    if not isinstance(prompt, str):
        raise ValueError("a list of messages needs apply_chat_template=True")
    if input_template is not None:
        return check_input_template(input_template).format(prompt)
    return prompt


def encode_text(tokenizer, text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Token ids of ``text`` (no special tokens added unless asked)."""
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def encode_prompt(tokenizer, text: str, *, chat: bool) -> list[int]:
    """Encode prompt text: rendered chat text without added special tokens, plain text with them."""
    return encode_text(tokenizer, text, add_special_tokens=not chat)


def _runs(mask: Sequence[int]) -> list[tuple[int, int]]:
    """Contiguous runs of 1s as half-open ``(start, end)`` spans."""
    spans, start = [], None
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    if start is not None:
        spans.append((start, len(mask)))
    return spans


def tokenize_conversation(
    tokenizer,
    messages: Sequence[dict],
    *,
    last_turn_only: bool = False,
    **chat_kwargs: Any,
) -> tuple[list[int], list[tuple[int, int]]]:
    """Tokenise a whole conversation and find the assistant tokens.

    Args:
        messages: ``[{"role", "content"}, ...]`` with at least one assistant message.
        last_turn_only: return only the last assistant message's span.

    Returns:
        ``(input_ids, spans)``: ids of the full rendering (``add_generation_prompt=False``,
        no added special tokens) and half-open ``(start, end)`` spans of assistant tokens, in order.

    Raises:
        ValueError: the template is not prefix-preserving and has no ``{% generation %}`` markers,
            or its markers produced no assistant tokens.
    """
    _require_template(tokenizer)
    messages = list(messages)
    n_assistant = sum(1 for m in messages if m.get("role") == "assistant")
    if has_generation_markers(tokenizer):
        out = tokenizer.apply_chat_template(
            messages,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            add_generation_prompt=False,
            **chat_kwargs,
        )
        ids = list(out["input_ids"])
        spans = _runs(out["assistant_masks"])
        if not spans:
            raise ValueError("the chat template's {% generation %} markers produced no assistant tokens")
        if last_turn_only:
            if len(spans) != n_assistant:
                raise ValueError(
                    f"the chat template's {{% generation %}} markers gave {len(spans)} assistant spans for "
                    f"{n_assistant} assistant messages; cannot tell which span is the last turn"
                )
            spans = spans[-1:]
        return ids, spans

    full_text = render_chat(tokenizer, messages, **chat_kwargs)
    ids = encode_text(tokenizer, full_text)
    eos = tokenizer.eos_token_id
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        if last_turn_only and i != max(j for j, m in enumerate(messages) if m.get("role") == "assistant"):
            continue
        prompt_text = render_chat(tokenizer, messages[:i], add_generation_prompt=True, **chat_kwargs)
        start_ids = encode_text(tokenizer, prompt_text)
        end_ids = encode_text(tokenizer, render_chat(tokenizer, messages[: i + 1], **chat_kwargs))
        if ids[: len(start_ids)] != start_ids or ids[: len(end_ids)] != end_ids:
            raise ValueError(
                f"the chat template is not prefix-preserving: rendering the conversation up to message {i} "
                "does not tokenise to a prefix of the full conversation, so assistant tokens cannot be "
                "located. Use a template with {% generation %} markers (--data.tokenizer_chat_template)"
            )
        start, end = len(start_ids), len(end_ids)
        if eos is not None and eos in ids[start:end]:
            end = start + max(j for j, t in enumerate(ids[start:end]) if t == eos) + 1
        if end > start:
            spans.append((start, end))
    return ids, spans


def chat_feedback(tokenizer, content: str, *, role: str = "user", after_eos: bool = True) -> str:
    """Text that closes the assistant turn and adds a ``role`` message, then opens the next
    assistant turn, in the tokenizer's chat template (e.g. ChatML: ``"\\n<|im_start|>user\\n...
    <|im_end|>\\n<|im_start|>assistant\\n"``). ``after_eos``: the action ended with the eos token
    (so it is not repeated); otherwise it is included."""
    base = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "\x00A\x00"}]
    a = tokenizer.apply_chat_template(base, tokenize=False)
    b = tokenizer.apply_chat_template(base + [{"role": role, "content": content}], tokenize=False,
                                      add_generation_prompt=True)
    if not b.startswith(a):
        raise ValueError("the chat template does not render a conversation as a prefix of its continuation")
    tail = a[a.rindex("\x00A\x00") + 3:]
    eos = tokenizer.eos_token or ""
    if after_eos and eos and tail.startswith(eos):
        tail = tail[len(eos):]
    return tail + b[len(a):]
