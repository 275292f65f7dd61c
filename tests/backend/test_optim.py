import math

import pytest

from rlhforge.backend.optim import lr_lambda


def test_warmup_then_cosine_with_min_lr():
    kw = dict(total_steps=10, warmup_steps=2, schedule="cosine_with_min_lr", min_lr_ratio=0.1)
    # warm-up: (step+1)/2
    assert lr_lambda(0, **kw) == pytest.approx(0.5)
    assert lr_lambda(1, **kw) == pytest.approx(1.0)
    # step 2: progress 0 -> 0.1 + 0.9*1 = 1.0
    assert lr_lambda(2, **kw) == pytest.approx(1.0)
    # step 6: progress (6-2)/8 = 0.5 -> cos term 0.5 -> 0.1 + 0.9*0.5 = 0.55
    assert lr_lambda(6, **kw) == pytest.approx(0.55)
    # the end: progress 1 -> floor 0.1
    assert lr_lambda(10, **kw) == pytest.approx(0.1)


def test_other_schedules():
    assert lr_lambda(5, total_steps=10, warmup_steps=0, schedule="constant", min_lr_ratio=0) == 1.0
    # linear: 1 - 5/10
    assert lr_lambda(5, total_steps=10, warmup_steps=0, schedule="linear", min_lr_ratio=0) == pytest.approx(0.5)
    # cosine at a quarter: 0.5 * (1 + cos(pi/4))
    assert lr_lambda(1, total_steps=4, warmup_steps=0, schedule="cosine", min_lr_ratio=0) == pytest.approx(
        0.5 * (1 + math.cos(math.pi / 4)))
