"""`clover-gguf serve` against the patched llama-server on the same GGUF, the same work on both sides, in one run.

    python bench/serve.py [--model clover_gguf/assets/tiny-clover] [--requests 16] [--max-tokens 32]
                          [--clients 1,4,8] [--modes ar,auto] [--rounds 3] [--parallel N] [--ctx 1024]
                          [--distinct-prompts] [--second-turn-tokens N] [offload options, --threads T]
                          [--workdir out/bench-serve] [--json]

Both servers run as subprocesses on loopback, both up all along, with the same slots (`--parallel`, default the most
clients), context per slot and threads, and get the same streamed chat requests from C client threads at a time.

The same work per request: the same prompt (the bundled model's eval questions, round robin; `--distinct-prompts`
numbers each one so that no server has it cached), the same sampling (one request body for both: greedy, no presence,
frequency or repetition penalty: llama-server's own repetition penalty reaches into the prompt, ours does not), and a
fixed number of generated tokens: `max_tokens` with `ignore_eos` (llama-server's field, and ours: the end tokens are
never chosen, in every mode). Each request's prompt and completion tokens are read from each server's `usage` and
compared request by request; where they differ (or a side did not generate `--max-tokens`) the row gets no ratio and
the bench says why.

A configuration is (clients, server and mode): clover-gguf serves each of `--modes` through the request's `mode`
field, llama-server AR (it has no block mode). `--rounds` rounds, each running every configuration once; the order of
the servers flips from round to round. Per configuration, the medians over the rounds of: requests/s, generated
tokens/s, time to first token (p50, p95 over the round's requests) and per-token decode latency ((request time - time
to first token) / (tokens - 1), p50, p95); ratios to llama-server's at the same client count are ratios of those
medians. Also: the weights llama.cpp holds at --parallel 1 and N (its memory breakdown, from /metrics), our scheduler's
steps and llama_decode calls, and the second turn of a long conversation (about `--second-turn-tokens`, sized to the
context given to the servers) on both servers: time to first token with the slot's kept state, without it, and after
as many other conversations as there are slots. Any HTTP error ends the run with one line naming the step.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from clover_gguf.testing.ports import free_port, stop  # noqa: E402,F401 (bench/agent.py, blocks.py take them from here)

EVAL = ROOT / "clover_gguf" / "assets" / "tiny-clover" / "eval.jsonl"
FALLBACK_PROMPTS = ["Count from 3 to 9.", "What is 12 + 30?", "Reverse: a b c d", "Copy: q r s t"]
# the same sampling and the same prompt on both sides, in one body: greedy, every penalty off (both servers' names),
# the template rendered with thinking on, our default (llama-server renders the bundled model's template with
# thinking off unless told: an empty <think></think>, 6 tokens more)
SAME = {"temperature": 0.0, "seed": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
        "repeat_penalty": 1.0, "chat_template_kwargs": {"enable_thinking": True}}
PEER = "llama-server"
OURS = "clover-gguf"


class BenchError(Exception):
    """One line that names the step that failed (printed without a traceback)."""


# ---- one request -------------------------------------------------------------------------------------------------
@dataclass
class Record:
    """One streamed request as the client saw it and the server counted it."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_s: float  # to the first streamed text (content or reasoning)
    seconds: float  # to the end of the stream
    text: str  # reasoning and content, as streamed

    @property
    def per_token_s(self) -> float:
        """Decode latency per token after the first: the rest of the request over the tokens after the first."""
        return (self.seconds - self.ttft_s) / max(1, self.completion_tokens - 1)


_CLIENT: httpx.Client | None = None


def client() -> httpx.Client:
    """The one HTTP client of the run, shared by the client threads. A new client per request would cost each request
    about 0.2 s of this process's CPU (httpx builds an SSL context). No connection is kept open between requests:
    llama-server (cpp-httplib) closes kept connections on its own terms, and a request sent on one it just closed
    fails; a new loopback connection costs well under a millisecond."""
    global _CLIENT
    if _CLIENT is None:
        _CLIENT = httpx.Client(timeout=1800, limits=httpx.Limits(max_connections=256, max_keepalive_connections=0))
    return _CLIENT


