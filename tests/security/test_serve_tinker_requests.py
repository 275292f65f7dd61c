"""serve-tinker under the bad-request catalogue of issue 46 (one raw keep-alive socket on 127.0.0.1): every bad body a
4xx (5000-digit integers and 100k-deep nesting were a 500 and a dropped connection), the connection still serving;
a 32 KB zstd frame that expands to 1 GiB refused with the server's RSS growing < 64 MB (it allocated 1 GiB);
50 MB bodies, mid-body disconnects and slow clients bounded."""

from __future__ import annotations

import threading
import time

import psutil
import pytest

from rlhforge.config.serve_tinker import ServeTinkerConfig
from rlhforge.net.server import ServerLimits, start_server_thread
from rlhforge.tinker_server.app import create_app
from tests.conftest import require_module
from tests.security.http_catalogue import (Raw, assert_disconnect_is_one_line, assert_large_bodies_refused,
                                           assert_slow_clients_closed, check_catalogue, common_bad_bodies,
                                           send_large)
from tests.security.tinker_helpers import KEY_A, zstd_bomb

AUTH = {"X-API-Key": KEY_A}
PROBE = ("GET", "/api/v1/healthz")


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    require_module("tinker", "pip install tinker==0.38.0 (the dev extra)")
    cfg = ServeTinkerConfig(checkpoint_dir=str(tmp_path_factory.mktemp("sec_tinker")), device="cpu",
                            model_map=(f"tiny={tiny_model_dir}",), header_timeout_s=1.0, body_timeout_s=1.0)
    with start_server_thread(create_app(cfg, (KEY_A,)), route="/api/v1/healthz", name="tinker server",
                             limits=ServerLimits(header_timeout_s=1.0)) as handle:
        yield handle


def test_bad_request_catalogue_4xx_and_connection_kept(server):
    json_cases = common_bad_bodies(lambda v: b'{"model_id": "m", "seq_id": 1, "adam_params": {"learning_rate": '
                                   + v + b"}}")
    cases = [(name, "POST", "/api/v1/optim_step", body, {"Content-Type": "application/json"})
             for name, body in json_cases]
    cases += [("wrong types", "POST", "/api/v1/optim_step", b'{"model_id": 5, "seq_id": "x"}', None),
              ("NaN temperature", "POST", "/api/v1/asample",
               b'{"prompt": {"chunks": [{"tokens": [1]}]}, "sampling_params": {"temperature": NaN}}', None),
              ("not protobuf", "POST", "/api/v1/forward_backward", b"\xff" * 64,
               {"Content-Type": "application/x-protobuf"}),
              ("not zstd", "POST", "/api/v1/forward_backward", b"plain bytes",
               {"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}),
              ("zstd bomb, size declared", "POST", "/api/v1/forward_backward", zstd_bomb(declared=True),
               {"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}),
              ("zstd bomb, size not declared", "POST", "/api/v1/forward_backward", zstd_bomb(declared=False),
               {"Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"}),
              ("wrong key", "POST", "/api/v1/create_session", b"{}", {"X-API-Key": "tml-not-a-key"})]
    seen = check_catalogue(server.port, cases, PROBE, AUTH)
    statuses = {name: status for name, (status, _) in seen.items()}
    assert statuses == {**{name: 400 for name, _ in json_cases}, "wrong types": 400, "NaN temperature": 400,
                        "not protobuf": 400, "not zstd": 400, "zstd bomb, size declared": 413,
                        "zstd bomb, size not declared": 413, "wrong key": 401}
    assert "Exceeds the limit (4300 digits)" in seen["5000-digit integer"][1]
    assert "nested too deeply" in seen["100k-deep nesting"][1]
    assert "declares 1073741824 bytes" in seen["zstd bomb, size declared"][1]
    assert "--max_zstd_ratio" in seen["zstd bomb, size not declared"][1]


@pytest.mark.parametrize("declared", [True, False])
def test_zstd_bomb_refused_with_rss_growing_under_64_mb(server, declared):
    """A 32 KB frame expanding to 1 GiB: 413, and the server process (this one: the server runs in a thread)
    grows by < 64 MB while it answers. On 89172c3 the declared-size frame was decompressed whole (1 GiB)."""
    bomb = zstd_bomb(declared=declared)
    assert len(bomb) < 33_000
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak, stop = [base], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.002)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    answers = [None] * 3

    def send(i):  # three at once, each on its own connection (89172c3: 2.4 GB RSS)
        conn = Raw(server.port)
        answers[i] = conn.request("POST", "/api/v1/forward_backward", bomb,
                                  {**AUTH, "Content-Type": "application/x-protobuf", "Content-Encoding": "zstd"})
        conn.close()

    senders = [threading.Thread(target=send, args=(i,)) for i in range(3)]
    for t in senders:
        t.start()
    for t in senders:
        t.join(60)
    stop.set()
    watcher.join()
    assert [a[0] for a in answers] == [413, 413, 413]
    assert peak[0] - base < 64 * 2**20, (peak[0] - base) / 2**20


def test_50_mb_bodies_are_4xx(server):
    """Under the default --max_request_bytes (256 MiB) 50 MB are read and refused as a bad body (400), with and
    without Content-Length; the connection then serves on."""
    out = assert_large_bodies_refused(server.port, "/api/v1/optim_step", PROBE, 256 * 2**20, AUTH)
    assert out["content-length"][0] == 400 and out["chunked"][0] == 400


def test_disconnect_mid_body_is_one_line(server, caplog):
    assert_disconnect_is_one_line(server.port, "/api/v1/optim_step", AUTH, caplog)


def test_slow_clients_get_408_and_others_are_served(server):
    assert_slow_clients_closed(server.port, "/api/v1/optim_step", PROBE, 1.0, 1.0, AUTH)


def test_chunked_body_is_counted_while_it_streams(tiny_model_dir, tmp_path):
    """A chunked body over --max_request_bytes is refused once the limit has streamed in (89172c3 read it whole
    first: 300 MB -> +280 MB RSS), and the server serves a new connection at once."""
    cfg = ServeTinkerConfig(checkpoint_dir=str(tmp_path), device="cpu", model_map=(f"tiny={tiny_model_dir}",),
                            max_request_bytes=4 << 20)
    with start_server_thread(create_app(cfg, (KEY_A,)), route="/api/v1/healthz", name="tinker server") as small:
        answer, sent, _ = send_large(small.port, "/api/v1/optim_step", 50 * 2**20, chunked=True, headers=AUTH)
        assert answer is not None and answer[0] == 413 and b"--max_request_bytes" in answer[2]
        assert sent < 25 * 2**20, sent / 2**20  # stopped near the 4 MiB limit, not after 50 MB
        assert Raw(small.port).request(*PROBE)[0] == 200
