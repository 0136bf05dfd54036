"""Local `ggml-rpc-server`s on loopback for the RPC tests and bench/decode.py --rpc."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from typing import Iterator

from clover_gguf.errors import UserError
from clover_gguf.testing.ports import free_port

RPC_SERVER = "ggml-rpc-server"


@contextlib.contextmanager
def rpc_servers(n: int = 2, threads: int = 1, timeout: float = 60.0) -> Iterator[list[str]]:
    """Start n servers of the build the runtime uses on 127.0.0.1; yield their endpoints; stop them."""
    from clover_gguf.build import find_library

    info = find_library()
    tool = info.tool(RPC_SERVER) if info else None
    if tool is None or not tool.is_file():
        raise UserError(f"{RPC_SERVER} not found ({tool or 'no llama.cpp build'}): build llama.cpp with RPC")
    procs, endpoints = [], []
    try:
        for _ in range(n):
            port = free_port()
            procs.append(subprocess.Popen([str(tool), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.PIPE))
            endpoints.append(f"127.0.0.1:{port}")
        deadline = time.monotonic() + timeout
        for p, ep in zip(procs, endpoints):
            while True:  # a connect that the server accepts and drops: it goes on serving
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", int(ep.split(":")[1])), 1):
                    break
                if p.poll() is not None:
                    raise UserError(f"{RPC_SERVER} on {ep} exited: {p.stderr.read().decode()[-500:]}")
                if time.monotonic() > deadline:
                    raise UserError(f"{RPC_SERVER} on {ep} did not start listening")
                time.sleep(0.1)
        yield endpoints
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