def _http_error(step: str, server: str, e: Exception) -> BenchError:
    if isinstance(e, httpx.HTTPStatusError):
        try:
            msg = e.response.json()["error"]["message"]
        except Exception:  # not OpenAI's error shape: the body's start
            msg = e.response.text[:200]
        return BenchError(f"{step}: {server} answered HTTP {e.response.status_code}: {msg}")
    return BenchError(f"{step}: {server}: {type(e).__name__}: {e}")


def chat(base: str, body: dict, step: str, server: str) -> Record:
    """One streamed chat completion -> its Record; any HTTP failure is a BenchError naming `step`."""
    body = {"model": "m", **body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, usage, text = None, None, []
    try:
        with client().stream("POST", base + "/v1/chat/completions", json=body) as r:
            if r.status_code >= 400:
                r.read()
                r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    raise BenchError(f"{step}: {server}: error in the stream: {ev['error']}")
                for ch in ev.get("choices") or ():
                    piece = "".join((ch.get("delta") or {}).get(k) or "" for k in ("reasoning_content", "content"))
                    if piece:
                        text.append(piece)
                        if first is None:
                            first = time.perf_counter() - t0
                if ev.get("usage"):
                    usage = ev["usage"]
    except httpx.HTTPError as e:
        raise _http_error(step, server, e) from None
    seconds = time.perf_counter() - t0
    if usage is None:
        raise BenchError(f"{step}: {server} sent no usage in its stream")
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return Record(int(usage["prompt_tokens"]), int(usage["completion_tokens"]), cached,
                  seconds if first is None else first, seconds, "".join(text))


# ---- a load: n requests, C at a time -----------------------------------------------------------------------------
def _pct(values: list[float], q: float) -> float:
    """The q-quantile of values (nearest rank)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def summarize(records: list[Record], seconds: float) -> dict:
    tokens = sum(r.completion_tokens for r in records)
    ttft, per_tok = [r.ttft_s for r in records], [r.per_token_s for r in records]
    return {"requests": len(records), "tokens": tokens, "seconds": seconds, "rps": len(records) / seconds,
            "tps": tokens / seconds, "ttft_p50": _pct(ttft, 0.5), "ttft_p95": _pct(ttft, 0.95),
            "tpot_p50": _pct(per_tok, 0.5), "tpot_p95": _pct(per_tok, 0.95),
            "prompt_tokens": sum(r.prompt_tokens for r in records),
            "cached_tokens": sum(r.cached_tokens for r in records)}


def run_load(base: str, server: str, bodies: list[dict], clients: int, step: str) -> tuple[dict, list[Record]]:
    """The requests `bodies`, `clients` at a time -> (summary, the requests' Records in the bodies' order)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as ex:
        records = list(ex.map(lambda b: chat(base, b, step, server), bodies))
    return summarize(records, time.perf_counter() - t0), records


# ---- the same work on both sides -----------------------------------------------------------------------------------
def unequal_work(ours: list[Record], peer: list[Record], max_tokens: int) -> list[str]:
    """Why the two runs of the same requests did different work (empty: the same): per request, the prompt tokens
    each server counted, and the generated tokens, which must be the fixed budget on both sides."""
    if len(ours) != len(peer):
        return [f"{len(ours)} requests against {len(peer)}"]
    why = []
    for i, (a, b) in enumerate(zip(ours, peer)):
        if a.prompt_tokens != b.prompt_tokens:
            why.append(f"request {i}: {a.prompt_tokens} prompt tokens against {b.prompt_tokens}")
        if a.completion_tokens != b.completion_tokens:
            why.append(f"request {i}: {a.completion_tokens} generated tokens against {b.completion_tokens}")
        elif a.completion_tokens != max_tokens:
            why.append(f"request {i}: {a.completion_tokens} generated tokens on both sides, not the budget of "
                       f"{max_tokens}")
    return why


METRICS = ("rps", "tps", "ttft_p50", "ttft_p95", "tpot_p50", "tpot_p95")


def row(runs: list[tuple[dict, list[Record]]]) -> dict:
    """A configuration's rounds -> the median of each metric over the rounds."""
    out = {k: statistics.median(s[k] for s, _ in runs) for k in METRICS}
    out["rounds"] = len(runs)
    out["tps_rounds"] = [round(s["tps"], 2) for s, _ in runs]
    out["reused"] = sum(s["cached_tokens"] for s, _ in runs) / max(1, sum(s["prompt_tokens"] for s, _ in runs))
    return out


def compare(ours: list[tuple[dict, list[Record]]], peer: list[tuple[dict, list[Record]]], max_tokens: int
            ) -> tuple[dict | None, str | None]:
    """Our configuration's rounds against the peer's at the same client count -> (ratios of the medians, None), or
    (None, why) where any round's work differs. Ratios: ours / the peer's (tok/s above 1: we are faster; latencies
    below 1: we are faster); `tps_rounds`: each round's tok/s ratio (both measured back to back: their spread says
    how much the machine moved during the run)."""
    if len(ours) != len(peer):
        return None, f"{len(ours)} rounds against {len(peer)}"
    for k, ((_, a), (_, b)) in enumerate(zip(ours, peer)):
        why = unequal_work(a, b, max_tokens)
        if why:
            more = f" (and {len(why) - 1} more)" if len(why) > 1 else ""
            return None, f"the work differs in round {k + 1}: {why[0]}{more}"
    mine, theirs = row(ours), row(peer)
    ratios = {k: mine[k] / theirs[k] if theirs[k] else float("nan") for k in METRICS}
    ratios["tps_rounds"] = [a["tps"] / b["tps"] for (a, _), (b, _) in zip(ours, peer)]
    return ratios, None


def _bare(text: str) -> str:
    """An answer without <think> tags and whitespace: ours streams the thinking as reasoning_content, tags removed and
    stripped; llama-server streams this template's raw text as content."""
    return re.sub(r"</?think>|\s+", "", text)


def same_text(ours: list[tuple[dict, list[Record]]], peer: list[tuple[dict, list[Record]]]) -> tuple[int, int]:
    """How many of our answers are the peer's text, tags and whitespace aside (greedy on the same model: the same
    tokens but where two nearly equal logits come out in another order)."""
    pairs = [(_bare(a.text), _bare(b.text)) for (_, ra), (_, rb) in zip(ours, peer) for a, b in zip(ra, rb)]
    return sum(a == b for a, b in pairs), len(pairs)


# ---- the servers ---------------------------------------------------------------------------------------------------


def start_logged(cmd: list[str], log: Path, **kw) -> subprocess.Popen:
    """A server process whose output goes to `log` (a pipe nobody reads fills up and stops the server)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, **kw)
    proc.log = log
    return proc


def wait_ready(base: str, proc: subprocess.Popen, what: str, seconds: float = 900) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            lines = proc.log.read_text(errors="replace").strip().splitlines() if proc.log.is_file() else []
            raise BenchError(f"starting {what}: it exited with {proc.returncode}"
                             + (f": {lines[-1]} (the rest in {proc.log})" if lines else ""))
        try:
            if client().get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise BenchError(f"starting {what}: not ready after {seconds:.0f} s (its log: {proc.log})")


@contextlib.contextmanager
def servers_stopped(procs: list[subprocess.Popen]) -> Iterator[list[subprocess.Popen]]:
    """Every server started in the block is stopped at its end, whatever happens (Ctrl-C included)."""
    try:
        yield procs
    finally:
        for p in procs:
            stop(p)


def start_clover(gguf: Path, parallel: int, args, offload, procs: list) -> str:
    from clover_gguf.offload import Offload  # noqa: F401 (the child imports it; a missing one fails here first)

    port = free_port()
    code = ("from clover_gguf.serve import serve; from clover_gguf.offload import Offload; "
            f"serve({str(gguf)!r}, port={port}, parallel={parallel}, ctx={args.ctx}, "
            f"n_threads={args.threads}, offload=Offload(**{asdict(offload)!r}), log_level='warning')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = start_logged([sys.executable, "-c", code], args.workdir / f"clover-serve-{parallel}.log", cwd=ROOT,
                        env=env)
    procs.append(proc)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, proc, f"clover-gguf serve --parallel {parallel}")
    return base


def start_llama(gguf: Path, n_par: int, args, offload, procs: list) -> str:
    from clover_gguf.build import llama_tool
    from clover_gguf.errors import UserError
    from clover_gguf.llama_context import load_binding

    try:
        llama_server = llama_tool("llama-server")
    except UserError as e:
        raise BenchError(f"starting llama-server: {e}") from None
    port = free_port()
    cmd = [str(llama_server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c",
           str(args.ctx * n_par), "-np", str(n_par), "--jinja", "--no-webui",
           *offload.llama_args(bool(load_binding().llama_supports_gpu_offload()))]
    proc = start_logged(cmd, args.workdir / "llama-server.log")
    procs.append(proc)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, proc, "llama-server")
    return base


def model_bytes(base: str) -> int:
    """The weights llama.cpp holds (its memory breakdown, through /metrics)."""
    try:
        text = client().get(base + "/metrics", timeout=30).raise_for_status().text
    except httpx.HTTPError as e:
        raise _http_error("reading the weights held (/metrics)", OURS, e) from None
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("clover_llama_memory_bytes") and 'part="model"' in line)


# ---- the second turn -----------------------------------------------------------------------------------------------
def words_for(base: str, target_tokens: int, step: str) -> int:
    """How many "item i" words make a first message of about `target_tokens` prompt tokens for this model: two
    one-token requests of 20 and 60 words measure the template's tokens and the tokens per word."""
    def tokens(n: int) -> int:
        msg = [{"role": "user", "content": "Set Z: " + " ".join(f"item {i}" for i in range(n))}]
        return chat(base, {"messages": msg, "max_tokens": 1, **SAME, "mode": "ar"}, step, OURS).prompt_tokens

    a, b = tokens(20), tokens(60)
    per_word = (b - a) / 40
    return max(1, int((target_tokens - (a - 20 * per_word)) / per_word))


def second_turn(base: str, server: str, n_words: int, n_slots: int, tag: str) -> dict:
    """A conversation of n_words words: its second turn's time to first token when the slot continues from the
    first turn's kept state (its first turn asked before), when nothing holds it (a twin conversation, its first
    turn never asked: the whole prompt prefilled), and when `n_slots` other conversations came in between (every slot
    moved on; the state comes from the host-memory cache, --cache-ram, on both servers). `tag` makes this server's
    conversations its own."""
    body = {**SAME, "mode": "ar", "max_tokens": 4}
    out = {}
    for name, head in (("no_reuse", "Set B"), ("reuse", "Set A"), ("reuse_after_others", "Set C")):
        step = f"second turn ({name.replace('_', ' ')})"
        first = [{"role": "user", "content": f"{head}{tag}: " + " ".join(f"item {i}" for i in range(n_words))}]
        if name != "no_reuse":
            chat(base, {**body, "messages": first}, step + ", first turn", server)
        if name == "reuse_after_others":
            for k in range(n_slots):
                chat(base, {**body, "messages": [{"role": "user", "content": f"Another conversation{tag}, number "
                                                  f"{k}."}]}, step + ", another conversation", server)
        follow = first + [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": "The last one?"}]
        r = chat(base, {**body, "messages": follow}, step, server)
        out[name] = {"ttft_s": r.ttft_s, "cached_tokens": r.cached_tokens, "prompt_tokens": r.prompt_tokens}
    return out


# ---- the run -------------------------------------------------------------------------------------------------------
_SERIAL = itertools.count()  # --distinct-prompts: request numbers, never repeated within a run


def bodies_for(prompts: list[str], n: int, max_tokens: int, mode: str | None, distinct: bool) -> list[dict]:
    """n request bodies: the prompts round robin (distinct: each numbered, so no server has seen it: a number of a
    fixed width, the same tokens on both sides)."""
    out = []
    for i in range(n):
        text = prompts[i % len(prompts)] + (f" (request {next(_SERIAL):06d})" if distinct else "")
        body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "ignore_eos": True,
                **SAME}
        if mode is not None:
            body["mode"] = mode
        out.append(body)
    return out


def load_prompts() -> list[str]:
    """Short questions: the bundled model's eval prompts (every 7th), whichever model runs."""
    if EVAL.is_file():
        return [json.loads(x)["prompt"] for x in EVAL.read_text().splitlines() if x.strip()][::7]
    return FALLBACK_PROMPTS


def main() -> None:
    from clover_gguf.decoding import MODES
    from clover_gguf.offload import add_argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=ROOT / "clover_gguf" / "assets" / "tiny-clover",
                    help="a Clover GGUF, or an HF checkpoint folder (converted to F32 first)")
    ap.add_argument("--requests", type=int, default=16, help="requests per configuration and round")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens every answer generates (ignore_eos)")
    ap.add_argument("--clients", default="1,4,8", help="concurrent client counts, comma separated")
    ap.add_argument("--modes", default="ar,auto",
                    help=f"clover-gguf serve's modes, comma separated ({', '.join(MODES)})")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every configuration once, the servers' "
                    "order flipped from round to round; a row is the median of its rounds")
    ap.add_argument("--parallel", type=int, default=None, help="slots of both servers (default: the most clients)")
    ap.add_argument("--ctx", type=int, default=1024, help="context per slot, both servers")
    ap.add_argument("--second-turn-tokens", type=int, default=None,
                    help="prompt tokens of the second-turn conversation (default: 3/4 of --ctx; 0 skips it)")
    ap.add_argument("--distinct-prompts", action="store_true",
                    help="no question asked twice (each gets its request number): what a server sees from different "
                         "users; by default the prompts come round again, and both servers reuse kept prompts")
    ap.add_argument("--json", action="store_true", help="print the report as JSON as well")
    add_argparse(ap)  # --gpu-layers, --cpu-moe, --n-cpu-moe, --threads, --mmap: as on every clover-gguf command
    ap.add_argument("--workdir", type=Path, default=ROOT / "out" / "bench-serve")
    args = ap.parse_args()
    try:
        clients = sorted({int(c) for c in args.clients.split(",") if c.strip()})
        if not clients or min(clients) < 1:
            raise ValueError
    except ValueError:
        raise SystemExit("bench/serve.py: --clients: positive whole numbers, comma separated") from None
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise SystemExit(f"bench/serve.py: --modes: {', '.join(bad) or 'none given'}: choose from {', '.join(MODES)}")
    if args.max_tokens < 2 or args.requests < 1 or args.rounds < 1:
        raise SystemExit("bench/serve.py: --max-tokens is at least 2, --requests and --rounds at least 1")
    try:
        run(args, clients, modes)
    except BenchError as e:
        raise SystemExit(f"bench/serve.py: {e}") from None
    except KeyboardInterrupt:
        raise SystemExit("bench/serve.py: interrupted (the servers are stopped)") from None


