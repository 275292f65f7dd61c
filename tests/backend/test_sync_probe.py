"""The post-sync effect check's pure part (rlhforge.backend.sync_probe): the probe, the bounds, the statistics
and the stop, against numbers worked out by hand."""

import math

import pytest

from rlhforge.backend.fingerprint import WeightSyncMismatch
from rlhforge.backend.sync_probe import (WeightsNotInEffect, check_probe, compare_probe, default_probe_bound,
                                         probe_prompts)


def test_the_probe_is_the_first_prompts_cut_at_the_token_budget():
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8], [9, 10]]
    assert probe_prompts(prompts, 6) == [[1, 2, 3], [5, 6, 7]]  # [4] has no scored token; the last one is cut
    assert probe_prompts(prompts, 4) == [[1, 2, 3]]  # a 1-token cut ([5]) scores nothing: left out
    assert probe_prompts(prompts, 100) == [[1, 2, 3], [5, 6, 7, 8], [9, 10]]
    assert probe_prompts([[4]], 10, fallback=lambda: [7, 8, 9]) == [[7, 8, 9]]
    with pytest.raises(ValueError, match="no prompt has 2 tokens"):
        probe_prompts([[4]], 10)


def test_bounds_follow_the_lower_precision():
    assert default_probe_bound("fp32", "fp32") == 1e-3
    assert default_probe_bound("bf16", "fp32") == default_probe_bound("fp32", "bf16") == 0.1
    assert default_probe_bound("fp16", "fp16") == 0.1
    with pytest.raises(ValueError, match="unknown precision 'int8'"):
        default_probe_bound("int8", "fp32")


def test_statistics_and_the_stop_name_the_engine_and_the_sync():
    trainer = [[-1.0, -2.0], [-3.0]]
    engines = [("vLLM engine 0", [[-1.0, -2.0], [-3.0]]),
               ("vLLM engine 1", [[-1.5, -2.0], [-2.0]])]  # |diff| = 0.5, 0, 1 -> mean 0.5, max 1
    stats = compare_probe(trainer, engines)
    assert stats == {"vLLM engine 0": (0.0, 0.0), "vLLM engine 1": (0.5, 1.0)}
    check_probe(stats, 0.5, 3)  # at the bound: passes
    with pytest.raises(WeightsNotInEffect, match=r"weight sync to version 3 did not take effect: vLLM engine 1's "
                                                 r"log-probs on the probe differ from the trainer's by 0.5 per token "
                                                 r"\(max 1\), above --train.sync_probe_bound 0.1") as err:
        check_probe(stats, 0.1, 3)
    assert "engine 0" not in str(err.value) and isinstance(err.value, WeightSyncMismatch)
    with pytest.raises(WeightsNotInEffect, match="HF engine's log-probs"):  # NaN never passes
        check_probe({"HF engine": (math.nan, math.nan)}, 1.0, 1)
    with pytest.raises(ValueError, match=r"scored \[2, 2\] probe tokens, the trainer \[2, 1\]"):
        compare_probe(trainer, [("HF engine", [[0.0, 0.0], [0.0, 0.0]])])
