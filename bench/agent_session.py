"""Recorded agent sessions replayed against `clover-gguf serve` and llama-server on the same GGUF: what a user waits
for on each turn.

    python bench/agent_session.py [--sessions claude-code,opencode,qwen-code] [--servers serve,llama-server]
                                  [--model DIR|GGUF | --slice] [--ctx 65536] [--threads 2] [--runs 3] [--turns N]
                                  [--max-tokens 32] [--exact | --no-exact] [--cache-ram MIB] [--interleave]
                                  [--workdir out/agent-session] [--json]

A session (bench/sessions/<client>.json.gz, recorded by `bench/clients.py --session`: the requests as the client sent
them, tool results and the client's own bytes included, e.g. Claude Code's per-request `cch=` billing block) is sent
request by request, in order, to a freshly started server, one client at a time: each request is one turn. The bodies
go as recorded except what makes the two servers comparable and the run short: stream on (and the usage with it),
greedy (temperature 0), neutral penalties on both (serve's model defaults are presence 0.9 and repetition 1.05,
llama-server's none), at most --max-tokens tokens per answer. The history a turn carries is the recorded one, whatever
the server answered the turn before: both servers meet the same prompts.

Per turn and server: prompt tokens, tokens reused (the server's own count: serve's usage, llama-server's `cache_n` /
cache_read_input_tokens), time to first token (the request sent -> the first event that carries generated text,
thinking or a call: the prefill of what the cache did not hold), decode tok/s (completion tokens after the first over
the time after it), the server's resident memory after the turn (VmRSS of its process); per session: the total wait
and the peak resident memory (VmHWM). With --runs R each server runs the session R times, the servers alternating
within a run, and each figure is the median of the R runs. In AR (serve --mode ar) with greedy and the same
penalties, both servers should write the same text each turn: the table's "same" column says whether they did (run 1).

Both servers in one setting (bench/agent.py's start_ours / start_peer): one slot, --threads threads each, --ctx
tokens of context; --exact (the default): flash attention off and F32 K/V on both, under which greedy text is
comparable token for token; --no-exact: each server's defaults (F16 K/V), what a user runs. llama-server as an agent
user starts it: --jinja, its prompt cache (--cache-ram, its default 8192 MiB unless given) and its context
checkpoints (default) on, and (--peer-template tolerant, the default) bench/clients.py's copy of the model's template
that renders a later system message as a user turn as serve does (the model's own refuses Claude Code's second system
message with HTTP 500); serve with its --cache-ram (default 1024 MiB unless given).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from client_proxy import api_of, parse_answer, sse_events  # noqa: E402
from session_store import file_of, load, recorded  # noqa: E402

SERVERS = ("serve", "llama-server")
RETRIES = 1
# neutral penalties under both servers' names (each ignores the other's): serve's model defaults would otherwise
# differ from llama-server's
NEUTRAL = {"temperature": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
           "repeat_penalty": 1.0}


class BenchError(Exception):
    """One line naming what failed (printed without a traceback)."""


# ---- the requests as replayed ---------------------------------------------------------------------------------------
def replay_body(api: str, body: dict, max_tokens: int) -> dict:
    """The recorded body with stream on, greedy, neutral penalties and at most `max_tokens` tokens per answer (in the
    API's own field); everything else as the client sent it."""
    out = {**body, **NEUTRAL, "stream": True}
    if api == "chat":
        out["stream_options"] = {"include_usage": True}
        out.pop("max_completion_tokens", None)
        out["max_tokens"] = min(int(body.get("max_tokens") or body.get("max_completion_tokens") or max_tokens),
                                max_tokens)
    elif api == "messages":
        out["max_tokens"] = min(int(body.get("max_tokens") or max_tokens), max_tokens)
        # adaptive / budgeted thinking asks for more tokens than the cap: thinking stays as the client asked
    elif api == "responses":
        out["max_output_tokens"] = min(int(body.get("max_output_tokens") or max_tokens), max_tokens)
    return out


def carries_output(api: str, ev: dict) -> bool:
    """Whether a stream event carries generated output (text, thinking or a call), in the request's API."""
    if api == "chat":
        for ch in ev.get("choices") or []:
            d = ch.get("delta") or {}
            if d.get("content") or d.get("reasoning_content") or d.get("tool_calls"):
                return True
        return False
    if api == "messages":
        if ev.get("type") == "content_block_delta":
            return True
        return ev.get("type") == "content_block_start" and (ev.get("content_block") or {}).get("type") == "tool_use"
    if api == "responses":
        t = str(ev.get("type") or "")
        return t.endswith(".delta") or (t == "response.output_item.added"
                                         and (ev.get("item") or {}).get("type") == "function_call")
    return False


def memory(pid: int) -> tuple[int, int]:
    """(resident, peak resident) bytes of a process: VmRSS and VmHWM from /proc (0, 0 where there is none)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0, 0
    vals = {}
    for line in text.splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            vals[k] = int(v.split()[0]) * 1024
    return vals.get("VmRSS", 0), vals.get("VmHWM", 0)


@dataclass
class Turn:
    n: int
    api: str
    prompt: int | None = None
    reused: int | None = None
    ttft_s: float | None = None
    decode_tps: float | None = None
    completion: int | None = None
    total_s: float = 0.0
    rss: int = 0
    text: str = ""
    calls: list = field(default_factory=list)
    status: int = 0
    error: str = ""


def one_turn(http: httpx.Client, base: str, n: int, req: dict, pid: int, max_tokens: int) -> Turn:
    """Send one recorded request (streamed) and time it."""
    api = api_of(req["path"])
    t = Turn(n, api or "?")
    body = replay_body(api, req["body"], max_tokens)
    headers = {"content-type": "application/json", "authorization": "Bearer x", "x-api-key": "x",
               **(req.get("headers") or {})}
    t0 = time.perf_counter()
    first = None
    data = b""
    with http.stream("POST", base + req["path"], content=json.dumps(body).encode(), headers=headers) as r:
        t.status = r.status_code
        ctype = r.headers.get("content-type", "")
        buf = b""
        for piece in r.iter_raw():
            data += piece
            if first is None:
                buf += piece
                *whole, buf = buf.split(b"\n")
                for line in whole:
                    evs = sse_events(line)
                    if evs and carries_output(api, evs[0]):
                        first = time.perf_counter()
                        break
    end = time.perf_counter()
    t.total_s = end - t0
    if t.status >= 400:
        t.error = data[:300].decode("utf-8", "replace")
        return t
    a = parse_answer(api, ctype, data)
    t.prompt, t.reused, t.completion = a.prompt_tokens, a.cached_tokens, a.completion_tokens
    if t.reused is None:
        t.reused = llama_cache_n(api, data)
    t.text, t.calls = a.text, a.calls
    if first is not None:
        t.ttft_s = first - t0
        if t.completion and t.completion > 1 and end > first:
            t.decode_tps = (t.completion - 1) / (end - first)
    t.rss = memory(pid)[0]
    return t


def llama_cache_n(api: str, data: bytes) -> int | None:
    """llama-server's own count of prompt tokens it took from its cache, where the API's usage has none: the
    `timings.cache_n` it adds to its events."""
    for ev in reversed(sse_events(data)):
        for holder in (ev, ev.get("response") or {}, ev.get("message") or {}):
            tm = holder.get("timings") if isinstance(holder, dict) else None
            if isinstance(tm, dict) and "cache_n" in tm:
                return int(tm["cache_n"])
    return None


# ---- one session on one server --------------------------------------------------------------------------------------
def send_turn(base: str, pid: int, i: int, req: dict, max_tokens: int, who: str = "") -> Turn:
    """Request i (0-based) of a session to one server -> its Turn; a failed request or an error status is a
    BenchError naming the turn (and `who`, the server, when several are up)."""
    where = f"{who}, " if who else ""
    # a connection per turn: llama-server closes a kept-alive connection after a few requests, and the next
    # request on it fails before the server saw it (clients reconnect; the connection costs both servers the same)
    with httpx.Client(timeout=httpx.Timeout(3600, connect=10)) as http:
        try:
            t = one_turn(http, base, i + 1, req, pid, max_tokens)
        except httpx.HTTPError as e:
            raise BenchError(f"{where}turn {i + 1}: {type(e).__name__}: {e}") from None
    if t.status >= 400:
        raise BenchError(f"{where}turn {i + 1}: HTTP {t.status}: {' '.join(t.error.split())[:200]}")
    return t


def replay(base: str, pid: int, requests: list[dict], max_tokens: int) -> tuple[list[Turn], int]:
    """Every request in order -> (the turns, the server's peak resident memory)."""
    turns = [send_turn(base, pid, i, req, max_tokens) for i, req in enumerate(requests)]
    return turns, memory(pid)[1]


def replay_interleaved(servers: dict[str, tuple[str, int]], requests: list[dict], max_tokens: int
                       ) -> dict[str, tuple[list[Turn], int]]:
    """Every request in order to each server (name -> (base URL, pid)), all up at once, the order of the servers
    alternating from one turn to the next, so that a turn's figures on both meet the same load -> {server: (its
    turns, its peak resident memory)}."""
    names = list(servers)
    turns: dict[str, list[Turn]] = {s: [] for s in names}
    for i, req in enumerate(requests):
        for s in (names if i % 2 == 0 else names[::-1]):
            base, pid = servers[s]
            turns[s].append(send_turn(base, pid, i, req, max_tokens, who=s))
    return {s: (turns[s], memory(servers[s][1])[1]) for s in names}


def exited(proc, seconds: float = 15) -> bool:
    """Whether the server process exits within `seconds` (one that dropped a connection may still be cleaning up)."""
    try:
        proc.wait(timeout=seconds)
        return True
    except Exception:  # subprocess.TimeoutExpired: it is still running
        return False


def start(server: str, gguf: Path, workdir: Path, args, procs: list) -> tuple[str, int]:
    from agent import start_ours, start_peer

    if server == "serve":
        kw = {} if args.cache_ram is None else {"cache_ram": args.cache_ram}
        base = start_ours(gguf, workdir, args.threads, args.ctx, procs, mode="ar", exact=args.exact, **kw)
    else:
        from clients import peer_args

        extra = [*peer_args(args.peer_template, gguf, workdir),
                 *([] if args.cache_ram is None else ["--cache-ram", str(args.cache_ram)])]
        base = start_peer(gguf, workdir, args.threads, args.ctx, procs, tuple(extra), exact=args.exact)
    return base, procs[-1].pid


def run_session(name: str, requests: list[dict], gguf: Path, args) -> dict:
    """The session `name` R times on each server, the servers alternating -> {server: [runs: (turns, peak)]}."""
    from serve import BenchError as ServerError, servers_stopped

    out = {s: [] for s in args.servers}
    for r in range(args.runs):
        if args.interleave:  # both servers up at once, each turn on one then the other
            print(f"{name}: run {r + 1} on {', '.join(args.servers)}, interleaved ...", file=sys.stderr, flush=True)
            with servers_stopped([]) as procs:
                try:
                    up = {s: start(s, gguf, args.workdir, args, procs) for s in args.servers}
                except ServerError as e:
                    raise BenchError(str(e)) from None
                for s, got in replay_interleaved(up, requests, args.max_tokens).items():
                    out[s].append(got)
            continue
        order = args.servers if r % 2 == 0 else args.servers[::-1]
        for s in order:
            for attempt in range(RETRIES + 1):
                print(f"{name}: run {r + 1} on {s} ...", file=sys.stderr, flush=True)
                with servers_stopped([]) as procs:
                    try:
                        base, pid = start(s, gguf, args.workdir, args, procs)
                    except ServerError as e:
                        raise BenchError(str(e)) from None
                    try:
                        turns, peak = replay(base, pid, requests, args.max_tokens)
                        break
                    except BenchError as e:
                        # a server that went away mid-session (on a shared machine something else may stop it):
                        # the run again from a fresh start, once; an HTTP error answer is the server's and final
                        if attempt == RETRIES or not exited(procs[-1]):
                            raise BenchError(f"{name} on {s}: {e}") from None
                        print(f"  {s} exited ({e}): the run again", file=sys.stderr, flush=True)
            for t in turns:
                print(f"  turn {t.n}: prompt {t.prompt} reused {t.reused} ttft {fmt(t.ttft_s, 3)} s", file=sys.stderr,
                      flush=True)
            out[s].append((turns, peak))
    return out


# ---- figures --------------------------------------------------------------------------------------------------------
def fmt(x, nd: int = 2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def same_text(a: Turn, b: Turn) -> bool:
    return " ".join(a.text.split()) == " ".join(b.text.split()) and a.calls == b.calls


def summary(runs: dict) -> list[dict]:
    """Per turn: each server's median figures over the runs, and whether run 1's texts are the same."""
    servers = list(runs)
    n = len(runs[servers[0]][0][0])
    rows = []
    for i in range(n):
        row = {"turn": i + 1}
        for s in servers:
            ts = [turns[i] for turns, _ in runs[s]]
            row[s] = {"prompt": ts[0].prompt, "reused": ts[0].reused, "ttft_s": med(t.ttft_s for t in ts),
                      "decode_tps": med(t.decode_tps for t in ts), "rss": med(t.rss for t in ts)}
        if len(servers) == 2:
            row["same"] = same_text(runs[servers[0]][0][0][i], runs[servers[1]][0][0][i])
        rows.append(row)
    return rows


def totals(runs: dict) -> dict:
    return {s: {"wait_s": med(sum(t.ttft_s or 0 for t in turns) for turns, _ in rs),
                "peak": med(p for _, p in rs)} for s, rs in runs.items()}


def table(name: str, rows: list[dict], tot: dict) -> str:
    servers = [k for k in rows[0] if k not in ("turn", "same")]
    head = ["turn", "prompt"]
    for s in servers:
        head += [f"{s} reused", f"{s} ttft s", f"{s} tok/s", f"{s} RSS MiB"]
    if len(servers) == 2:
        head += ["ttft ratio", "same text"]
    body = []
    for r in rows:
        line = [str(r["turn"]), str(r[servers[0]]["prompt"])]
        for s in servers:
            x = r[s]
            line += [str(x["reused"]), fmt(x["ttft_s"], 3), fmt(x["decode_tps"], 1),
                     "-" if not x["rss"] else f"{x['rss'] / 2**20:.0f}"]
        if len(servers) == 2:
            a, b = r[servers[0]]["ttft_s"], r[servers[1]]["ttft_s"]
            line += [fmt(a / b if a and b else None, 2), "yes" if r["same"] else "no"]
        body.append(line)
    last = ["total", ""]
    for s in servers:
        last += ["", fmt(tot[s]["wait_s"], 3), "", f"peak {tot[s]['peak'] / 2**20:.0f}"]
    if len(servers) == 2:
        a, b = tot[servers[0]]["wait_s"], tot[servers[1]]["wait_s"]
        last += [fmt(a / b if a and b else None, 2), f"{sum(r['same'] for r in rows)}/{len(rows)}"]
    body.append(last)
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    f = lambda x: "| " + " | ".join(c.ljust(w) for c, w in zip(x, widths)) + " |"  # noqa: E731
    return "\n".join([f"{name}:", f(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [f(x) for x in body])


# ---- the slice with the 35B's widths, speaking the tool model's tokens -----------------------------------------------
def make_slice(workdir: Path, experts: int = 64) -> Path:
    """The slice35b (make_tiny's preset: the 35B's layer widths, 3 GDN + 1 attention layer; seed 5; `experts` routed
    experts, top-8 as the 35B) with the tool model's tokenizer, chat template and special ids, so that the recorded
    sessions render to the same prompts as on the tool model; BF16, then Q4_K_M. Made once in `workdir`. Its
    vocabulary is the tool model's 896 rows, not the 35B's 248,320: the embedding and output rows touched per token
    are few either way, and a prompt's tokens are the tool model's."""
    import shutil

    from clover_gguf.convert import convert
    from clover_gguf.quantize import quantize
    from clover_gguf.testing.agent import TOOL_MODEL
    from clover_gguf.testing.make_tiny import make_tiny

    q4 = workdir / f"slice35b-e{experts}-tool-q4_k_m.gguf"
    if q4.is_file():
        return q4
    tool_cfg = json.loads((TOOL_MODEL / "config.json").read_text())
    ckpt = workdir / f"slice35b-e{experts}-tool"
    make_tiny(ckpt, seed=5, preset="slice35b", num_experts=experts, vocab_size=int(tool_cfg["vocab_size"]), quiet=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy(TOOL_MODEL / f, ckpt / f)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update({k: tool_cfg.get(k) for k in ("eos_token_id", "pad_token_id", "mask_token_id", "bos_token_id")})
    (ckpt / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    bf16 = workdir / f"slice35b-e{experts}-tool-bf16.gguf"
    convert(ckpt, bf16, outtype="bf16", quiet=True, force=True)
    quantize(bf16, q4, "Q4_K_M", quiet=True, force=True)
    bf16.unlink()
    shutil.rmtree(ckpt)
    return q4


# ---- main -----------------------------------------------------------------------------------------------------------
def session_path(name: str) -> Path:
    """--sessions' entry: a path to a stored session as it is, else a client's name (its recorded session)."""
    p = Path(name)
    return p if p.suffix == ".gz" or p.is_file() else file_of(name)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", default=None,
                    help="comma-separated client names (bench/sessions/<name>.json.gz) or files; default: all there")
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--model", type=Path, default=None, help="a GGUF, or the tool model's folder (default)")
    ap.add_argument("--slice", action="store_true", help="the slice35b with the 35B's widths at Q4_K_M (made once in "
                    "--workdir, with the tool model's tokenizer) instead of --model")
    ap.add_argument("--ctx", type=int, default=65536)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--turns", type=int, default=None, help="replay only the first N requests of each session")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--exact", action=argparse.BooleanOptionalAction, default=True,
                    help="flash attention off and F32 K/V on both servers (greedy text comparable)")
    ap.add_argument("--cache-ram", type=int, default=None, help="MiB of prompt cache on both servers (default: "
                    "each server's own)")
    ap.add_argument("--peer-template", choices=("model", "tolerant"), default="tolerant",
                    help="llama-server's chat template: tolerant (default; bench/clients.py's: a later system "
                         "message, which Claude Code sends, rendered as a user turn, as serve does) or the model's "
                         "own (which refuses it)")
    ap.add_argument("--interleave", action="store_true",
                    help="both servers up at once, each turn sent to one then the other (the order alternating): "
                         "per-turn ratios under the same load")
    ap.add_argument("--workdir", type=Path, default=ROOT / "out" / "agent-session")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
        bad = [s for s in args.servers if s not in SERVERS]
        if bad or not args.servers:
            raise BenchError(f"--servers: unknown {', '.join(bad) or 'none given'} (known: {', '.join(SERVERS)})")
        for what in ("ctx", "threads", "runs", "max_tokens"):
            if getattr(args, what) < 1:
                raise BenchError(f"--{what.replace('_', '-')} must be at least 1")
        if args.turns is not None and args.turns < 1:
            raise BenchError("--turns must be at least 1")
        if args.cache_ram is not None and args.cache_ram < 0:
            raise BenchError("--cache-ram must be 0 or more")
        if args.model is not None and not args.model.exists():
            raise BenchError(f"--model {args.model}: no such file or folder")
        if args.model is not None and args.slice:
            raise BenchError("--slice and --model: give one")
        names = ([n.strip() for n in args.sessions.split(",") if n.strip()] if args.sessions else
                 recorded())
        if not names:
            raise BenchError("no sessions: record them with `python bench/clients.py --session`")
        args.paths = {n: session_path(n) for n in names}
        missing = [str(p) for p in args.paths.values() if not p.is_file()]
        if missing:
            raise BenchError(f"--sessions: no such file {', '.join(missing)}")
    except BenchError as e:
        ap.exit(2, f"error: {e}\n")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from clients import model_gguf

    args.workdir.mkdir(parents=True, exist_ok=True)
    results = {}
    try:
        gguf = make_slice(args.workdir) if args.slice else model_gguf(args.model, args.workdir, args.ctx)
        for name, path in args.paths.items():
            meta, requests = load(path)
            requests = requests[:args.turns] if args.turns else requests
            runs = run_session(name, requests, gguf, args)
            rows, tot = summary(runs), totals(runs)
            print(table(f"{name} {meta.get('version', '')} ({meta.get('api')}), {len(requests)} turns, "
                        f"median of {args.runs}", rows, tot), flush=True)
            print(flush=True)
            results[name] = {"rows": rows, "totals": tot,
                             "runs": {s: [[asdict(t) for t in turns] for turns, _ in rs] for s, rs in runs.items()}}
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    (args.workdir / "agent_session.json").write_text(json.dumps(results, indent=1) + "\n")
    if args.json:
        print(json.dumps({k: {"rows": v["rows"], "totals": v["totals"]} for k, v in results.items()}))


if __name__ == "__main__":
    main()