def run(args, clients: list[int], modes: list[str]) -> None:
    from clover_gguf.convert import convert
    from clover_gguf.offload import from_namespace

    offload = from_namespace(args)
    n_par = args.parallel or max(clients)
    args.workdir.mkdir(parents=True, exist_ok=True)
    gguf = args.model
    if gguf.is_dir():
        gguf = args.workdir / "model-f32.gguf"
        convert(args.model, gguf, outtype="f32", quiet=True, force=True)
    prompts = load_prompts()
    report: dict = {"model": str(args.model), "parallel": n_par, "threads": args.threads, "ctx": args.ctx,
                    "requests": args.requests, "max_tokens": args.max_tokens, "rounds": args.rounds,
                    "distinct_prompts": args.distinct_prompts, "loadavg_start": os.getloadavg()}
    t_start = time.perf_counter()

    # clover-gguf serve --parallel 1: the weights llama.cpp holds, to compare with --parallel N's
    with servers_stopped([]) as procs:
        report["model_bytes_parallel_1"] = model_bytes(start_clover(gguf, 1, args, offload, procs))

    runs: dict[tuple[str, str, int], list[tuple[dict, list[Record]]]] = {}
    with servers_stopped([]) as procs:
        base = start_clover(gguf, n_par, args, offload, procs)
        report[f"model_bytes_parallel_{n_par}"] = model_bytes(base)
        llama_base = start_llama(gguf, n_par, args, offload, procs)
        urls = {OURS: base, PEER: llama_base}
        configs = [(PEER, "ar")] + [(OURS, m) for m in modes]
        # warm-up, not timed: each server and mode once, and (the prompts coming round again) every prompt the
        # timed requests ask, once to each server, so that both start from the same kept prompts
        for name, mode in configs:
            step = f"warm-up ({name}, {mode})"
            chat(urls[name], bodies_for(prompts, 1, 4, None if name == PEER else mode, True)[0], step, name)
        if not args.distinct_prompts:
            for name in (PEER, OURS):
                for body in bodies_for(prompts, min(args.requests, len(prompts)), 1,
                                       None if name == PEER else "ar", False):
                    chat(urls[name], body, f"warm-up ({name}, the prompts)", name)
        for rnd in range(args.rounds):
            for c in clients:
                for name, mode in (configs if rnd % 2 == 0 else configs[::-1]):
                    step = f"round {rnd + 1}, {name} {mode}, {c} clients"
                    bodies = bodies_for(prompts, args.requests, args.max_tokens, None if name == PEER else mode,
                                        args.distinct_prompts)
                    s, recs = run_load(urls[name], name, bodies, c, step)
                    runs.setdefault((name, mode, c), []).append((s, recs))
                    print(f"round {rnd + 1}: {name:<12} {mode:<10} clients {c}: {s['rps']:.2f} req/s "
                          f"{s['tps']:.1f} tok/s, time to first token p50 {s['ttft_p50'] * 1e3:.0f} ms, per token "
                          f"p50 {s['tpot_p50'] * 1e3:.1f} ms", flush=True)
        target = args.ctx * 3 // 4 if args.second_turn_tokens is None else args.second_turn_tokens
        if target:
            if target + 64 > args.ctx:
                raise BenchError(f"second turn: {target} prompt tokens do not fit the context of {args.ctx} per slot "
                                 "given to the servers (--ctx, --second-turn-tokens)")
            n_words = words_for(base, target, "second turn (sizing the conversation)")
            report["second_turn"] = {name: second_turn(urls[name], name, n_words, n_par, f" ({name})")
                                     for name in (OURS, PEER)}
        try:
            metrics = client().get(base + "/metrics", timeout=30).raise_for_status().text
        except httpx.HTTPError as e:
            raise _http_error("reading the scheduler's counters (/metrics)", OURS, e) from None
        report["scheduler"] = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
                               if line.startswith(("clover_batch_", "clover_llama_decodes_total",
                                                   "clover_batched_steps_total"))}
    report["loadavg_end"] = os.getloadavg()
    report["wall_s"] = time.perf_counter() - t_start
    print_report(report, runs, clients, modes, args.max_tokens, n_par)
    report["rows"] = []
    for (name, mode, c), rs in runs.items():
        r = {"server": name, "mode": mode, "clients": c, **row(rs)}
        if name == OURS:
            peer = runs[(PEER, "ar", c)]
            r["x_llama_server"], r["why_no_ratio"] = compare(rs, peer, args.max_tokens)
            r["same_text"] = same_text(rs, peer)
        report["rows"].append(r)
    (args.workdir / "serve.json").write_text(json.dumps(report, indent=1) + "\n")
    if args.json:
        print(json.dumps(report))


