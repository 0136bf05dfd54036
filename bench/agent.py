"""Agent traces on the tool-trained tiny Clover through `clover-gguf serve`, modes interleaved, and the patched
`llama-server --jinja` on the same GGUF and the same requests.

    python bench/agent.py [--model DIR|GGUF] [--tasks N] [--traces 30] [--rounds 2]
                          [--modes ar,draft-self,auto,diffusion] [--peer | --no-peer] [--threads 1]
                          [--workdir out/bench-agent] [--json]

The model is clover_gguf.testing.agent.TOOL_MODEL unless --model says another (a folder is converted to F32 first).

Traces: --traces held-out tasks of the model's eval set (clover_gguf.testing.agent.held_out_tasks, spread evenly over
it: every kind), each run once from its question through the tool loop on our serve (AR, greedy): the model's calls, the
tools' results run in Python, the final answer (JSON where the task asks for it). Each assistant turn of a trace is one
request to replay: the conversation before it, the same body in every mode. Replay: --rounds rounds; in each, every
request once per mode, the modes in a seeded shuffled order per request (so no mode always follows another), after two
untimed warm-up passes over all requests (a prompt seen before is kept by the server) and, in each round, one more of
the request itself just before its timed ones (the one slot keeps one prompt: timed requests decode what they generate,
as an agent's turns do, and none pays a prompt pass for the others). Per mode, from each request's `clover_stats`:
generated tokens over the server's seconds for the request (tok/s; also after the prompt pass), tokens per pass,
accepted tokens per draft, split by what the turn writes: a tool call, a long call (a long task's write_file of
14-30 lines), prose (a final answer) or JSON. Ratios:
draft-self / ar, auto / the faster of ar and draft-self (the issue's bars: >= 1.4 and >= 0.95). Greedy text (thinking,
content, calls) equal across ar, draft-self and auto on every request. The grammar's cost: every call turn again with
its call forced (tool_choice: the named function) and every JSON turn with the task's schema as its response_format,
both in ar and draft-self: tok/s and tokens per pass constrained against not, and whether the text is the same; and each
constrained turn once more with the grammar's forced tokens decoded by passes (the request's `forced_tokens: false`):
forced tokens on against off.

--peer (the default; --no-peer skips it): llama-server and our serve both up, each held-out task's answered turn
(--tasks: the first N) sent to both (ours in ar) with tool_choice auto, greedy, every penalty off: the same
tool_calls (name and arguments, parsed) and the same content, task by task; where they differ both answers are
printed.

Figures only, no asserts on timing; the load average at the start and the end is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import httpx  # noqa: E402

from clover_gguf.testing.agent import TOOL_MODEL, Task, held_out_tasks, run_tool  # noqa: E402
from serve import BenchError, free_port, servers_stopped, start_logged, wait_ready  # noqa: E402

# greedy and every penalty off, on both servers (their names for them): the same sampling in one body
SAME = {"temperature": 0.0, "seed": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
        "repeat_penalty": 1.0}
EXACT_MODES = ("ar", "draft-self", "auto")
MAX_TOKENS = 512
TURN_KINDS = ("call", "long call", "prose", "json")


def spread(tasks: list, n: int) -> list:
    """n of the tasks spread evenly over the list (the eval set, kind after kind: every kind gets its share); n 0 or
    past the list: all of them."""
    if not n or n >= len(tasks):
        return list(tasks)
    return [tasks[i * len(tasks) // n] for i in range(n)]


# ---- the servers ---------------------------------------------------------------------------------------------------
def start_ours(gguf: Path, workdir: Path, threads: int, ctx: int, procs: list, mode: str = "auto",
               exact: bool = True, cache_ram: int | None = None) -> str:
    """`clover-gguf serve` in a subprocess (one slot); exact: flash attention off and F32 K/V, the tests' settings,
    under which greedy draft-self and auto write greedy AR's text; cache_ram: its --cache-ram in MiB (None: its
    default)."""
    port = free_port()
    ram = "" if cache_ram is None else f"cache_ram={cache_ram * 2**20}, "
    code = ("from clover_gguf.serve import serve; "
            f"serve({str(gguf)!r}, port={port}, ctx={ctx}, mode={mode!r}, n_threads={threads}, exact={exact}, {ram}"
            "log_level='warning')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = start_logged([sys.executable, "-c", code], workdir / f"clover-serve-{mode}.log", cwd=ROOT, env=env)
    procs.append(proc)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, proc, "clover-gguf serve")
    return base


def start_peer(gguf: Path, workdir: Path, threads: int, ctx: int, procs: list, extra: tuple = (),
               exact: bool = True) -> str:
    """The patched llama-server (the cached build: clover_gguf.build.llama_tool), --jinja, one slot, in the exact
    settings our side runs (flash attention off, F32 K/V): near-ties between two logits cannot come out differently
    for the arithmetic's sake, so where the answers differ the parse, the template or the sampling does. extra: more
    llama-server arguments (bench/clients.py: --chat-template-file); exact=False: its own defaults there."""
    from clover_gguf.build import llama_tool
    from clover_gguf.errors import UserError

    try:
        exe = llama_tool("llama-server")
    except UserError as e:
        raise BenchError(f"starting llama-server: {e}") from None
    port = free_port()
    cmd = [str(exe), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-c", str(ctx), "-np", "1",
           "-t", str(threads), "--jinja", "--no-webui", "--no-warmup",
           *(("-fa", "off", "-ctk", "f32", "-ctv", "f32") if exact else ()), *extra]
    proc = start_logged(cmd, workdir / "llama-server.log")
    procs.append(proc)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, proc, "llama-server")
    return base


def post(base: str, body: dict, step: str) -> dict:
    try:
        r = httpx.post(base + "/v1/chat/completions", json={"model": "m", **body}, timeout=900)
    except httpx.HTTPError as e:
        raise BenchError(f"{step}: {type(e).__name__}: {e}") from None
    if r.status_code >= 400:
        raise BenchError(f"{step}: HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


# ---- answers, as both servers write them ---------------------------------------------------------------------------
def calls_of(resp: dict) -> list[tuple[str, dict]]:
    """The answer's tool calls, arguments parsed (JSON text on both servers; key order aside)."""
    msg = resp["choices"][0]["message"]
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls") or []]


