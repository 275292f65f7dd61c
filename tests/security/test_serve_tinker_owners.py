"""serve-tinker owners (issue 46, defects 1, 2, 9, 11): two keys are two tenants that cannot see each other's
sessions, models, checkpoints, samplers or futures (404, the same answer as for an id that does not exist); two
sessions of one key: the second may resume the first's checkpoint but a checkpoint path no longer names the live
model; a seq_id far ahead is a 400 at once; a seq_id reused with other content is a 409; a refused request
is followed at once by the next one (it waited for the 120 s gap timer)."""

from __future__ import annotations

import time

import pytest

from rlhforge.config.parsing import ConfigError
from rlhforge.config.serve_tinker import ServeTinkerConfig, read_keys_file
from rlhforge.net.server import start_server_thread
from rlhforge.tinker_server.app import create_app
from tests.conftest import require_module
from tests.security.tinker_helpers import KEY_A, KEY_B, client, model, optim, result, save, session

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tmp_path_factory.mktemp("owners_ckpt")


@pytest.fixture(scope="module")
def server(tiny_model_dir, ckpt):
    require_module("tinker", "pip install tinker==0.38.0 (the dev extra)")
    cfg = ServeTinkerConfig(checkpoint_dir=str(ckpt), device="cpu", model_map=(f"tiny={tiny_model_dir}",),
                            expose_base_folders="off")  # seq_gap_timeout_s stays 120 s
    with start_server_thread(create_app(cfg, (KEY_A,), {KEY_B: "bob"}), route="/api/v1/healthz",
                             name="tinker server") as handle:
        yield handle


@pytest.fixture(scope="module")
def alice(server):
    with client(server, KEY_A) as http:
        sid = session(http)
        mid = model(http, sid)
        path = save(http, mid, 1, "first")
        yield http, sid, mid, path


def _same_404(response, unknown_response, secret: str, stand_in: str):
    assert response.status_code == 404 == unknown_response.status_code, (response.text, unknown_response.text)
    assert response.json()["detail"].replace(secret, "ID") == unknown_response.json()["detail"].replace(stand_in, "ID")


def test_another_tenant_sees_nothing(server, alice, ckpt):
    http_a, sid, mid, path = alice
    rid = optim(http_a, mid, 2).json()["request_id"]
    assert "metrics" in result(http_a, rid)
    with client(server, KEY_B) as bob:
        bob_sid = session(bob)
        _same_404(bob.post("/api/v1/get_info", json={"model_id": mid}),
                  bob.post("/api/v1/get_info", json={"model_id": "nope:train:0"}), mid, "nope:train:0")
        _same_404(optim(bob, mid, 3), optim(bob, "nope:train:0", 3), mid, "nope:train:0")
        _same_404(bob.post("/api/v1/retrieve_future", json={"request_id": rid}),
                  bob.post("/api/v1/retrieve_future", json={"request_id": "req-0"}), rid, "req-0")
        # a session id of Alice's is, for Bob, an id like any other: adopted as a session of his own (as after a
        # restart), which holds none of Alice's models; finishing it finishes nothing of Alice's
        assert bob.post("/api/v1/session_heartbeat", json={"session_id": sid}).status_code == 200
        clash = bob.post("/api/v1/create_model", json={"session_id": sid, "model_seq_id": 0, "base_model": "tiny",
                                                       "lora_config": {"rank": 2}})
        assert clash.status_code == 200 and clash.json()["model_id"] == mid  # the same id, a model of Bob's
        assert bob.post(f"/api/v1/sessions/{sid}/finish").status_code == 200
        assert "error" not in result(bob, clash.json()["request_id"])
        # Alice's checkpoint is not Bob's: resuming it, or sampling from it, is "no checkpoint"
        load = bob.post("/api/v1/load_weights", json={"session_id": bob_sid, "model_seq_id": 0, "path": path,
                                                       "optimizer": False})
        assert load.status_code == 404 and path in load.json()["detail"], load.text
        sample = bob.post("/api/v1/asample", json={"model_path": path, "prompt": {"chunks": [{"tokens": [1, 2]}]},
                                                    "sampling_params": {"max_tokens": 1}})
        assert sample.status_code == 404, sample.text
        # and no answer names a server folder
        for answer in (load, sample):
            assert str(ckpt) not in answer.text
    assert "metrics" in result(http_a, optim(http_a, mid, 3).json()["request_id"])  # Alice unaffected
    assert (ckpt / path.removeprefix("tinker://")).is_dir()  # the default tenant keeps CHECKPOINT_DIR itself


