"""A new critic / reward-model value head is initialised like OpenRLHF's (std = 1 / (d + 1)); one
loaded from a checkpoint is left alone."""

import math
import shutil

import pytest
import torch

from rlhforge.config.components import DSConfig, LoraConfig, ModelConfig
from rlhforge.models.reward import init_value_head, load_reward_model, value_head


def _load(path, **ds):
    return load_reward_model(str(path), ModelConfig(), DSConfig(param_dtype="fp32", **ds), torch.device("cpu"),
                             pad_token_id=0)


def test_init_value_head_draws_normal_with_std_one_over_d_plus_one():
    head = torch.nn.Linear(255, 1, bias=True)
    torch.manual_seed(0)
    init_value_head(head, hidden_size=255)
    torch.manual_seed(0)
    expected = torch.empty(1, 255).normal_(mean=0.0, std=1.0 / 256)  # the same draw, independently
    torch.testing.assert_close(head.weight.detach(), expected)
    assert torch.equal(head.bias.detach(), torch.zeros(1))


def test_a_new_head_is_reinitialised_and_a_saved_one_is_kept(tiny_model_dir, tmp_path):
    torch.manual_seed(1)
    model = _load(tiny_model_dir)  # a causal LM: transformers creates "score"; we re-draw it
    w = value_head(model).weight.detach()
    d = model.config.hidden_size  # 128
    assert w.shape == (1, d)
    # sample std of 128 draws of N(0, 1/129): 1/129 = 0.00775 (HF's own init would be 0.02)
    assert w.std().item() == pytest.approx(1.0 / (d + 1), rel=0.25)
    assert abs(w.mean().item()) < 4 / (d + 1) / math.sqrt(d)

    model.save_pretrained(tmp_path / "rm")
    torch.manual_seed(2)
    again = _load(tmp_path / "rm")  # a trained reward model / critic: the stored head is kept
    assert torch.equal(value_head(again).weight.detach(), w)


def test_lora_head_copies_get_the_same_init(tiny_model_dir):
    torch.manual_seed(3)
    model = _load(tiny_model_dir, lora=LoraConfig(rank=4))
    head = value_head(model)
    weights = [m.weight.detach() for m in head.modules() if isinstance(m, torch.nn.Linear)]
    assert len(weights) >= 2  # peft keeps the original and the trained copy
    assert all(torch.equal(x, weights[0]) for x in weights)
    assert weights[0].std().item() == pytest.approx(1.0 / 129, rel=0.25)


def test_a_new_head_says_one_line_instead_of_the_load_report(tiny_model_dir, tmp_path, capfd, caplog):
    """Issue 47, item 9: loading a causal LM as a reward model/critic printed transformers' "LOAD REPORT" table
    (``score.weight | MISSING``) on every load; the missing head is expected (rlhforge initialises it), so one
    line of rlhforge's says so instead. A checkpoint missing anything else still gets the report."""
    from safetensors.torch import load_file, save_file

    capfd.readouterr()
    _load(tiny_model_dir)
    out, err = capfd.readouterr()
    assert "LOAD REPORT" not in out + err + caplog.text
    assert out.count("no 'score' value head in the checkpoint") == 1

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    weights = load_file(broken / "model.safetensors")
    dropped = next(k for k in weights if k.endswith("layers.0.mlp.up_proj.weight"))
    save_file({k: v for k, v in weights.items() if k != dropped}, broken / "model.safetensors",
              metadata={"format": "pt"})
    _load(broken)
    assert "LOAD REPORT" in caplog.text and "up_proj" in caplog.text
