"""Chat-template overrides, input templates and prompt formatting."""

from __future__ import annotations

import pytest

from rlhforge.data.templates import (
    check_input_template,
    format_prompt,
    has_generation_markers,
    load_chat_template,
    set_chat_template,
)
from rlhforge.models.tiny import CHATML_TEMPLATE, build_tokenizer


@pytest.fixture()
def tok():
    return build_tokenizer(vocab_size=300)


def test_load_chat_template_from_string_and_file(tmp_path):
    assert load_chat_template(None) is None and load_chat_template("") is None
    assert load_chat_template(CHATML_TEMPLATE) == CHATML_TEMPLATE
    path = tmp_path / "t.jinja"
    path.write_text(CHATML_TEMPLATE)
    assert load_chat_template(str(path)) == CHATML_TEMPLATE
    with pytest.raises(FileNotFoundError, match="missing.jinja"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="neither an existing file nor a Jinja template"):
        load_chat_template("chatml")


def test_override_and_render(tok):
    simple = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    set_chat_template(tok, simple)
    assert not has_generation_markers(tok) and has_generation_markers(CHATML_TEMPLATE)
    assert format_prompt(tok, "hi", apply_chat_template=True) == "[user] hi\n[assistant] "
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert format_prompt(tok, msgs, apply_chat_template=True, add_generation_prompt=False) == "[system] s\n[user] u\n"


def test_input_template(tok):
    assert format_prompt(tok, "2+2", input_template="Q: {}\nA:") == "Q: 2+2\nA:"
    assert format_prompt(tok, "2+2") == "2+2"
    assert format_prompt(tok, "x", input_template='{{"q": "{}"}}') == '{"q": "x"}'
    with pytest.raises(ValueError, match=r"has no '\{\}' placeholder"):
        check_input_template("Q: {prompt}")
    with pytest.raises(ValueError, match="exactly one"):
        check_input_template("{} and {}")
    with pytest.raises(ValueError, match="apply_chat_template"):
        format_prompt(tok, [{"role": "user", "content": "a"}])
