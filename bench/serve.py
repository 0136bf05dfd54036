"""`clover-gguf serve` throughput against the patched llama-server on the same GGUF, in one run.

    python bench/serve.py [--model clover_gguf/assets/tiny-clover] [--requests 16] [--max-tokens 64]
                          [--clients 1,4] [--parallel 1] [--threads 1] [offload options] [--workdir out/bench-serve]

Both servers run as subprocesses on loopback and get the same greedy chat requests (eval prompts of the bundled
model, round robin) from C client threads at a time. clover-gguf serve is asked for each mode through the request's
`mode` field; llama-server decodes AR (it has no block mode) with `-np` = the largest client count, so it can batch
concurrent requests. Reported: requests/s and completion tokens/s (from each response's usage) per server, mode and
client count, and the ratio of tokens/s to llama-server's at the same client count. Note that llama-server does not
apply Clover's generation controls (presence / repetition penalties), so its answers may differ in length.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from clover_gguf.build import llama_tool  # noqa: E402
from clover_gguf.errors import UserError  # noqa: E402
from clover_gguf.convert import convert  # noqa: E402
from clover_gguf.decoding import MODES  # noqa: E402
from clover_gguf.llama_context import load_binding  # noqa: E402
from clover_gguf.offload import add_argparse, from_namespace  # noqa: E402


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_ready(base: str, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}: {proc.stderr.read()[-2000:] if proc.stderr else ''}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{base} did not become ready")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_load(base: str, prompts: list[str], n_requests: int, clients: int, max_tokens: int,
             extra: dict) -> dict:
    """n_requests chat completions, `clients` at a time -> requests/s, tokens/s."""

    def one(i: int) -> int:
        body = {"model": "m", "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                "max_tokens": max_tokens, "temperature": 0.0, "seed": 0, **extra}
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    one(0)  # warm-up
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as ex:
        tokens = sum(ex.map(one, range(n_requests)))
    dt = time.perf_counter() - t0
    return {"requests": n_requests, "tokens": tokens, "seconds": round(dt, 3), "rps": n_requests / dt,
            "tps": tokens / dt}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "clover_gguf" / "assets" / "tiny-clover",
                    help="a Clover GGUF, or an HF checkpoint folder (converted to F32 first)")
    ap.add_argument("--requests", type=int, default=16, help="requests per configuration")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--clients", default="1,4", help="concurrent client counts, comma separated")
    ap.add_argument("--parallel", type=int, default=1, help="clover-gguf serve --parallel")
    ap.add_argument("--ctx", type=int, default=1024, help="context per sequence")
    add_argparse(ap)  # --gpu-layers, --cpu-moe, --n-cpu-moe, --threads, --mmap: as on every clover-gguf command
    ap.set_defaults(threads=1)  # llama.cpp threads per server and per clover slot: 1 keeps a small machine stable
    ap.add_argument("--workdir", type=Path, default=ROOT / "out" / "bench-serve")
    args = ap.parse_args()
    offload = from_namespace(args)
    clients = [int(c) for c in args.clients.split(",")]
    args.workdir.mkdir(parents=True, exist_ok=True)

    gguf = args.model
    if gguf.is_dir():
        gguf = args.workdir / "model-f32.gguf"
        convert(args.model, gguf, outtype="f32", quiet=True, force=True)
    eval_file = args.model / "eval.jsonl" if args.model.is_dir() else None
    if eval_file is not None and eval_file.is_file():
        prompts = [json.loads(x)["prompt"] for x in eval_file.read_text().splitlines() if x.strip()][::7]
    else:
        prompts = ["Count from 3 to 9.", "What is 12 + 30?", "Reverse: a b c d", "Copy: q r s t"]

    try:
        llama_server = llama_tool("llama-server")
    except UserError as e:
        raise SystemExit(str(e)) from None
    rows: list[dict] = []

    # clover-gguf serve: one process, every mode through the request's `mode` field
    port = free_port()
    code = ("import sys; from clover_gguf.server import serve; "
            f"from clover_gguf.offload import Offload; "
            f"serve({str(gguf)!r}, port={port}, parallel={args.parallel}, ctx={args.ctx}, "
            f"n_threads={args.threads}, offload=Offload(**{asdict(offload)!r}), log_level='warning')")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        for mode in MODES:
            for c in clients:
                r = run_load(f"http://127.0.0.1:{port}", prompts, args.requests, c, args.max_tokens, {"mode": mode})
                rows.append({"server": "clover-gguf", "mode": mode, "clients": c, **r})
                print(f"clover-gguf {mode:<10} clients {c}: {r['rps']:.2f} req/s {r['tps']:.1f} tok/s", flush=True)
    finally:
        stop(proc)

    # the patched llama-server, AR
    port = free_port()
    n_par = max(clients)
    cmd = [str(llama_server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c",
           str(args.ctx * n_par), "-np", str(n_par), "--jinja", "--no-webui",
           *offload.llama_args(bool(load_binding().llama_supports_gpu_offload()))]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        for c in clients:
            r = run_load(f"http://127.0.0.1:{port}", prompts, args.requests, c, args.max_tokens, {})
            rows.append({"server": "llama-server", "mode": "ar", "clients": c, **r})
            print(f"llama-server ar         clients {c}: {r['rps']:.2f} req/s {r['tps']:.1f} tok/s", flush=True)
    finally:
        stop(proc)

    base = {r["clients"]: r["tps"] for r in rows if r["server"] == "llama-server"}
    print(f"\n{'server':<13} {'mode':<11} {'clients':>7} {'requests':>8} {'tokens':>7} {'req/s':>7} {'tok/s':>8} "
          f"{'x llama-server':>15}")
    for r in rows:
        print(f"{r['server']:<13} {r['mode']:<11} {r['clients']:>7} {r['requests']:>8} {r['tokens']:>7} "
              f"{r['rps']:7.2f} {r['tps']:8.1f} {r['tps'] / base[r['clients']]:15.2f}")
    print(json.dumps({f"{r['server']}/{r['mode']}/c{r['clients']}": round(r["tps"] / base[r["clients"]], 3)
                      for r in rows}))


if __name__ == "__main__":
    main()
