import hashlib

import torch

from rlhforge.models.tiny import TinyModelSpec, build_tiny_model


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_loads_offline_with_chat_template_and_specials(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert tok.pad_token == "<pad>" and tok.eos_token == "<|im_end|>"
    assert model.config.hidden_size // model.config.num_attention_heads == 32
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok("What is 12 + 7? The answer is 19.")["input_ids"]
    assert tok.decode(ids) == "What is 12 + 7? The answer is 19."
    out = model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False)
    assert out.shape[0] == 1 and len(ids) < out.shape[1] <= len(ids) + 5
    assert out[0, : len(ids)].tolist() == ids


def test_same_seed_same_files(tmp_path):
    spec = TinyModelSpec(num_hidden_layers=1)
    a = _digest(build_tiny_model(tmp_path / "a", spec, seed=3))
    b = _digest(build_tiny_model(tmp_path / "b", spec, seed=3))
    c = _digest(build_tiny_model(tmp_path / "c", spec, seed=4))
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]


def test_head_dim_below_32_is_rejected():
    import pytest

    with pytest.raises(ValueError, match="head_dim .* = 16; vLLM"):
        TinyModelSpec(hidden_size=64, num_attention_heads=4)