def text_of(resp: dict) -> str:
    """Everything the answer wrote, for equality across modes: thinking, content, calls (as sent)."""
    msg = resp["choices"][0]["message"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
    return json.dumps([msg.get("reasoning_content"), msg.get("content"), calls])


# ---- traces --------------------------------------------------------------------------------------------------------
@dataclass
class Turn:
    """One assistant turn of a trace to replay: the body (the conversation before it), what it writes (a tool call,
    prose or JSON), and the same turn under a grammar: its call forced (tool_choice: the named function) or its JSON
    constrained to the task's schema (response_format), where that is the same work."""

    task: str
    body: dict
    kind: str  # TURN_KINDS: a call, a long call (a long task's write_file), prose or JSON
    constrained: dict | None = None


def record_traces(base: str, tasks: list[Task], max_steps: int = 4) -> list[Turn]:
    """Each task from its question through the tool loop on our serve (AR, greedy, the tools run in Python) -> its
    turns, ready to replay."""
    turns: list[Turn] = []
    for t in tasks:
        messages = list(t.question)
        for _ in range(max_steps):
            body = {"messages": list(messages), "tools": t.tools, "tool_choice": "auto", "max_tokens": MAX_TOKENS,
                    "chat_template_kwargs": {"enable_thinking": t.think}, **SAME}
            resp = post(base, {**body, "mode": "ar"}, f"recording task {t.id}")
            msg = resp["choices"][0]["message"]
            calls = msg.get("tool_calls") or []
            if calls:
                kind = "long call" if t.kind == "long" else "call"
                # a named choice forces one call: the same work only where the model wrote one
                constrained = ({**body, "tool_choice": {"type": "function", "function": {
                    "name": calls[0]["function"]["name"]}}} if len(calls) == 1 else None)
            elif t.schema is not None:
                kind, constrained = "json", {**body, "response_format": t.schema}
            else:
                kind, constrained = "prose", None
            turns.append(Turn(t.id, body, kind, constrained))
            if not calls:
                break
            messages.append({"role": "assistant", "content": msg.get("content") or "", "tool_calls": calls})
            for c in calls:
                messages.append({"role": "tool", "tool_call_id": c["id"],
                                 "content": run_tool(c["function"]["name"], json.loads(c["function"]["arguments"]))})
    return turns


# ---- replay --------------------------------------------------------------------------------------------------------
@dataclass
class Tally:
    tokens: int = 0
    seconds: float = 0.0  # the server's, per request (prompt and decode)
    decode_seconds: float = 0.0
    passes: int = 0  # decode passes
    drafts: int = 0
    accepted: int = 0  # accepted draft tokens (the causal pass's kept block tokens)
    forced: int = 0  # tokens a grammar forced, placed without a pass (stats.forced_tokens, where the decoders have it)
    requests: int = 0

    def add(self, st: dict) -> None:
        self.tokens += st["generated_tokens"]
        self.seconds += st["seconds"]
        self.decode_seconds += max(0.0, st["seconds"] - st["prompt_seconds"])
        self.passes += st["decode_passes"]
        self.drafts += st.get("drafts") or 0
        self.accepted += st.get("accepted_tokens") or 0
        self.forced += st.get("forced_tokens") or 0
        self.requests += 1

    def row(self) -> dict:
        return {"tokens": self.tokens, "tok_s": self.tokens / self.seconds if self.seconds else 0.0,
                "decode_tok_s": self.tokens / self.decode_seconds if self.decode_seconds else 0.0,
                "tokens_per_pass": self.tokens / self.passes if self.passes else 0.0,
                "accepted_per_draft": self.accepted / self.drafts if self.drafts else None,
                "drafts": self.drafts, "forced_tokens": self.forced, "requests": self.requests}


@dataclass
class Replay:
    by_mode: dict = field(default_factory=dict)  # (label, kind or "all") -> Tally
    texts: dict = field(default_factory=dict)  # (label, turn index) -> [text per round]
    rounds_tps: dict = field(default_factory=dict)  # (label, round) -> Tally


def replay(base: str, turns: list[Turn], modes: list[str], rounds: int, seed: int = 0) -> Replay:
    """Every turn once per configuration per round, configurations in a seeded shuffled order per turn. A
    configuration is a mode, or for ar and draft-self "MODE +grammar" (the turn's constrained variant) and "MODE
    +grammar -forced" (the same with the grammar's forced tokens decoded by passes: the request's forced_tokens
    false)."""
    out = Replay()
    rng = random.Random(seed)
    configs = [(m, None) for m in modes] + [(m, v) for m in ("ar", "draft-self") if m in modes
                                            for v in ("grammar", "grammar, not forced")]

    def warm(t: Turn, label: str) -> None:  # an untimed request of the turn: its prompt's state is then kept
        post(base, {**t.body, "mode": "ar", "max_tokens": 1}, label)

    for k in range(2):  # warm-up: every prompt twice (serve keeps a prompt's state from its second time on)
        for i, t in enumerate(turns):
            warm(t, f"warm-up {k + 1}, turn {i}")
    for r in range(rounds):
        for i, t in enumerate(turns):
            # the slot keeps one prompt's state: the turn's own, untimed, so that no configuration pays a prompt pass
            # that another one, drawn first, would have paid (with one slot and many turns, the first request of a
            # turn found its prompt gone, and that order, not the mode, set a large part of its tok/s)
            warm(t, f"round {r + 1}, turn {i}, warm-up")
            order = list(configs)
            rng.shuffle(order)
            for mode, variant in order:
                if variant and t.constrained is None:
                    continue
                body = {**(t.constrained if variant else t.body), "mode": mode}
                if variant == "grammar, not forced":
                    body["forced_tokens"] = False
                label = {None: mode, "grammar": f"{mode} +grammar", "grammar, not forced": f"{mode} +grammar -forced"}[
                    variant]
                resp = post(base, body, f"round {r + 1}, turn {i} ({t.task}), {label}")
                st = resp["clover_stats"]
                for key in ((label, "all"), (label, t.kind), (label, f"round {r + 1}")):
                    out.by_mode.setdefault(key, Tally()).add(st)
                out.texts.setdefault((label, i), []).append(text_of(resp))
    return out


def summarize(rep: Replay, turns: list[Turn], modes: list[str]) -> dict:
    rows = {f"{label} | {kind}": tally.row() for (label, kind), tally in sorted(rep.by_mode.items())}
    tps = {m: rep.by_mode[(m, "all")].row()["tok_s"] for m in modes if (m, "all") in rep.by_mode}
    dec = {m: rep.by_mode[(m, "all")].row()["decode_tok_s"] for m in modes if (m, "all") in rep.by_mode}
    ratios = {}
    if "ar" in tps and "draft-self" in tps:
        ratios["draft-self / ar"] = tps["draft-self"] / tps["ar"]
        ratios["draft-self / ar (after the prompt pass)"] = dec["draft-self"] / dec["ar"]
        if "auto" in tps:
            ratios["auto / max(ar, draft-self)"] = tps["auto"] / max(tps["ar"], tps["draft-self"])
            ratios["auto / max(ar, draft-self) (after the prompt pass)"] = dec["auto"] / max(dec["ar"],
                                                                                             dec["draft-self"])
    if "diffusion" in tps and "ar" in tps:
        ratios["diffusion / ar"] = tps["diffusion"] / tps["ar"]
    for m in ("ar", "draft-self"):
        for kind in ("call", "json"):
            free, con = rep.by_mode.get((m, kind)), rep.by_mode.get((f"{m} +grammar", kind))
            if free and con and free.seconds and con.seconds:
                ratios[f"{m} {kind}: constrained / free (tok/s)"] = con.row()["tok_s"] / free.row()["tok_s"]
                ratios[f"{m} {kind}: constrained / free (tokens per pass)"] = (con.row()["tokens_per_pass"]
                                                                             / free.row()["tokens_per_pass"])
            off = rep.by_mode.get((f"{m} +grammar -forced", kind))
            if con and off and con.seconds and off.seconds:
                ratios[f"{m} {kind}: forced tokens on / off (tok/s)"] = con.row()["tok_s"] / off.row()["tok_s"]
                ratios[f"{m} {kind}: forced tokens on / off (tokens per pass)"] = (con.row()["tokens_per_pass"]
                                                                                 / off.row()["tokens_per_pass"])
    # greedy text: every exact mode's text of each turn, every round, equal to AR's first
    unequal = []
    for i in range(len(turns)):
        ref = rep.texts.get(("ar", i), [None])[0]
        for m in EXACT_MODES:
            for k, text in enumerate(rep.texts.get((m, i), [])):
                if text != ref:
                    unequal.append({"turn": i, "task": turns[i].task, "mode": m, "round": k + 1})
    # the constrained variants: the same text as the free answer (the grammar forcing what the model wrote anyway)
    variant_same = {}
    for m in ("ar", "draft-self"):
        for v in ("+grammar", "+grammar -forced"):
            pairs = [(rep.texts[(m, i)][0], rep.texts[(f"{m} {v}", i)][0]) for i in range(len(turns))
                     if (f"{m} {v}", i) in rep.texts]
            if pairs:
                variant_same[f"{m} {v}"] = [sum(a == b for a, b in pairs), len(pairs)]
    return {"rows": rows, "ratios": ratios, "unequal_text": unequal, "variant_same_text": variant_same}


# ---- the peer: llama-server on the same requests -------------------------------------------------------------------
def peer_compare(ours: str, peer: str, tasks: list[Task]) -> list[dict]:
    """Each task's answered turn to both servers (its conversation; tool_choice auto, greedy, penalties off, thinking
    as the task has it) -> per task:
    both servers' calls and content, and whether they are the same."""
    out = []
    for t in tasks:
        body = {"messages": t.messages, "tools": t.tools, "tool_choice": "auto", "max_tokens": MAX_TOKENS, **SAME,
                "chat_template_kwargs": {"enable_thinking": t.think}}
        a = post(ours, {**body, "mode": "ar"}, f"task {t.id} (clover-gguf)")
        b = post(peer, body, f"task {t.id} (llama-server)")
        ma, mb = a["choices"][0]["message"], b["choices"][0]["message"]
        row = {"task": t.id, "ours_calls": calls_of(a), "peer_calls": calls_of(b),
               "ours_content": (ma.get("content") or "").strip(), "peer_content": (mb.get("content") or "").strip(),
               "ours_finish": a["choices"][0]["finish_reason"], "peer_finish": b["choices"][0]["finish_reason"],
               "ours_tokens": a["usage"]["completion_tokens"], "peer_tokens": b["usage"]["completion_tokens"],
               "ours_prompt_tokens": a["usage"]["prompt_tokens"], "peer_prompt_tokens": b["usage"]["prompt_tokens"],
               "ours_raw_arguments": [c["function"]["arguments"] for c in ma.get("tool_calls") or []],
               "peer_raw_arguments": [c["function"]["arguments"] for c in mb.get("tool_calls") or []],
               "expected_calls": t.calls}
        row["same_calls"] = row["ours_calls"] == row["peer_calls"]
        row["same_content"] = row["ours_content"] == row["peer_content"]
        out.append(row)
    return out


def print_peer(rows: list[dict]) -> None:
    same = sum(r["same_calls"] for r in rows)
    both = sum(r["same_calls"] and r["same_content"] for r in rows)
    with_calls = sum(bool(r["ours_calls"]) for r in rows)
    # llama-server's completion_tokens count the end token it sampled; ours count the answer's tokens
    print(f"\nllama-server --jinja against clover-gguf serve --mode ar, tool_choice auto, greedy: the same tool_calls "
          f"on {same}/{len(rows)} tasks ({with_calls} with calls on our side), calls and content on {both}/{len(rows)};"
          f" prompt tokens equal on {sum(r['ours_prompt_tokens'] == r['peer_prompt_tokens'] for r in rows)}, "
          f"generated tokens equal (llama-server's less its end token) on "
          f"{sum(r['ours_tokens'] == r['peer_tokens'] - (r['peer_finish'] != 'length') for r in rows)}")
    for r in rows:
        if not (r["same_calls"] and r["same_content"]):
            print(f"  task {r['task']}: differs\n    ours:  {r['ours_calls']} {r['ours_content'][:200]!r} "
                  f"({r['ours_finish']}, {r['ours_tokens']} tokens)\n    peer:  {r['peer_calls']} "
                  f"{r['peer_content'][:200]!r} ({r['peer_finish']}, {r['peer_tokens']} tokens)"
                  f"\n    expected: {r['expected_calls']}")


def print_replay(s: dict, load: tuple) -> None:
    print(f"\nreplay (load average {load[0]:.2f} at the start, {load[1]:.2f} at the end)")
    print(f"{'mode | turns':<34} {'tokens':>7} {'tok/s':>8} {'after prompt':>12} {'tok/pass':>8} {'acc/draft':>9} "
          f"{'forced':>6}")
    for name, r in s["rows"].items():
        if "round" in name:
            continue
        apd = "" if r["accepted_per_draft"] is None else f"{r['accepted_per_draft']:.2f}"
        print(f"{name:<34} {r['tokens']:>7} {r['tok_s']:>8.1f} {r['decode_tok_s']:>12.1f} "
              f"{r['tokens_per_pass']:>8.2f} {apd:>9} {r['forced_tokens']:>6}")
    for k, v in s["ratios"].items():
        print(f"  {k}: {v:.3f}")
    for m in ("draft-self", "auto"):
        per = {k: s["rows"].get(f"{m} | {k}", {}).get("accepted_per_draft") for k in TURN_KINDS}
        print(f"  {m}, accepted tokens per draft: "
              + ", ".join(f"{k} {v:.2f}" for k, v in per.items() if v is not None))
    print(f"  greedy text equal across {', '.join(EXACT_MODES)}: "
          + ("yes, on every turn and round" if not s["unequal_text"] else f"NO: {s['unequal_text'][:6]}"))
    for k, (a, n) in s["variant_same_text"].items():
        print(f"  {k}: the same text as without the grammar on {a}/{n} turns")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=TOOL_MODEL, help="the tool model's folder (converted) or a GGUF")
    ap.add_argument("--tasks", type=int, default=0, help="held-out tasks llama-server is compared on (0: all)")
    ap.add_argument("--traces", type=int, default=30,
                    help="held-out tasks whose traces are replayed, spread evenly over the eval set (0: all)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--modes", default="ar,draft-self,auto,diffusion")
    ap.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True,
                    help="compare llama-server's tool_calls on every held-out task")
    ap.add_argument("--replay", action=argparse.BooleanOptionalAction, default=True, help="the modes' replay")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--workdir", type=Path, default=ROOT / "out" / "bench-agent")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        run(args)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


