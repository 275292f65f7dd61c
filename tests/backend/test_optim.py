import math

import pytest
import torch

from rlhforge.backend.optim import build_optimizer, build_scheduler, lr_lambda, optimizer_param_groups
from rlhforge.config.components import AdamConfig, OptimConfig


def test_warmup_from_zero_then_cosine_with_min_lr():
    kw = dict(total_steps=10, warmup_steps=2, schedule="cosine_with_min_lr", min_lr_ratio=0.1)
    # warm-up: step / 2, from 0 (HF get_scheduler): the first optimizer step has lr 0
    assert lr_lambda(0, **kw) == 0.0
    assert lr_lambda(1, **kw) == pytest.approx(0.5)
    # step 2: progress 0 -> 0.1 + 0.9*1 = 1.0
    assert lr_lambda(2, **kw) == pytest.approx(1.0)
    # step 6: progress (6-2)/8 = 0.5 -> cos term 0.5 -> 0.1 + 0.9*0.5 = 0.55
    assert lr_lambda(6, **kw) == pytest.approx(0.55)
    # the end: progress 1 -> floor 0.1
    assert lr_lambda(10, **kw) == pytest.approx(0.1)


def test_other_schedules():
    assert lr_lambda(5, total_steps=10, warmup_steps=0, schedule="constant", min_lr_ratio=0) == 1.0
    # HF's "constant" ignores the warm-up; "constant_with_warmup" has it: 1/4 at step 1
    assert lr_lambda(0, total_steps=10, warmup_steps=4, schedule="constant", min_lr_ratio=0) == 1.0
    assert lr_lambda(1, total_steps=10, warmup_steps=4, schedule="constant_with_warmup", min_lr_ratio=0) == 0.25
    assert lr_lambda(4, total_steps=10, warmup_steps=4, schedule="constant_with_warmup", min_lr_ratio=0) == 1.0
    # linear: 1 - 5/10 ; with warm-up 2 at step 6: (10 - 6) / (10 - 2) = 0.5
    assert lr_lambda(5, total_steps=10, warmup_steps=0, schedule="linear", min_lr_ratio=0) == pytest.approx(0.5)
    assert lr_lambda(6, total_steps=10, warmup_steps=2, schedule="linear", min_lr_ratio=0) == pytest.approx(0.5)
    assert lr_lambda(0, total_steps=10, warmup_steps=2, schedule="linear", min_lr_ratio=0) == 0.0
    # cosine at a quarter: 0.5 * (1 + cos(pi/4))
    assert lr_lambda(1, total_steps=4, warmup_steps=0, schedule="cosine", min_lr_ratio=0) == pytest.approx(
        0.5 * (1 + math.cos(math.pi / 4)))


@pytest.mark.parametrize("schedule", ["cosine_with_min_lr", "cosine", "constant", "constant_with_warmup", "linear"])
def test_every_schedule_matches_hf_get_scheduler(schedule):
    from transformers import get_scheduler

    total, ratio = 37, 0.1  # warm-up = ceil(3.7) = 4 steps, as OpenRLHF computes it
    cfg = OptimConfig(adam=AdamConfig(lr=1.0), lr_scheduler=schedule, lr_warmup_ratio=ratio, min_lr_ratio=0.1)
    ours = build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), cfg, total)
    hf_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    extra = {"scheduler_specific_kwargs": {"min_lr_rate": 0.1}} if schedule == "cosine_with_min_lr" else {}
    hf = get_scheduler(schedule, hf_opt, num_warmup_steps=math.ceil(total * ratio), num_training_steps=total, **extra)
    for step in range(total):
        assert ours.get_last_lr()[0] == pytest.approx(hf.get_last_lr()[0], abs=1e-12), (schedule, step)
        ours.optimizer.step(), ours.step(), hf_opt.step(), hf.step()


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(2, 2, bias=True)
        self.input_layernorm = torch.nn.LayerNorm(2)
        self.layer_norm = torch.nn.LayerNorm(2)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _Block()
        self.norm = torch.nn.LayerNorm(2)  # "norm.weight"
        self.ln_f = torch.nn.LayerNorm(2)
        self.lm_head = torch.nn.Linear(2, 3, bias=False)
        self.frozen = torch.nn.Linear(2, 2, bias=False)
        self.frozen.weight.requires_grad_(False)


def test_weight_decay_exempts_biases_and_norm_weights():
    model = _Model()
    groups = optimizer_param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = sorted(names[id(p)] for p in groups[0]["params"])
    exempt = sorted(names[id(p)] for p in groups[1]["params"])
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert decayed == ["block.q_proj.weight", "lm_head.weight"]
    assert exempt == ["block.input_layernorm.bias", "block.input_layernorm.weight", "block.layer_norm.bias",
                      "block.layer_norm.weight", "block.q_proj.bias", "ln_f.bias", "ln_f.weight", "norm.bias",
                      "norm.weight"]


def test_adamw_step_decays_only_the_decayed_group():
    # zero gradients: AdamW's update is only the decoupled decay p <- p * (1 - lr * wd) (Adam's part is 0)
    model = _Model()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(2.0)
    opt = build_optimizer(model, OptimConfig(adam=AdamConfig(lr=0.5, weight_decay=0.1)))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert torch.allclose(model.lm_head.weight, torch.full((3, 2), 2.0 * (1 - 0.5 * 0.1)))  # 1.9
    assert torch.allclose(model.block.q_proj.weight, torch.full((2, 2), 1.9))
    for p in (model.block.q_proj.bias, model.norm.weight, model.block.input_layernorm.weight, model.ln_f.bias):
        assert torch.equal(p, torch.full_like(p, 2.0))
    assert torch.equal(model.frozen.weight, torch.full((2, 2), 2.0))  # not trainable: not in the optimizer
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(torch.nn.Linear(1, 1).requires_grad_(False), OptimConfig())
