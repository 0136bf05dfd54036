"""`clover-gguf serve` throughput against the patched llama-server on the same GGUF, in one run.

    python bench/serve.py [--model clover_gguf/assets/tiny-clover] [--requests 16] [--max-tokens 64]
                          [--clients 1,2,4,8] [--modes ar,diffusion,draft-self] [--parallel N] [--threads T]
                          [--block-clients 1,8] [--block-requests 8] [--rounds 3] [--plain-greedy]
                          [--distinct-prompts]
                          [--second-turn-words 400] [offload options] [--workdir out/bench-serve]

Both servers run as subprocesses on loopback and get the same greedy chat requests (eval prompts of the bundled
model, round robin) from C client threads at a time. clover-gguf serve is asked for each mode through the request's
`mode` field; llama-server decodes AR (it has no block mode) with `-np` = the largest client count, so it can batch
concurrent requests; both get `--parallel` slots (default: the most clients) and --threads. Reported: requests/s,
completion tokens/s (from each response's usage) and p50/p95 request latency per server, mode and client count, and
the ratio of tokens/s to llama-server's at the same client count (AR: --rounds rounds, alternating the two servers,
both up all along; a row is its median round, the ratio printed last the median of the rounds' ratios); the weights
llama.cpp holds at --parallel 1 and N (its memory breakdown, from /metrics); the scheduler's steps and llama_decode
calls; the time to first token of a second turn of a long conversation with the slot's kept state, without it, and
after as many other conversations as there are slots (from the host-memory state cache). Note that llama-server does
not apply Clover's generation controls (presence / repetition penalties), so its answers may differ in length.
"""

from __future__ import annotations

import argparse
import itertools
import json
import socket
import statistics
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