def run(args) -> None:
    from clover_gguf.convert import convert

    args.workdir.mkdir(parents=True, exist_ok=True)
    gguf, folder = args.model, args.model
    if args.model.is_dir():
        gguf = args.workdir / f"{args.model.name}-f32.gguf"
        convert(args.model, gguf, outtype="f32", quiet=True, force=True)
    else:
        folder = TOOL_MODEL
    all_tasks = held_out_tasks(folder)
    tasks = all_tasks[:args.tasks] if args.tasks else all_tasks
    modes = [m for m in args.modes.split(",") if m]
    report: dict = {"model": str(args.model), "tasks": len(tasks), "threads": args.threads, "rounds": args.rounds,
                    "loadavg_start": os.getloadavg()[0]}
    t0 = time.perf_counter()
    with servers_stopped([]) as procs:
        ours = start_ours(gguf, args.workdir, args.threads, args.ctx, procs)
        if args.peer:
            peer = start_peer(gguf, args.workdir, args.threads, args.ctx, procs)
            report["peer"] = peer_compare(ours, peer, tasks)
            print_peer(report["peer"])
            procs.pop().terminate()
        if args.replay:
            every = spread(all_tasks, args.traces)
            turns = record_traces(ours, every)
            kinds = {k: sum(t.kind == k for t in turns) for k in TURN_KINDS}
            print(f"\n{len(every)} traces, {len(turns)} turns to replay ({kinds}), modes {', '.join(modes)}, "
                  f"{args.rounds} rounds")
            load0 = os.getloadavg()[0]
            rep = replay(ours, turns, modes, args.rounds)
            s = summarize(rep, turns, modes)
            load1 = os.getloadavg()[0]
            report["replay"] = {**s, "loadavg": [load0, load1], "turns": kinds}
            print_replay(s, (load0, load1))
    report["wall_s"] = time.perf_counter() - t0
    report["loadavg_end"] = os.getloadavg()[0]
    (args.workdir / "agent.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"\n{report['wall_s']:.0f} s; the report in {args.workdir / 'agent.json'}")
    if args.json:
        print(json.dumps(report, default=str))


if __name__ == "__main__":
    main()
