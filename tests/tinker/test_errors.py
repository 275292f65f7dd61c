"""Refusals of ``rlhforge serve-tinker``: a wrong key is 401, a bad payload a 4xx naming the field (never a 500
or a hang), a loss without a public formula a documented 400; requests of one model run in seq_id order."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from tests.tinker.conftest import KEY, datum

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(seq_gap_timeout_s=1.0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers={"X-API-Key": KEY}, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def model_id(http):
    session = http.post("/api/v1/create_session", json={"tags": [], "sdk_version": "test"}).json()["session_id"]
    fut = http.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": "tiny",
                                                  "lora_config": {"rank": 2}}).json()
    assert "error" not in _result(http, fut["request_id"])
    return fut["model_id"]


def _result(http, request_id):
    r = http.post("/api/v1/retrieve_future", json={"request_id": request_id})
    assert r.status_code == 200, r.text
    return r.json()


def _proto(tinker, model_id, seq_id, data, loss_fn="cross_entropy", config=None):
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
        data=data, loss_fn=loss_fn, loss_fn_config=config), model_id=model_id, seq_id=seq_id)
    return forward_backward_request_to_proto(req).SerializeToString()


def _fwdbwd(http, body):
    return http.post("/api/v1/forward_backward", content=body, headers={"Content-Type": "application/x-protobuf"})


def test_wrong_or_missing_key_is_401(server, http):
    for headers in ({"X-API-Key": "tml-not-the-key"}, {}):
        r = httpx.post(f"{server.base_url}/api/v1/create_session", json={"tags": []}, headers=headers)
        assert r.status_code == 401 and "X-API-Key" in r.json()["detail"]
    assert httpx.get(f"{server.base_url}/api/v1/healthz").json() == {"status": "ok"}


def test_sdk_with_wrong_key_fails_fast(server, tinker, monkeypatch):
    monkeypatch.setenv("TINKER_BASE_URL", server.base_url)
    monkeypatch.setenv("TINKER_API_KEY", "tml-wrong-key-0000")
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient().create_lora_training_client(base_model="tiny", rank=2).result(timeout=60)


@pytest.mark.parametrize("loss_fn, inputs, field", [
    ("cross_entropy", {"target_tokens": [3, 4, 5]}, "data[0].loss_fn_inputs.weights"),
    ("cross_entropy", {"target_tokens": [3, 4], "weights": [1.0, 1.0]}, "data[0].loss_fn_inputs.target_tokens"),
    ("importance_sampling", {"target_tokens": [3, 4, 5], "logprobs": [-1.0] * 3}, "data[0].loss_fn_inputs.advantages"),
    ("cross_entropy", {"target_tokens": [3, 4, 5], "weights": [1.0, float("nan"), 1.0]},
     "data[0].loss_fn_inputs.weights"),
    ("cross_entropy", {"target_tokens": [3, 4, 99999], "weights": [1.0] * 3}, "data[0].loss_fn_inputs.target_tokens"),
    ("cispo", {"target_tokens": [3, 4, 5], "advantages": [1.0] * 3}, "data[0].loss_fn_inputs.logprobs"),
    ("gspo", {"target_tokens": [3, 4, 5], "logprobs": [-1.0] * 3, "advantages": [1.0] * 3},
     "data[0].loss_fn_inputs.sequence_ratio_mask"),
    ("stable_reinforce", {"target_tokens": [3, 4, 5]}, "loss_fn"),
])
def test_bad_forward_backward_names_the_field(tinker, http, model_id, loss_fn, inputs, field):
    from tinker import types

    d = types.Datum(model_input=types.ModelInput.from_ints([2, 3, 4]), loss_fn_inputs=inputs)
    r = _fwdbwd(http, _proto(tinker, model_id, 1000, [d], loss_fn))
    assert r.status_code == 400, r.text
    assert r.json()["detail"].startswith(field + ":"), r.json()


@pytest.mark.parametrize("path, body, status, field", [
    ("/api/v1/optim_step", {"model_id": "M", "seq_id": 1000, "adam_params": {"learning_rate": -1.0}}, 400,
     "adam_params.learning_rate"),
    ("/api/v1/optim_step", {"model_id": "M", "seq_id": 0, "adam_params": {}}, 400, "seq_id"),
    ("/api/v1/optim_step", {"model_id": "nope", "seq_id": 1000, "adam_params": {}}, 404, "model_id"),
    ("/api/v1/create_model", {"session_id": "s", "model_seq_id": 0, "base_model": "Qwen/Qwen3-8B",
                              "lora_config": {"rank": 4}}, 400, "base_model"),
    ("/api/v1/create_model", {"session_id": "s", "model_seq_id": 1, "base_model": "tiny",
                              "lora_config": {"rank": 0}}, 400, "lora_config.rank"),
    ("/api/v1/save_weights", {"model_id": "M", "seq_id": 1000, "path": "../../etc"}, 400, "path"),
    ("/api/v1/load_weights", {"model_id": "M", "seq_id": 1000, "path": "tinker://x/weights/none",
                              "optimizer": False}, 404, "path"),
    ("/api/v1/asample", {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
                         "sampling_params": {"max_tokens": 0}, "base_model": "tiny"}, 400, "sampling_params.max_tokens"),
    ("/api/v1/asample", {"prompt": {"chunks": []}, "sampling_params": {}, "base_model": "tiny"}, 400, "prompt"),
    ("/api/v1/asample", {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, -2]}]}, "sampling_params": {},
                         "base_model": "tiny"}, 400, "prompt"),
    ("/api/v1/retrieve_future", {"request_id": "req-unknown"}, 404, "request_id"),
    ("/api/v1/get_info", {}, 400, "model_id"),
])
def test_bad_json_names_the_field(http, model_id, path, body, status, field):
    body = {k: (model_id if v == "M" else v) for k, v in body.items()}
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["detail"].startswith(field + ":"), r.json()


def test_garbage_bodies_are_400(http):
    r = _fwdbwd(http, b"\xff\x00 not a protobuf")
    assert r.status_code == 400 and r.json()["detail"].startswith("body:")
    r = http.post("/api/v1/forward_backward", content=b"x", headers={"Content-Type": "application/x-protobuf",
                                                                     "Content-Encoding": "zstd"})
    assert r.status_code == 400 and r.json()["detail"].startswith("body:")
    r = http.post("/api/v1/optim_step", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["detail"].startswith("body:")


def test_requests_run_in_seq_id_order(tinker, http, model_id):
    """seq_id 2 (an optimizer step) sent before seq_id 1 (forward_backward) waits for it; a repeated seq_id gets
    the first request's future; a gap is skipped after --seq_gap_timeout_s (1 s here) instead of hanging."""
    ids = [5, 9, 17, 33, 65, 129]
    first = _fwdbwd(http, _proto(tinker, model_id, 1, [datum(tinker, ids)]))
    assert first.status_code == 200
    _result(http, first.json()["request_id"])
    step = http.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 3,
                                                 "adam_params": {"learning_rate": 0.05}}).json()
    fb = _fwdbwd(http, _proto(tinker, model_id, 2, [datum(tinker, ids)])).json()
    again = _fwdbwd(http, _proto(tinker, model_id, 2, [datum(tinker, ids)])).json()
    assert again["request_id"] == fb["request_id"]
    # had the step run before seq_id 2, it would have found no gradient (norm 0)
    assert _result(http, step["request_id"])["metrics"]["grad_norm:mean"] > 0
    probe = _fwdbwd(http, _proto(tinker, model_id, 4, [datum(tinker, ids)])).json()
    assert _result(http, probe["request_id"]) != {}
    stale = _fwdbwd(http, _proto(tinker, model_id, 1, [datum(tinker, ids)]))
    assert stale.status_code == 200 and stale.json()["request_id"] == first.json()["request_id"]
    # a gap (seq_id 5 never sent): seq_id 6 still runs, after the timeout
    late = http.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 6,
                                                 "adam_params": {"learning_rate": 0.0}}).json()
    assert "metrics" in _result(http, late["request_id"])