def test_second_session_of_one_key_resumes_but_cannot_drive(server, alice):
    http_a, sid, mid, path = alice
    run = path.removeprefix("tinker://").split("/")[0]
    assert sid not in path and mid not in path  # the path names a run, not the live model (it was its model id)
    with client(server, KEY_A) as other:
        other_sid = session(other)
        # what 89172c3 allowed: the model id read off the path drives the live model
        assert optim(other, run, 100).status_code == 404
        assert other.post("/api/v1/load_weights", json={"model_id": run, "seq_id": 100, "path": path,
                                                         "optimizer": False}).status_code == 404
        assert other.post("/api/v1/save_weights", json={"model_id": run, "seq_id": 100,
                                                         "path": "first"}).status_code == 404
        # resuming the checkpoint into its own model is allowed (as the SDK's create_training_client_from_state)
        load = other.post("/api/v1/load_weights", json={"session_id": other_sid, "model_seq_id": 0, "path": path,
                                                         "optimizer": True})
        assert load.status_code == 200, load.text
        resumed = load.json()["model_id"]
        assert resumed.startswith(other_sid) and "error" not in result(other, load.json()["request_id"])
        resumed_path = save(other, resumed, 1, "first")  # same name, its own run: nothing of Alice's overwritten
        assert resumed_path != path


def test_seq_id_window_and_content_keyed_dedup(server, alice):
    http_a, sid, mid, _ = alice
    fresh = model(http_a, sid, seq=5)
    started = time.monotonic()
    far = optim(http_a, fresh, 10**30)
    assert far.status_code == 400 and "too far ahead" in far.json()["detail"]
    first = optim(http_a, fresh, 1, lr=0.0)
    assert first.status_code == 200
    assert "metrics" in result(http_a, first.json()["request_id"], limit_s=20)
    assert time.monotonic() - started < 20  # the wild seq_id neither ran nor blocked the model
    again = optim(http_a, fresh, 1, lr=0.0)  # an SDK retry: the same future
    assert again.status_code == 200 and again.json()["request_id"] == first.json()["request_id"]
    other = optim(http_a, fresh, 1, lr=0.5)  # another request under a used seq_id
    assert other.status_code == 409 and "different request" in other.json()["detail"]


def test_refused_request_is_followed_at_once(server, alice):
    http_a, sid, _, _ = alice
    fresh = model(http_a, sid, seq=6)
    refused = http_a.post("/api/v1/optim_step", json={"model_id": fresh, "seq_id": 1,
                                                     "adam_params": {"learning_rate": -1.0}})
    assert refused.status_code == 400 and "adam_params.learning_rate" in refused.json()["detail"]
    started = time.monotonic()
    nxt = optim(http_a, fresh, 2)
    assert nxt.status_code == 200
    assert "metrics" in result(http_a, nxt.json()["request_id"], limit_s=30)
    assert time.monotonic() - started < 10, "waited for the seq_id gap timer"
    again = http_a.post("/api/v1/optim_step", json={"model_id": fresh, "seq_id": 1,
                                                   "adam_params": {"learning_rate": -1.0}})
    assert again.status_code == 400 and again.json() == refused.json()


def test_no_server_folder_in_answers(server, alice, ckpt, tiny_model_dir):
    http_a, _, mid, _ = alice
    missing = http_a.post("/api/v1/load_weights", json={"model_id": mid, "seq_id": 50,
                                                         "path": "tinker://run-0/weights/none", "optimizer": False})
    assert missing.status_code == 404 and "tinker://run-0/weights/none" in missing.json()["detail"]
    assert str(ckpt) not in missing.text
    # the keys-file tenants' folders sit beside the default tenant's runs: not reachable as a RUN name
    (ckpt / "tenant-bob" / "weights" / "x").mkdir(parents=True, exist_ok=True)
    (ckpt / "tenant-bob" / "weights" / "x" / "meta.json").write_text("{}")
    beside = http_a.post("/api/v1/load_weights", json={"model_id": mid, "seq_id": 51,
                                                        "path": "tinker://tenant-bob/weights/x", "optimizer": False})
    assert beside.status_code == 404, beside.text
    info = http_a.post("/api/v1/get_info", json={"model_id": mid}).json()
    assert info["model_data"]["tokenizer_id"] == "tiny" and str(tiny_model_dir) not in str(info)


def test_keys_file(tmp_path):
    good = tmp_path / "keys"
    good.write_text("# tenants\nalice tml-aaaa-1111\ntml-bbbb-2222   # unnamed\n\n")
    keys = read_keys_file(str(good))
    assert keys["tml-aaaa-1111"] == "alice" and keys["tml-bbbb-2222"].startswith("key-")
    for text, say in (("a b c\n", "line 1"), ("alice sk-nope\n", "tml-"), ("al/ice tml-aaaa-1111\n", "tenant name"),
                      ("a tml-aaaa-1111\nb tml-aaaa-1111\n", "already listed"), ("# none\n", "no keys")):
        bad = tmp_path / "bad"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=say):
            read_keys_file(str(bad))
    with pytest.raises(ConfigError, match="also given by --api_key"):
        ServeTinkerConfig(api_key=("tml-aaaa-1111",), api_keys_file=str(good)).validate()
