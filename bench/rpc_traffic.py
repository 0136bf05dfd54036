"""Bytes that cross the network per forward pass with llama.cpp's RPC backend, measured, against the estimate
docs/serve.md gives ("What crosses the network per pass").

    python bench/rpc_traffic.py [--model clover_gguf/assets/tiny-clover] [--reps 20]

Two ggml-rpc-servers on 127.0.0.1, each behind a byte-counting TCP relay; the model (every layer offloaded) is
loaded through the relays. After a warm-up, it counts the bytes of one AR step and one 32-token block pass (mean
over --reps), to the servers and back, and prints them beside the estimate's terms.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import sys
import threading
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clover_gguf.convert import convert  # noqa: E402
from clover_gguf.llama_context import LlamaContext  # noqa: E402
from clover_gguf.testing.rpc_servers import rpc_servers  # noqa: E402


class Relay:
    """Listens on a free loopback port and forwards every connection to `target`, counting bytes each way."""

    def __init__(self, target: str):
        self.target = target
        self.up = self.down = 0  # to the server, back from it
        self.lock = threading.Lock()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            host, port = self.target.split(":")
            server = socket.create_connection((host, int(port)))
            for a, b, up in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pump, args=(a, b, up), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 20):
                dst.sendall(data)
                with self.lock:
                    if up:
                        self.up += len(data)
                    else:
                        self.down += len(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def take(self) -> tuple[int, int]:
        with self.lock:
            counts, self.up, self.down = (self.up, self.down), 0, 0
        return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "clover_gguf" / "assets" / "tiny-clover")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--workdir", type=Path, default=ROOT / "out" / "bench-rpc")
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    gguf = a.workdir / "model-f32.gguf"
    convert(a.model, gguf, outtype="f32", quiet=True)
    rng = np.random.default_rng(0)
    with rpc_servers(2, threads=2) as servers:
        relays = [Relay(ep) for ep in servers]
        with LlamaContext(gguf, n_ctx=a.ctx, n_threads=2, rpc=[r.endpoint for r in relays], n_gpu_layers=-1) as ctx:
            n_vocab, n_embd = ctx.n_vocab, ctx.L.llama_model_n_embd(ctx.model)
            prompt = rng.integers(0, n_vocab, size=64).tolist()
            block = rng.integers(0, n_vocab, size=32).tolist()
            load = [r.take() for r in relays]
            ctx.decode(prompt, 0, 0, logits=[False] * 63 + [True])
            ctx.decode([block[0]], len(prompt), 0)  # warm-up: the one-token graph and the block graph once
            n_past = len(prompt) + 1
            ctx.block(block, n_past)
            for r in relays:
                r.take()
            for _ in range(a.reps):
                ctx.block(block, n_past)
            blk = [tuple(x / a.reps for x in r.take()) for r in relays]
            for i in range(a.reps):  # AR steps
                ctx.decode([block[i % 32]], n_past + i, 0)
            ar = [tuple(x / a.reps for x in r.take()) for r in relays]
    kib = 1024
    print(f"model {a.model.name}: n_vocab {n_vocab}, n_embd {n_embd}; {len(prompt)} tokens of context, n_ctx {a.ctx}; "
          f"two RPC servers, every layer offloaded")
    print(f"load: {sum(u for u, _ in load) / 2**20:.1f} MiB to the servers (the weights)")
    print(f"{'per pass':<26} {'server':<8} {'to server KiB':>14} {'back KiB':>10}")
    for name, rows in (("AR step (1 token)", ar), ("block pass (32 tokens)", blk)):
        for i, (up, down) in enumerate(rows):
            print(f"{name:<26} {i:<8} {up / kib:14.1f} {down / kib:10.1f}")
    for b, rows in ((1, ar), (32, blk)):
        logits, hidden = b * n_vocab * 4, b * n_embd * 4
        print(f"estimate, B={b:<2}: logits back {logits / kib:.1f} KiB; hidden state {hidden / kib:.1f} KiB into "
              f"server 0, {hidden / kib:.1f} KiB back from it and on to server 1; measured back from server 1 "
              f"{rows[1][1] / kib:.1f} KiB ({rows[1][1] / max(logits, 1):.2f}x the logits)")


if __name__ == "__main__":
    main()