def start_logged(cmd: list[str], log: Path, **kw) -> subprocess.Popen:
    """A server process whose output goes to `log` (a pipe nobody reads fills up and stops the server)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, **kw)
    proc.log = log
    return proc


def wait_ready(base: str, proc: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log = getattr(proc, "log", None)
            tail = log.read_text(errors="replace")[-2000:] if log is not None and log.is_file() else ""
            raise SystemExit(f"server exited with {proc.returncode}: {tail}")
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


# request numbers for --distinct-prompts, never repeated within a run: llama-server keeps earlier prompts' states in
# host memory (its prompt cache, --cache-ram) for any slot, so a question asked again in a later round is a cache hit
_SERIAL = itertools.count()


def run_load(base: str, prompts: list[str], n_requests: int, clients: int, max_tokens: int,
             extra: dict, distinct: bool = False) -> dict:
    """n_requests chat completions, `clients` at a time -> requests/s, tokens/s, p50/p95 request latency.
    distinct: every request's question differs from every earlier one of the run (no server has it cached)."""

    def one(i: int) -> tuple[int, float]:
        text = prompts[i % len(prompts)] + (f" (request {next(_SERIAL)})" if distinct else "")
        body = {"model": "m", "messages": [{"role": "user", "content": text}],
                "max_tokens": max_tokens, "temperature": 0.0, "seed": 0, **extra}
        t = time.perf_counter()
        r = httpx.post(base + "/v1/chat/completions", json=body, timeout=1800)
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"]), time.perf_counter() - t

    one(n_requests)  # warm-up (with distinct prompts, a question the timed requests do not ask)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as ex:
        done = list(ex.map(one, range(n_requests)))
    dt = time.perf_counter() - t0
    tokens = sum(n for n, _ in done)
    lat = sorted(s for _, s in done)
    return {"requests": n_requests, "tokens": tokens, "seconds": round(dt, 3), "rps": n_requests / dt,
            "tps": tokens / dt, "p50_s": lat[len(lat) // 2], "p95_s": lat[min(len(lat) - 1, int(0.95 * len(lat)))]}


def model_bytes(base: str) -> int:
    """The weights llama.cpp holds (its memory breakdown, through /metrics)."""
    text = httpx.get(base + "/metrics", timeout=30).text
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("clover_llama_memory_bytes") and 'part="model"' in line)


def first_token_seconds(base: str, messages: list[dict], extra: dict) -> tuple[float, int, int]:
    """Time to the first streamed token of a chat request -> (seconds, prompt tokens reused, prompt tokens)."""
    body = {"model": "m", "messages": messages, "max_tokens": 4, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    t0 = time.perf_counter()
    first, usage = None, {}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if first is None and ev.get("choices") and any(ev["choices"][0]["delta"].get(k)
                                                            for k in ("content", "reasoning_content")):
                first = time.perf_counter() - t0
            if ev.get("usage"):
                usage = ev["usage"]
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return (first if first is not None else time.perf_counter() - t0), cached, int(usage.get("prompt_tokens", 0))


def second_turn(base: str, n_words: int, n_slots: int) -> dict:
    """A conversation of about 2,000 tokens: its second turn's time to first token when the slot continues from the
    first turn's kept state (its first turn asked before), when nothing holds it (a twin conversation, its first
    turn never asked: the whole prompt prefilled), and when `n_slots` other conversations came in between (every slot
    moved on; clover-gguf continues from its host-memory state cache, --cache-ram)."""
    def ask(messages: list[dict]) -> None:
        r = httpx.post(base + "/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 4,
                                                          "temperature": 0.0, "mode": "ar"}, timeout=1800)
        r.raise_for_status()

    out = {}
    for name, tag in (("no_reuse", "Set B"), ("reuse", "Set A"), ("reuse_after_others", "Set C")):
        first = [{"role": "user", "content": f"{tag}: " + " ".join(f"item {i}" for i in range(n_words))}]
        if name != "no_reuse":
            ask(first)
        if name == "reuse_after_others":
            for k in range(n_slots):
                ask([{"role": "user", "content": f"Another conversation, number {k}."}])
        follow = first + [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": "The last one?"}]
        s, cached, n = first_token_seconds(base, follow, {"mode": "ar"})
        out[name] = {"ttft_s": s, "cached_tokens": cached, "prompt_tokens": n}
    return out


def start_clover(gguf: Path, parallel: int, args, offload) -> tuple[subprocess.Popen, str]:
    port = free_port()
    code = ("import sys; from clover_gguf.serve import serve; "
            f"from clover_gguf.offload import Offload; "
            f"serve({str(gguf)!r}, port={port}, parallel={parallel}, ctx={args.ctx}, "
            f"n_threads={args.threads}, offload=Offload(**{asdict(offload)!r}), log_level='warning')")
    proc = start_logged([sys.executable, "-c", code], args.workdir / f"clover-serve-{parallel}.log", cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, proc, seconds=900)
    return proc, base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "clover_gguf" / "assets" / "tiny-clover",
                    help="a Clover GGUF, or an HF checkpoint folder (converted to F32 first)")
    ap.add_argument("--requests", type=int, default=16, help="requests per configuration")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--clients", default="1,2,4,8", help="concurrent client counts, comma separated")
    ap.add_argument("--modes", default=",".join(MODES), help="clover-gguf serve's modes to run, comma separated")
    ap.add_argument("--block-clients", default=None, help="client counts for diffusion and draft-self (default: "
                    "--clients; on random weights every block resolves about one token, so they are slow)")
    ap.add_argument("--block-requests", type=int, default=None, help="requests per block-mode configuration")
    ap.add_argument("--rounds", type=int, default=3, help="AR rounds, alternating the two servers; a row is the "
                    "round with the median tokens/s, the AR ratio the median of the rounds' ratios")
    ap.add_argument("--parallel", type=int, default=None, help="slots of both servers (default: the most clients)")
    ap.add_argument("--ctx", type=int, default=1024, help="context per slot")
    ap.add_argument("--second-turn-words", type=int, default=400,
                    help="words of the first message of the second-turn test (0: skip it; 400 is about 2,000 tokens "
                         "for the Qwen tokenizer)")
    ap.add_argument("--plain-greedy", action="store_true",
                    help="both servers without presence or repetition penalties (llama-server applies the GGUF's "
                         "repetition penalty by default, clover-gguf the card's controls): the same greedy tokens, so "
                         "the same work per step (on a MoE the tokens choose the experts a step reads)")
    ap.add_argument("--distinct-prompts", action="store_true",
                    help="no question asked twice (each gets its request number): what a server sees from different "
                         "users; by default the few prompts come round again, and both servers reuse kept prompts")
    add_argparse(ap)  # --gpu-layers, --cpu-moe, --n-cpu-moe, --threads, --mmap: as on every clover-gguf command
    ap.add_argument("--workdir", type=Path, default=ROOT / "out" / "bench-serve")
    args = ap.parse_args()
    offload = from_namespace(args)
    clients = [int(c) for c in args.clients.split(",")]
    modes = [m for m in args.modes.split(",") if m]
    n_par = args.parallel or max(clients)
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
    report: dict = {"parallel": n_par, "threads": args.threads, "plain_greedy": args.plain_greedy,
                    "distinct_prompts": args.distinct_prompts, "max_tokens": args.max_tokens}
    plain = {"presence_penalty": 0.0, "repetition_penalty": 1.0} if args.plain_greedy else {}
    plain_llama = {"presence_penalty": 0.0, "repeat_penalty": 1.0} if args.plain_greedy else {}

    # clover-gguf serve --parallel 1: the weights llama.cpp holds, to compare with --parallel N's
    proc, base = start_clover(gguf, 1, args, offload)
    try:
        report["model_bytes_parallel_1"] = model_bytes(base)
    finally:
        stop(proc)

    # clover-gguf serve --parallel N (one process, every mode through the request's `mode` field) and the patched
    # llama-server (AR, the same slots), both up; AR rounds alternate between them (a noisy machine moves both)
    proc, base = start_clover(gguf, n_par, args, offload)
    port = free_port()
    llama_base = f"http://127.0.0.1:{port}"
    cmd = [str(llama_server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c",
           str(args.ctx * n_par), "-np", str(n_par), "--jinja", "--no-webui",
           *offload.llama_args(bool(load_binding().llama_supports_gpu_offload()))]
    lproc = start_logged(cmd, args.workdir / "llama-server.log")
    try:
        report[f"model_bytes_parallel_{n_par}"] = model_bytes(base)
        wait_ready(llama_base, lproc, seconds=900)
        runs: dict[tuple[str, str, int], list[dict]] = {}
        servers = [("clover-gguf", base, {"mode": "ar", **plain}), ("llama-server", llama_base, plain_llama)]
        for rnd in range(args.rounds if "ar" in modes else 0):
            for c in clients:
                for name, url, extra in (servers if rnd % 2 == 0 else servers[::-1]):
                    r = run_load(url, prompts, args.requests, c, args.max_tokens, extra, args.distinct_prompts)
                    runs.setdefault((name, "ar", c), []).append(r)
                    print(f"round {rnd + 1}: {name:<12} ar         clients {c}: {r['rps']:.2f} req/s "
                          f"{r['tps']:.1f} tok/s p50 {r['p50_s']:.2f} s p95 {r['p95_s']:.2f} s", flush=True)
        for mode in (m for m in modes if m != "ar"):
            for c in ([int(x) for x in args.block_clients.split(",")] if args.block_clients else clients):
                r = run_load(base, prompts, args.block_requests or args.requests, c, args.max_tokens,
                             {"mode": mode, **plain}, args.distinct_prompts)
                runs[("clover-gguf", mode, c)] = [r]
                print(f"clover-gguf {mode:<10} clients {c}: {r['rps']:.2f} req/s {r['tps']:.1f} tok/s "
                      f"p50 {r['p50_s']:.2f} s p95 {r['p95_s']:.2f} s", flush=True)
        if args.second_turn_words:
            report["second_turn"] = second_turn(base, args.second_turn_words, n_par)
            print(f"second turn: {report['second_turn']}", flush=True)
        metrics = httpx.get(base + "/metrics", timeout=30).text
        report["scheduler"] = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
                               if line.startswith(("clover_batch_", "clover_llama_decodes_total",
                                                   "clover_batched_steps_total"))}
    finally:
        stop(proc)
        stop(lproc)
    for (name, mode, c), rs in runs.items():  # a row: the round with the median tokens/s
        row = sorted(rs, key=lambda r: r["tps"])[len(rs) // 2]
        rows.append({"server": name, "mode": mode, "clients": c, **row, "tps_rounds": [r["tps"] for r in rs]})
    # per client count, the median over rounds of the ratio within a round (both servers measured back to back)
    paired = {c: statistics.median(a["tps"] / b["tps"] for a, b in zip(runs[("clover-gguf", "ar", c)],
                                                                        runs[("llama-server", "ar", c)]))
              for c in clients if ("llama-server", "ar", c) in runs}
    report["ar_ratio_median_of_rounds"] = paired

    base_tps = {r["clients"]: r["tps"] for r in rows if r["server"] == "llama-server"}
    rows.sort(key=lambda r: (r["server"], MODES.index(r["mode"]), r["clients"]))
    print(f"\n{'server':<13} {'mode':<11} {'clients':>7} {'tokens':>7} {'tok/s':>8} {'p50 s':>7} {'p95 s':>7} "
          f"{'x llama-server':>15}")
    for r in rows:
        print(f"{r['server']:<13} {r['mode']:<11} {r['clients']:>7} {r['tokens']:>7} {r['tps']:8.1f} "
              f"{r['p50_s']:7.2f} {r['p95_s']:7.2f} {r['tps'] / base_tps.get(r['clients'], float('nan')):15.2f}")
    if paired:
        print(f"\nAR tokens/s, clover-gguf / llama-server, median of {args.rounds} rounds' ratios (each round both "
              "servers back to back): " + ", ".join(f"{c} clients {v:.2f}" for c, v in paired.items()))
    m1, mn = report["model_bytes_parallel_1"], report[f"model_bytes_parallel_{n_par}"]
    print(f"\nweights held by llama.cpp: --parallel 1 {m1 / 2**20:.1f} MiB, --parallel {n_par} {mn / 2**20:.1f} MiB "
          f"({mn / m1:.3f}x)" if m1 else "\nweights: no memory breakdown")
    st = report.get("second_turn")
    if st:
        print(f"second turn of a {st['reuse']['prompt_tokens']}-token conversation, time to first token: "
              f"{st['no_reuse']['ttft_s'] * 1e3:.0f} ms whole, {st['reuse']['ttft_s'] * 1e3:.0f} ms continuing "
              f"({st['reuse']['cached_tokens']} tokens reused): {st['no_reuse']['ttft_s'] / st['reuse']['ttft_s']:.1f}x")
        o = st["reuse_after_others"]
        print(f"  after {n_par} other conversations took every slot: {o['ttft_s'] * 1e3:.0f} ms "
              f"({o['cached_tokens']} tokens reused, from the state cache): "
              f"{st['no_reuse']['ttft_s'] / o['ttft_s']:.1f}x")
    report["ratios"] = {f"{r['server']}/{r['mode']}/c{r['clients']}": round(r["tps"] / base_tps[r["clients"]], 3)
                        for r in rows if r["clients"] in base_tps}
    report["rows"] = rows
    print(json.dumps(report))


if __name__ == "__main__":
    main()