def test_ppo_loss_is_the_clipped_formula(tinker, http, model_id):
    """forward with loss_fn=ppo: loss:sum = -sum(min(r A, clip(r, lo, hi) A)), r = exp(logp - q), on the
    log-probs the server returns (r ~ 0.4 here: the clip binds where A < 0)."""
    import torch

    ids = [7, 11, 13, 17, 19, 23, 29]
    n = len(ids) - 1
    adv = [1.0, -1.0, 2.0, -0.5, 0.0, 1.5]
    body = _proto(tinker, model_id, 50, [datum(tinker, ids, logprobs=[-6.0] * n, advantages=adv)],
                  "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})
    r = http.post("/api/v1/forward", content=body, headers={"Content-Type": "application/x-protobuf"})
    assert r.status_code == 200, r.text
    res = _result(http, r.json()["request_id"])  # JSON (no Accept: protobuf)
    logp = torch.tensor(res["loss_fn_outputs"][0]["logprobs"]["data"])
    ratio, a = torch.exp(logp + 6.0), torch.tensor(adv)
    expected = -torch.minimum(ratio * a, ratio.clamp(0.9, 1.1) * a).sum()
    assert (ratio < 0.9).any() and (ratio * a != torch.minimum(ratio * a, ratio.clamp(0.9, 1.1) * a)).any()
    assert res["metrics"]["loss:sum"] == pytest.approx(float(expected), rel=1e-5)
    bad = _fwdbwd(http, _proto(tinker, model_id, 60, [datum(tinker, ids, logprobs=[-1.0] * n, advantages=[0.0] * n)],
                               "ppo", {"clip_low_threshold": 1.5}))
    assert bad.status_code == 400 and bad.json()["detail"].startswith("loss_fn_config.clip_low_threshold:")


def test_cli_startup_errors_exit_2_naming_the_flag(tmp_path, capsys):
    from rlhforge.cli.main import main

    for argv, flag in ((["--model_map", f"x={tmp_path}/missing"], "--model_map"),
                       (["--api_key", "sk-not-tinker-form"], "--api_key"),
                       (["--port", "0"], "--port")):
        with pytest.raises(SystemExit) as exit_info:
            main(["serve-tinker", *argv])
        assert exit_info.value.code == 2
        assert flag in capsys.readouterr().err
