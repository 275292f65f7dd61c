"""Live endpoint files: changes are picked up, bad edits keep the last good list, errors name lines."""

from __future__ import annotations

import logging
import os

import pytest

from rlhforge.net.endpoints import (
    EndpointSelector,
    EndpointsFile,
    EndpointsFileError,
    StaticEndpoints,
    parse_endpoints,
)


def write(path, text):
    """Atomic replace, as the docs recommend (new inode, so the change is always noticed)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_parse_lines_comments_and_json():
    text = ("# reward servers\n\nhttp://rm-1:5000/get_reward\n"
            "  https://10.0.0.7:5000/x   # moved on Tuesday\n"
            "http://h:1/page#frag\n")
    assert parse_endpoints(text) == ["http://rm-1:5000/get_reward", "https://10.0.0.7:5000/x", "http://h:1/page#frag"]
    assert parse_endpoints('["http://a:1", " https://b "]') == ["http://a:1", "https://b"]


@pytest.mark.parametrize("text, message", [
    ("http://ok:1\nftp://files:21\n", r"f\.txt:2: 'ftp://files:21' is not an http:// or https:// URL"),
    ("http://ok:1\n\nlocalhost:8000\n", r"f\.txt:3: 'localhost:8000' is not an http"),
    ("http://ok:1 http://two:2\n", r"f\.txt:1: .* \(contains whitespace\)"),
    ("http://host:99999\n", r"f\.txt:1: .* invalid port"),
    ("http://:80/x\n", r"f\.txt:1: .* has no host"),
    ("# only comments\n\n", r"f\.txt: no endpoints listed"),
    ('["http://a:1", 5]', r"f\.txt: item 1 is 5, not a URL string"),
    ('["http://a:1",', r"f\.txt:1: invalid JSON"),
])
def test_invalid_lines_are_rejected_naming_the_line(text, message):
    with pytest.raises(EndpointsFileError, match=message):
        parse_endpoints(text, "f.txt")


def test_first_load_errors_name_the_file(tmp_path):
    with pytest.raises(EndpointsFileError, match=r"endpoints file .*missing\.txt does not exist"):
        EndpointsFile(tmp_path / "missing.txt")
    bad = tmp_path / "bad.txt"
    bad.write_text("http://a:1\nnot a url\n")
    with pytest.raises(EndpointsFileError, match=r"bad\.txt:2"):
        EndpointsFile(bad)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(EndpointsFileError, match=r"empty\.txt: no endpoints"):
        EndpointsFile(empty)


def test_changes_are_picked_up(tmp_path):
    path = tmp_path / "services.txt"
    write(path, "http://a:1\nhttp://b:2\n")
    endpoints = EndpointsFile(path)
    assert endpoints.current() == ["http://a:1", "http://b:2"]
    assert endpoints.current() == ["http://a:1", "http://b:2"] and endpoints.reloads == 0  # unchanged: no re-read
    write(path, "http://c:3\n")
    assert endpoints.current() == ["http://c:3"]
    # an in-place edit to a file of the same size is noticed through the modification time
    path.write_text("http://d:3\n")
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert endpoints.current() == ["http://d:3"]
    write(path, '["https://e:4", "https://f:5"]')
    assert endpoints.current() == ["https://e:4", "https://f:5"]


def test_bad_or_empty_edits_keep_the_last_good_list_and_warn_once(tmp_path, caplog):
    path = tmp_path / "services.txt"
    write(path, "http://a:1\n")
    endpoints = EndpointsFile(path)
    caplog.set_level(logging.WARNING, logger="rlhforge.net.endpoints")

    write(path, "http://a:1\nftp://b:2\n")
    for _ in range(3):
        assert endpoints.current() == ["http://a:1"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "services.txt:2" in warnings[0] and "keeping the last good list" in warnings[0]
    assert "services.txt:2" in endpoints.last_error

    write(path, "")  # another change: another warning, once
    assert endpoints.current() == ["http://a:1"] and endpoints.current() == ["http://a:1"]
    os.remove(path)
    assert endpoints.current() == ["http://a:1"] and endpoints.current() == ["http://a:1"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3 and "no endpoints" in warnings[1] and "disappeared" in warnings[2]

    write(path, "http://new:9\n")
    assert endpoints.current() == ["http://new:9"] and endpoints.last_error is None


def test_round_robin_follows_the_file(tmp_path):
    path = tmp_path / "services.txt"
    write(path, "http://a:1\nhttp://b:2\nhttp://c:3\n")
    pick = EndpointSelector(EndpointsFile(path))
    assert [pick() for _ in range(4)] == ["http://a:1", "http://b:2", "http://c:3", "http://a:1"]
    write(path, "http://x:1\nhttp://y:2\n")
    assert {pick() for _ in range(4)} == {"http://x:1", "http://y:2"}


def test_least_recently_used_and_failures():
    pick = EndpointSelector(["http://a:1", "http://b:2", "http://c:3"], "least_recently_used", cooldown_s=60)
    assert [pick() for _ in range(3)] == ["http://a:1", "http://b:2", "http://c:3"]
    assert pick() == "http://a:1"
    pick.report_failure("http://b:2")
    assert [pick() for _ in range(4)] == ["http://c:3", "http://a:1", "http://c:3", "http://a:1"]
    pick.report_success("http://b:2")
    assert pick() == "http://b:2"
    only = EndpointSelector(StaticEndpoints(["http://solo:1"]))
    only.report_failure("http://solo:1")
    assert only() == "http://solo:1"  # all cooling down: still returns one
    with pytest.raises(ValueError, match="strategy"):
        EndpointSelector(["http://a:1"], "random")


def test_remote_reward_follows_a_live_endpoints_file(tmp_path):
    """`--reward.remote_url endpoints:FILE`: moving the server means editing the file, not restarting."""
    import asyncio
    import json as _json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from rlhforge.rewards.base import RewardBatch
    from rlhforge.rewards.sources import build_reward_source

    def serve(value):
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                n = len(_json.loads(self.rfile.read(int(self.headers["Content-Length"])))["query"])
                body = _json.dumps({"rewards": [value] * n, "scores": [value] * n}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server, f"http://127.0.0.1:{server.server_address[1]}/get_reward"

    (a, url_a), (b, url_b) = serve(1.0), serve(2.0)
    listing = tmp_path / "reward_servers.txt"
    listing.write_text(f"# the reward servers\n{url_a}\n")

    from types import SimpleNamespace

    from rlhforge.config.rl import RewardConfig

    source = build_reward_source(SimpleNamespace(reward=RewardConfig(remote_url=f"endpoints:{listing}")))
    batch = RewardBatch(queries=["q1", "q2"], prompts=["p1", "p2"], responses=["r1", "r2"], labels=["l1", "l2"],
                        datasources=[None, None])
    try:
        assert asyncio.run(source(batch))["rewards"] == [1.0, 1.0]
        listing.write_text(f"{url_b}\n")
        assert asyncio.run(source(batch))["rewards"] == [2.0, 2.0]
        listing.write_text("not a url\n")  # a bad edit keeps the last good list
        assert asyncio.run(source(batch))["rewards"] == [2.0, 2.0]
        assert "reward servers listed in" in source.name
    finally:
        a.shutdown()
        b.shutdown()
