"""llama.cpp's RPC backend: the bundled model's layers on two `ggml-rpc-server`s on 127.0.0.1 give the local
greedy text in every mode and the local block-pass logits. The servers run the same CPU kernels as this process,
so exact settings (flash attention off, F32 K/V) leave nothing but the split to differ.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

from clover_gguf.errors import UserError
from clover_gguf.llama_context import LlamaContext
from clover_gguf.offload import Offload
from clover_gguf.rpc import parse_endpoints
from clover_gguf.runtime import CloverRuntime
from clover_gguf.testing.rpc_servers import rpc_servers

TOL = 1e-5
MODES = ("ar", "diffusion", "draft-self")


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="module")
def servers():
    with rpc_servers(2, threads=1) as endpoints:
        yield endpoints


def _cli(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clover_gguf", *map(str, args)], capture_output=True, text=True,
                          timeout=600, env=env, stdin=subprocess.DEVNULL)


def _assert_on_servers(log: str, servers) -> None:
    """llama.cpp's load log: every layer, the output layer too, on a server; weights on each server."""
    assert re.search(r"offloaded (\d+)/\1 layers", log) and "assigned to device CPU" not in log, log[-3000:]
    for ep in servers:
        assert re.search(rf"RPC\d+\[{re.escape(ep)}\] model buffer size", log), log[-3000:]


def test_block_pass_and_causal_logits_over_rpc(bundled_gguf, servers, monkeypatch, capfd):
    rng = np.random.default_rng(3)
    prefix = rng.integers(0, 300, size=27).tolist()
    with LlamaContext(bundled_gguf, n_ctx=256, exact=True, n_threads=2) as ctx:
        mask = int(ctx.meta("tokenizer.ggml.mask_token_id"))
        block = [mask if m else t for m, t in zip(rng.random(32) < 0.6, rng.integers(0, 300, size=32).tolist())]
    got = {}
    for where, kw in (("local", {}), ("rpc", {"rpc": servers, "offload": Offload(gpu_layers="all")})):
        monkeypatch.setenv("CLOVER_GGUF_LLAMA_LOG", "1")
        capfd.readouterr()
        with LlamaContext(bundled_gguf, n_ctx=256, exact=True, n_threads=2, **kw) as ctx:
            monkeypatch.delenv("CLOVER_GGUF_LLAMA_LOG")
            if kw:
                _assert_on_servers(capfd.readouterr().err, servers)
            causal = ctx.decode(prefix, 0, 0)
            got[where] = (causal, ctx.block(block, len(prefix)), ctx.decode(block[:3], len(prefix), 0))
    for name, a, b in zip(("causal", "block pass", "after the block"), got["rpc"], got["local"]):
        err = rel_err(a, b)
        print(f"{name}: relative logit difference rpc vs local {err:.3e}")
        assert err <= TOL, name


def test_greedy_text_over_rpc_in_every_mode(bundled_gguf, bundled_eval, servers):
    prompts = [r["prompt"] for r in bundled_eval[::37]][:3]
    texts = {}
    for where, kw in (("local", {}), ("rpc", {"rpc": servers, "offload": Offload(gpu_layers="all")})):
        with CloverRuntime(bundled_gguf, n_ctx=256, exact=True, n_threads=2, **kw) as rt:
            texts[where] = {(m, p): rt.generate(p, mode=m, max_new_tokens=48).raw for m in MODES for p in prompts}
    assert texts["rpc"] == texts["local"]
    assert all(t for t in texts["local"].values())


def test_generate_cli_puts_the_layers_on_the_servers(bundled_gguf, bundled_eval, servers):
    row = bundled_eval[0]
    env = dict(os.environ, CLOVER_GGUF_LLAMA_LOG="1")
    p = _cli("generate", bundled_gguf, "-p", row["prompt"], "--mode", "diffusion", "--json", "--rpc",
             ",".join(servers), env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert row["answer"] in json.loads(p.stdout)["text"]
    _assert_on_servers(p.stderr, servers)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed


@pytest.mark.parametrize("spec", ["localhost", "127.0.0.1:99999", ":50052", "h:0", "h:80x", "a:1,", "[::1]:80"])
def test_malformed_endpoints_are_refused(spec):
    with pytest.raises(UserError, match="is not HOST:PORT"):
        parse_endpoints(spec)


def test_endpoints_parse():
    assert parse_endpoints("a:1, 10.0.0.2:50052") == ["a:1", "10.0.0.2:50052"]
    assert parse_endpoints(["a:1,b:2", "c:3"]) == ["a:1", "b:2", "c:3"] and parse_endpoints(None) == []


@pytest.mark.parametrize("command,spec,words", [
    ("generate", "localhost", "is not HOST:PORT"),
    ("generate", "CLOSED", "is unreachable"), ("chat", "CLOSED", "is unreachable"), ("serve", "CLOSED", "is unreachable"),
])
def test_bad_rpc_endpoints_one_line_exit_2(bundled_gguf, command, spec, words):
    """Each command that takes --rpc: one line and exit 2, before ggml could abort on the address."""
    spec = spec.replace("CLOSED", f"127.0.0.1:{_closed_port()}")
    args = {"generate": ["-p", "hi"], "chat": [], "serve": ["--port", "0"]}[command]
    p = _cli(command, bundled_gguf, *args, "--rpc", spec)
    assert p.returncode == 2, p.stderr[-2000:]
    assert words in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