def print_report(report: dict, runs: dict, clients: list[int], modes: list[str], max_tokens: int, n_par: int) -> None:
    ms = lambda s: f"{s * 1e3:.0f}"  # noqa: E731
    print(f"\n{report['requests']} requests per configuration and round, {max_tokens} tokens each (ignore_eos), "
          f"greedy, {report['rounds']} rounds; medians of the rounds; load average "
          f"{report['loadavg_start'][0]:.1f} at the start, {report['loadavg_end'][0]:.1f} at the end")
    print(f"{'server':<13} {'mode':<11} {'clients':>7} {'req/s':>7} {'tok/s':>8} {'TTFT p50/p95 ms':>16} "
          f"{'per-token p50/p95 ms':>21} {'reused':>7}  ours / llama-server (tok/s; TTFT p50; per-token p50)")
    notes = []
    for c in clients:
        for name, mode in [(PEER, "ar")] + [(OURS, m) for m in modes]:
            rs = runs.get((name, mode, c))
            if not rs:
                continue
            r = row(rs)
            line = (f"{name:<13} {mode:<11} {c:>7} {r['rps']:7.2f} {r['tps']:8.1f} "
                    f"{ms(r['ttft_p50']) + ' / ' + ms(r['ttft_p95']):>16} "
                    f"{'%.1f / %.1f' % (r['tpot_p50'] * 1e3, r['tpot_p95'] * 1e3):>21} {r['reused']:7.0%}")
            if name == OURS:
                comp, why = compare(rs, runs[(PEER, "ar", c)], max_tokens)
                if comp is None:
                    line += "  no ratio: see below"
                    notes.append(f"{mode}, {c} clients: no ratio: {why}")
                else:
                    k, n = same_text(rs, runs[(PEER, "ar", c)])
                    spread = comp["tps_rounds"]
                    line += (f"  {comp['tps']:.2f}; {comp['ttft_p50']:.2f}; {comp['tpot_p50']:.2f}  (rounds' tok/s "
                             f"{min(spread):.2f}-{max(spread):.2f}; same text {k}/{n})")
            print(line)
    for n in notes:
        print(n)
    m1, mn = report["model_bytes_parallel_1"], report[f"model_bytes_parallel_{n_par}"]
    print(f"\nweights held by llama.cpp: --parallel 1 {m1 / 2**20:.1f} MiB, --parallel {n_par} {mn / 2**20:.1f} MiB "
          f"({mn / m1:.3f}x)" if m1 else "\nweights: no memory breakdown")
    for name, st in (report.get("second_turn") or {}).items():
        w, k, o = st["no_reuse"], st["reuse"], st["reuse_after_others"]
        print(f"{name}: second turn of a {k['prompt_tokens']}-token conversation, time to first token: "
              f"{ms(w['ttft_s'])} ms whole ({w['cached_tokens']} reused), {ms(k['ttft_s'])} ms continuing "
              f"({k['cached_tokens']} reused, {w['ttft_s'] / k['ttft_s']:.1f}x), after {n_par} other conversations "
              f"{ms(o['ttft_s'])} ms ({o['cached_tokens']} reused, {w['ttft_s'] / o['ttft_s']:.1f}x)")
    print(f"scheduler: {report['scheduler']}; {report['wall_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
