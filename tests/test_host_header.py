"""The Host a request names (issue 68, cause 7): bound to loopback, serve answers loopback names only (and those
--allowed-hosts adds), so that a page on another site cannot reach it through DNS rebinding (its own name resolved to
127.0.0.1, sent as Host); bound elsewhere, any Host unless names are given."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from clover_gguf.errors import UserError
from clover_gguf.serve.auth import allowed_hosts, host_allowed

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from clover_gguf.serve import create_app  # noqa: E402
from test_server import SlowRuntime, _Server  # noqa: E402


def test_which_hosts_are_answered_follows_the_bind_address():
    assert allowed_hosts("127.0.0.1", None) == frozenset()  # loopback names alone
    assert allowed_hosts("::1", "") == frozenset() and allowed_hosts("localhost", None) == frozenset()
    assert allowed_hosts("0.0.0.0", None) is None  # bound elsewhere: any
    assert allowed_hosts("127.0.0.1", "*") is None and allowed_hosts("127.0.0.1", "box.lan, *") is None
    assert allowed_hosts("127.0.0.1", " Box.LAN ,[fd00::1]") == {"box.lan", "fd00::1"}
    assert allowed_hosts("0.0.0.0", "box.lan") == {"box.lan"}
    for bad in ("http://x", "a b", "user@x"):
        with pytest.raises(UserError, match="--allowed-hosts"):
            allowed_hosts("127.0.0.1", bad)


@pytest.mark.parametrize("host,ok", [
    ("127.0.0.1:8080", True), ("127.0.0.1", True), ("127.8.9.10:1", True), ("localhost:8080", True),
    ("LOCALHOST", True), ("app.localhost:8080", True), ("[::1]:8080", True), ("[::1]", True), ("localhost.", True),
    ("evil.example:8080", False), ("evil.example", False), ("127.0.0.1.evil.example", False),
    ("localhost.evil.example", False), ("10.0.0.1:8080", False), ("[fd00::1]:80", False), ("", False),
    ("box.lan:8080", False),
])
def test_a_host_header_is_a_loopback_name_or_an_allowed_one(host, ok):
    assert host_allowed(host, frozenset()) is ok
    given = frozenset({"evil.example", "fd00::1"})
    assert host_allowed(host, given) is (ok or host in ("evil.example:8080", "evil.example", "[fd00::1]:80"))


@pytest.fixture()
def loopback_server():
    s = _Server(create_app(SlowRuntime, mode="ar", parallel=1, hosts=frozenset({"box.lan"})))
    yield s
    s.stop()


def test_a_rebound_name_gets_a_403_on_every_path(loopback_server):
    """`Host: evil.example:8080` was a 200 on /v1/chat/completions and /slots."""
    s = loopback_server
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for method, path, body in (("POST", "/v1/chat/completions", chat), ("GET", "/slots", None),
                               ("GET", "/health", None), ("GET", "/", None), ("GET", "/v1/models", None)):
        r = httpx.request(method, s.base + path, json=body, headers={"Host": "evil.example:8080"}, timeout=30)
        assert r.status_code == 403, (path, r.text)
        err = r.json()["error"]
        assert err["code"] == "host_not_allowed" and "--allowed-hosts" in err["message"], err
    for host in (f"127.0.0.1:{s.port}", f"localhost:{s.port}", "box.lan:8080"):  # loopback names, the one given
        r = httpx.post(s.base + "/v1/chat/completions", json=chat, headers={"Host": host}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "tok tok", (host, r.text)


def test_bad_allowed_hosts_is_one_line_before_the_model_loads(tmp_path):
    p = subprocess.run([sys.executable, "-m", "clover_gguf", "serve", os.fspath(tmp_path / "none.gguf"),
                        "--allowed-hosts", "http://evil.example"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "--allowed-hosts" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
