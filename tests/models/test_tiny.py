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


def test_merged_lora_state_equals_peft_merge_and_unload(tiny_model_dir):
    """The weight-sync merge (out of place, from a state dict) == PEFT's own merge_and_unload."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rlhforge.models.export import merged_lora_state

    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                           LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at zero: give the adapters a real delta
            torch.nn.init.normal_(p, std=0.1)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    merged = merged_lora_state(state, model)
    assert not any("lora_" in k or "base_layer" in k for k in merged)
    reference = model.merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    changed = 0
    for k, v in reference.items():
        torch.testing.assert_close(merged[k], v, rtol=1e-5, atol=1e-6, msg=k)
        base = state.get(f"base_model.model.{k}")
        if base is None:  # a LoRA layer's weight: the base it was merged into
            base = state[f"base_model.model.{k.removesuffix('.weight')}.base_layer.weight"]
        changed += int(not torch.equal(merged[k], base))
    assert changed == 14  # 7 linear layers x 2 blocks carried a delta (+ nothing else changed)
