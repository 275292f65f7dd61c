"""Weight fingerprints (rlhforge.backend.fingerprint): the checksum equals an independent numpy
recomputation and does not depend on chunking; the check names the engine whose weights differ from
what was sent, or whose parameters did not change when new weights arrived; the HF engine's silent
non-load is caught by the trainer's always-on check."""

import numpy as np
import pytest
import torch

import rlhforge.backend.fingerprint as fpmod
from rlhforge.backend.fingerprint import (WeightSyncMismatch, check_engine_sync, check_sync_reports, params_checksum,
                                          state_fingerprint, tensor_checksum)


def _numpy_checksum(t: torch.Tensor) -> tuple[int, int]:
    raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    words = np.frombuffer(raw, dtype="<i4" if len(raw) % 4 == 0 else ("<i2" if len(raw) % 2 == 0 else "u1"))
    s1 = sum(int(w) for w in words) % 2**64
    s2 = sum(int(w) * (1 + i % 65521) for i, w in enumerate(words)) % 2**64
    return s1, s2


@pytest.mark.parametrize("dtype,shape", [(torch.float32, (7, 13)), (torch.bfloat16, (5, 3)), (torch.bfloat16, (3,)),
                                         (torch.uint8, (5,)), (torch.int64, (4, 2))])
def test_checksum_equals_an_independent_recomputation(dtype, shape):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(shape, generator=g) * 1000).to(dtype)
    assert tensor_checksum(t) == _numpy_checksum(t)


def test_checksum_does_not_depend_on_the_chunking_and_sees_swaps(monkeypatch):
    t = torch.randn(1000, 37, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    whole = tensor_checksum(t)
    monkeypatch.setattr(fpmod, "_CHUNK", 7)
    assert tensor_checksum(t) == whole
    swapped = t.clone().view(-1)
    swapped[[0, 1]] = swapped[[1, 0]]
    _, s2 = tensor_checksum(swapped.view_as(t))
    assert s2 != whole[1]  # a moved element changes the weighted sum (the plain one may not)


def test_fingerprint_is_order_free_and_sees_name_dtype_and_value_changes():
    a, b = torch.ones(3), torch.arange(4.0)
    base = state_fingerprint({"a": a, "b": b})
    assert state_fingerprint([("b", b), ("a", a)]) == base
    assert state_fingerprint({"a": a, "c": b}) != base
    assert state_fingerprint({"a": a.double(), "b": b}) != base
    assert state_fingerprint({"a": a, "b": b + 1e-6}) != base
    assert state_fingerprint({"a": a}) != base  # a tensor missing


def _rep(fp, previous=None, changed=True, n=2):
    return {"fingerprint": fp, "previous": previous, "params_changed": changed, "tensors": n}


def test_check_names_the_engine_and_worker_that_differ():
    check_sync_reports("f1", [("vLLM engine 0", [_rep("f1")]), ("vLLM engine 1", [_rep("f1"), _rep("f1")])], 3)
    with pytest.raises(WeightSyncMismatch, match=r"version 3 .*vLLM engine 1 worker 1 received weights with "
                                                 r"fingerprint f0 \(2 tensors\), the trainer sent f1"):
        check_sync_reports("f1", [("vLLM engine 0", [_rep("f1")]), ("vLLM engine 1", [_rep("f1"), _rep("f0")])], 3)
    with pytest.raises(WeightSyncMismatch, match="vLLM engine 0 received weights with fingerprint None"):
        check_sync_reports("f1", [("vLLM engine 0", [{}])], 1)


def test_new_weights_that_leave_the_parameters_unchanged_stop_the_run():
    # the first sync of a run loads the weights the engine started with: unchanged parameters are fine
    check_sync_reports("f1", [("e", [_rep("f1", previous=None, changed=False)])], 0)
    # the same weights again (a step with no update): fine
    check_sync_reports("f1", [("e", [_rep("f1", previous="f1", changed=False)])], 1)
    with pytest.raises(WeightSyncMismatch, match="e received new weights .* but its parameters did not change"):
        check_sync_reports("f2", [("e", [_rep("f2", previous="f1", changed=False)])], 2)


def test_hf_engine_reports_its_loads_and_a_silent_non_load_is_caught(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhforge.rollout.hf_engine import HFEngine

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    engine = HFEngine.from_model(model, tok)
    state = {k: v + 0.01 for k, v in model.state_dict().items()}
    before = params_checksum(engine.model)
    engine.update_weights(state)
    [(name, [rep])] = engine.sync_reports()
    assert rep["fingerprint"] == state_fingerprint(state) and rep["tensors"] == len(state)
    assert rep["params_changed"] and params_checksum(engine.model) != before
    check_engine_sync(engine, state_fingerprint(state), 1)

    # a loader that silently keeps the old values (as a name mapping that matches nothing would)
    engine.model.register_load_state_dict_pre_hook(
        lambda module, sd, prefix, *a: sd.update({k: v.clone() for k, v in module.state_dict().items() if k in sd}))
    newer = {k: v + 0.02 for k, v in model.state_dict().items()}
    engine.update_weights(newer)
    with pytest.raises(WeightSyncMismatch, match="HF engine received new weights"):
        check_engine_sync(engine, state_fingerprint(newer), 2)
