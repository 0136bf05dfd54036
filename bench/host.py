"""The host's share of decoding at the 35B's vocabulary (V = 248,320): milliseconds per AR step and per 32-token block
pass spent outside llama_decode (Python, copies, the controls and the choice), before (the rows' logits copied out,
the controls and the choice in numpy) and after (the selection in llama.cpp's graph, libclover_sampler), and AR tokens/s
through `clover-gguf generate` against llama.cpp's own `llama-bench` on the same GGUF.

    python bench/host.py [--workdir out/bench-host] [--vocab-size 248320] [--threads 2] [--rounds 5]
        [--history 400] [--gguf PATH] [--bench-rounds 5] [--bench-tokens 256] [--constrained-rounds 3]
        [--constrained-tps-rounds 3] [--constrained-tokens 96] [--forced-rounds 3] [--forced-tokens 200]

1. The model: a random tiny Clover (make_tiny's `tiny`: hidden 64, 4 layers, 8 experts) grown to the 35B's vocabulary,
   F32 GGUF, made once in the work folder: its step is short, so the host's share shows (the slice's 70 ms CPU step
   would hide it). --gguf uses another file.
2. Per pass, two runtimes (before: the dense path; after: the graph's), rounds interleaved, the card's controls on:
   an answer of --history tokens and 64 more AR steps, each step timed from one token to the next (the runtime's
   whole loop: the pass, the choice, the stats, the text); diffusion with threshold 0, so that every block is one
   pass over 32 masked positions plus the causal commit of the block, timed from one block to the next. Host time =
   wall time - time inside llama_decode (bench/measure.PassLog, llama_synchronize included); medians over the steps
   and blocks after --history tokens.
3. AR tokens/s: `clover-gguf generate --mode ar` (its decode tok/s, --json) and `llama-bench -p 0 -n N` (tg),
   alternately, --threads each; medians and their ratio. Beside them the same runtime's bare loop (FLOOR_RUN:
   llama_decode and the greedy choice from the graph's rows, nothing else), the most a Python driver can reach.
4. With a grammar (issue 49, constrained output): the graph's selection with a synthetic constraint of realistic
   masks at this vocabulary (clover_gguf.testing.automaton: a JSON string's position allows all but 8,300 ids, a
   structure position 60; "json" cycles 4 structure and 12 string positions; the masks are precomputed, so the
   figures hold the decoders' and the sampler's cost of a mask, not a grammar engine's own), --constrained-rounds
   interleaved: host ms per AR step, per 32-row block pass (a block's first, diffusion at threshold 0) and per
   commit, from pass-to-pass intervals (the time from a pass's start to the next's, less its llama_decode). Then
   tok/s of the same request constrained (json) against unconstrained, in each mode, one runtime, rounds
   interleaved; and on the bundled trained model (drafts it would make) with a character grammar (text without the
   letter e: most of its vocabulary allowed) and a JSON pattern.
5. Forced tokens (issue 54 item 3): on the bundled trained model, the grammars serve builds with llguidance (a
   json_schema answer, a tool_choice "required" call), each mode, forced tokens on and off (decoding.generate's
   `forced`), --forced-rounds interleaved: tokens per pass after the prompt's, decode tok/s, forced tokens per answer,
   and whether greedy text was the same; the load average beside them.
Goals (issue 23, issue 49 item 5): after, at most 0.5 ms of host time per AR step and 2 ms per 32-token block pass,
with a grammar's mask too; generate at least 0.95x llama-bench's tg. Figures are printed, nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from clover_gguf.testing.make_tiny import UNUSED_VOCAB_ROWS  # noqa: E402
from measure import PassLog, at_least  # noqa: E402

PROMPT = "Count from 1 to 1000, one number per line."
AR_STEPS = 64  # timed AR steps after the history
BLOCKS = 4  # timed block passes after the history


def make_model(wd: Path, vocab_size: int) -> Path:
    """make_tiny's `tiny` preset with this vocabulary, converted to F32 GGUF (kept in the work folder)."""
    from clover_gguf.convert import convert
    from clover_gguf.testing.make_tiny import make_tiny

    gguf = wd / f"tiny-v{vocab_size}-f32.gguf"
    if not gguf.is_file():
        ckpt = wd / f"tiny-v{vocab_size}"
        if not (ckpt / "config.json").is_file():
            make_tiny(ckpt, seed=0, preset="tiny", vocab_size=vocab_size)
        convert(ckpt, gguf, outtype="f32", quiet=True)
    return gguf


def timed_run(rt, log: PassLog, ids, mode: str, n_new: int, **kw) -> list[tuple[float, float]]:
    """(wall seconds, seconds in llama_decode) from each chunk to the next of one answer (AR: a token; diffusion with
    threshold 0: a block)."""
    log.clear()
    log.mode = mode
    marks = []
    for _ in rt.stream_ids(ids, mode=mode, max_new_tokens=n_new, **kw):
        marks.append((time.perf_counter(), len(log.passes)))
    out = []
    for (t0, k0), (t1, k1) in zip(marks, marks[1:]):
        out.append((t1 - t0, sum(p.decode_seconds for p in log.passes[k0:k1])))
    return out


def bench_passes(gguf: Path, threads: int | None, rounds: int, history: int, **runtime) -> dict:
    """Host ms per AR step and per 32-token block pass (+ its commit), numpy selection (before) and graph selection
    (after), rounds interleaved (bench/device/steps.py's host step runs it on the GPU). runtime: CloverRuntime's
    options (offload)."""
    from clover_gguf.runtime import CloverRuntime

    n_ar = history + AR_STEPS
    n_blocks = -(-history // 32) + BLOCKS
    n_ctx = n_blocks * 32 + 256
    rts = {"before": CloverRuntime(gguf, n_ctx=n_ctx, n_threads=threads, selection="numpy", **runtime),
           "after": CloverRuntime(gguf, n_ctx=n_ctx, n_threads=threads, selection="graph", **runtime)}
    logs = {k: PassLog(rt) for k, rt in rts.items()}
    ids = rts["after"].prompt_ids(PROMPT, think=False)
    samples = {k: {"ar": [], "block": []} for k in rts}
    try:
        for k, rt in rts.items():  # warm-up: every graph shape once
            rt.generate(PROMPT, mode="ar", max_new_tokens=4, think=False)
            rt.generate(PROMPT, mode="diffusion", max_new_tokens=64, threshold=0.0, think=False)
        for r in range(rounds):
            for k, rt in rts.items():
                steps = timed_run(rt, logs[k], ids, "ar", n_ar)
                samples[k]["ar"] += steps[history - 1:]  # the steps whose history holds `history` tokens or more
                blocks = timed_run(rt, logs[k], ids, "diffusion", n_blocks * 32, threshold=0.0)
                samples[k]["block"] += blocks[-(-history // 32) - 1:]
            print(f"  round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    finally:
        for k, rt in rts.items():
            logs[k].close()
            rt.close()
    res = {}
    for k, kinds in samples.items():
        res[k] = {}
        for kind, xs in kinds.items():
            wall = statistics.median(w for w, _ in xs)
            host = statistics.median(w - d for w, d in xs)
            dec = statistics.median(d for _, d in xs)
            res[k][kind] = {"n": len(xs), "wall_ms": 1e3 * wall, "host_ms": 1e3 * host, "decode_ms": 1e3 * dec,
                            "llama_share": dec / wall if wall else 0.0}
    return res


def llama_bench_runs(gguf: Path, *args: str) -> list[dict]:
    """llama-bench (the cached build) on `gguf` with these arguments: its JSON records, one per test."""
    from clover_gguf.build import llama_tool

    tool = llama_tool("llama-bench")
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(tool.parent),
                                                                          os.environ.get("LD_LIBRARY_PATH")]))}
    p = subprocess.run([str(tool), "-m", str(gguf), *args, "-o", "json"], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"llama-bench failed: {p.stderr.strip()[-1000:]}")
    return json.loads(p.stdout)


def llama_bench(gguf: Path, threads: int, n: int) -> float:
    """llama-bench's AR tok/s (tg n)."""
    return float(llama_bench_runs(gguf, "-p", "0", "-n", str(n), "-t", str(threads), "-r", "1")[0]["avg_ts"])


def generate_tps(gguf: Path, threads: int, n: int) -> float:
    cmd = [sys.executable, "-m", "clover_gguf", "generate", str(gguf), "-p", PROMPT, "--no-think", "--mode", "ar",
           "--max-new-tokens", str(n), "--threads", str(threads), "--ctx", str(n + 256), "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if p.returncode != 0:
        raise SystemExit(f"clover-gguf generate failed: {p.stderr.strip()[-1000:]}")
    stats = json.loads(p.stdout)["stats"]
    if stats["generated_tokens"] != n:
        print(f"  note: generate stopped after {stats['generated_tokens']} tokens", file=sys.stderr)
    return float(stats["decode_tokens_per_s"])


# the same request as `clover-gguf generate` makes (CloverRuntime.generate, its decode tok/s), with the selection
# chosen: "numpy" is the path before the selection sampler, which the command line no longer takes
SELECTION_RUN = """
import json, sys
from clover_gguf.runtime import CloverRuntime
gguf, selection, n, threads, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
with CloverRuntime(gguf, n_ctx=n + 256, n_threads=threads, selection=selection) as rt:
    a = rt.generate(prompt, mode="ar", max_new_tokens=n, think=False)
print(json.dumps(a.stats.to_json()))
"""


# the ceiling of any Python driver with the selection in the graph: llama_decode on a one-token batch and the greedy
# choice the graph made, nothing else (no controls, no stats, no text): what is left of the gap
# to llama-bench here is llama.cpp's (the selection's ops in the graph against llama-bench's logits copy)
FLOOR_RUN = """
import ctypes, json, sys, time
import numpy as np
from clover_gguf.controls import Gather
from clover_gguf.runtime import CloverRuntime
gguf, n, threads, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
with CloverRuntime(gguf, n_ctx=n + 256, n_threads=threads) as rt:
    ctx = rt.ctx
    ids = rt.prompt_ids(prompt, think=False)
    g = Gather(ids=np.array([rt.eos_ids[0]], dtype=np.int32), n_rows=1, width=32, probs=False)
    # the prompt (its last row selected); attaches the selection sampler to sequence 0
    rows = ctx.decode(ids, 0, 0, logits=[False] * (len(ids) - 1) + [True], gather=g)
    L, api, c = ctx.L, ctx._api, ctx.ctx
    tok = (ctypes.c_int32 * 1)()
    last = g.width + rows.rest_ids.shape[1]  # the candidates' last entry: the choice
    t0 = time.perf_counter()
    t = int(rows.tokens[0])
    for i in range(n):
        tok[0] = t
        if L.llama_decode(c, L.llama_batch_get_one(tok, 1)) != 0:
            raise SystemExit("llama_decode failed")
        t = int(ctx._row_view(api.llama_get_sampled_candidates_ith(c, 0), last + 1, np.int32)[last])
    print(json.dumps({"tok_s": n / (time.perf_counter() - t0)}))
"""


def floor_tps(gguf: Path, threads: int, n: int) -> float:
    p = subprocess.run([sys.executable, "-c", FLOOR_RUN, str(gguf), str(n), str(threads), PROMPT],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if p.returncode != 0:
        raise SystemExit(f"the bare decode loop failed: {p.stderr.strip()[-1000:]}")
    return float(json.loads(p.stdout)["tok_s"])


def selection_tps(gguf: Path, threads: int, n: int, selection: str) -> float:
    p = subprocess.run([sys.executable, "-c", SELECTION_RUN, str(gguf), selection, str(n), str(threads), PROMPT],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if p.returncode != 0:
        raise SystemExit(f"generate ({selection}) failed: {p.stderr.strip()[-1000:]}")
    return float(json.loads(p.stdout)["decode_tokens_per_s"])


def bench_tps(gguf: Path, threads: int, rounds: int, n: int) -> dict:
    """Per round, alternately: `clover-gguf generate` (graph selection), `llama-bench` tg, and the same generate with
    the numpy selection (before)."""
    ours, theirs, before, floor = [], [], [], []
    for r in range(rounds):
        ours.append(generate_tps(gguf, threads, n))
        theirs.append(llama_bench(gguf, threads, n))
        before.append(selection_tps(gguf, threads, n, "numpy"))
        floor.append(floor_tps(gguf, threads, n))
        print(f"  round {r + 1}/{rounds}: generate {ours[-1]:.1f} tok/s, llama-bench {theirs[-1]:.1f} tok/s, "
              f"generate with numpy selection {before[-1]:.1f} tok/s, bare decode loop {floor[-1]:.1f} tok/s",
              file=sys.stderr, flush=True)
    g, b, o = statistics.median(ours), statistics.median(theirs), statistics.median(before)
    f = statistics.median(floor)
    return {"generate_tok_s": g, "llama_bench_tok_s": b, "ratio": g / b, "numpy_selection_tok_s": o,
            "numpy_ratio": o / b, "floor_tok_s": f, "floor_ratio": f / b, "generate_all": ours,
            "llama_bench_all": theirs, "numpy_selection_all": before, "floor_all": floor}


# ---- with a grammar (issue 49) ---------------------------------------------------------------------------------
KINDS = ("none", "structure", "string", "json")
MODES = ("ar", "diffusion", "draft-self", "auto")


def constraint_of(kind: str, n_vocab: int):
    """A synthetic grammar of realistic masks at this vocabulary (module doc, item 4); None for "none"."""
    from clover_gguf.testing.automaton import MaskCycle, string_mask, structure_mask

    if kind == "none":
        return None
    s, t = string_mask(n_vocab), structure_mask(n_vocab)
    return MaskCycle({"string": [s], "structure": [t], "json": [t] * 4 + [s] * 12}[kind])


def cycles(log: PassLog) -> list[tuple[str, float, bool]]:
    """(kind, host seconds, whether it follows another kind) per pass but the last: the time from its start to the
    next pass's, less its llama_decode time."""
    ps = sorted(log.passes, key=lambda p: p.start)
    return [(p.kind, q.start - p.start - p.decode_seconds, i == 0 or ps[i - 1].kind != p.kind)
            for i, (p, q) in enumerate(zip(ps, ps[1:]))]


def bench_constrained(gguf: Path, threads: int | None, rounds: int, history: int, **runtime) -> dict:
    """Host ms per AR step, per 32-row block pass and per commit, each grammar kind, medians over the passes after
    `history` answer tokens."""
    from clover_gguf.runtime import CloverRuntime

    n_blocks = -(-history // 32) + BLOCKS
    rt = CloverRuntime(gguf, n_ctx=n_blocks * 32 + 512, n_threads=threads, selection="graph", **runtime)
    log = PassLog(rt)
    ids = rt.prompt_ids(PROMPT, think=False)
    v = rt.ctx.n_vocab
    out = {k: {"ar": [], "block": [], "commit": [], "blocks": 0, "block_passes": 0} for k in KINDS}
    try:
        for kind in KINDS:  # warm-up: every graph shape once
            for mode in ("ar", "diffusion"):
                for _ in rt.stream_pieces(ids, mode=mode, max_new_tokens=40, threshold=0.0,
                                          constraint=constraint_of(kind, v)):
                    pass
        for r in range(rounds):
            for kind in KINDS:
                log.clear()
                log.mode = "ar"
                for _ in rt.stream_pieces(ids, mode="ar", max_new_tokens=history + AR_STEPS,
                                          constraint=constraint_of(kind, v)):
                    pass
                out[kind]["ar"] += [h for k, h, _ in cycles(log) if k == "AR step"][history - 1:]
                log.clear()
                log.mode = "diffusion"
                for _ in rt.stream_pieces(ids, mode="diffusion", max_new_tokens=n_blocks * 32, threshold=0.0,
                                          constraint=constraint_of(kind, v)):
                    pass
                cyc = cycles(log)
                commits = [i for i, (k, _, _) in enumerate(cyc) if k == "commit"]
                first = commits[-(-history // 32) - 1] if len(commits) > -(-history // 32) else len(cyc)
                late = cyc[first + 1:]
                out[kind]["block"] += [h for k, h, new in late if k == "block" and new]  # each block's first pass
                out[kind]["commit"] += [h for k, h, _ in late if k == "commit"]
                out[kind]["blocks"] += sum(1 for k, _, new in late if k == "block" and new)
                out[kind]["block_passes"] += sum(1 for k, _, _ in late if k == "block")
            print(f"  constrained round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    finally:
        log.close()
        rt.close()
    res = {}
    for kind, d in out.items():
        res[kind] = {x: 1e3 * statistics.median(d[x]) if d[x] else None for x in ("ar", "block", "commit")}
        res[kind]["n"] = {x: len(d[x]) for x in ("ar", "block", "commit")}
        res[kind]["passes_per_block"] = d["block_passes"] / d["blocks"] if d["blocks"] else None
    return res


def bundled_gguf(wd: Path) -> Path:
    """The bundled trained tiny Clover as F32 GGUF (kept in the work folder)."""
    from clover_gguf.convert import convert

    out = wd / "tiny-clover-f32.gguf"
    if not out.is_file():
        convert(ROOT / "clover_gguf" / "assets" / "tiny-clover", out, outtype="f32", quiet=True)
    return out


def bundled_grammars(rt) -> dict:
    """Character grammars over the bundled model's own vocabulary: "no_e" (text without the letter e, ending anywhere:
    most of the vocabulary allowed) and "json" ({"answer": DIGITS})."""
    from clover_gguf.testing.automaton import TokenAutomaton, char_pattern

    p = [rt.ctx.token_to_piece(t, special=True) for t in range(rt.ctx.n_vocab)]
    no_e = sorted({t for t, b in enumerate(p) if b and b"e" not in b and t not in rt.eos_ids} | set(rt.eos_ids))
    return {"none": lambda: None,
            "no_e": lambda: TokenAutomaton(len(p), 0, lambda s: no_e, lambda s, t: s, rt.eos_ids),
            "json": char_pattern(p, [("lit", '{"answer": '), ("some", "0123456789"), ("lit", "}")], rt.eos_ids)}


def bench_constrained_tps(gguf: Path, threads: int | None, rounds: int, n: int, grammars=None,
                          prompts: tuple[str, ...] = (PROMPT,)) -> dict:
    """Decode tok/s of the same requests unconstrained and constrained, each mode, one runtime, rounds interleaved
    (the kinds in a rotating order) -> {mode: {kind: median tok/s}}. grammars: {kind: factory} (default: "none" and
    the synthetic "json" cycle)."""
    from clover_gguf.runtime import CloverRuntime

    rt = CloverRuntime(gguf, n_ctx=n + 512, n_threads=threads, selection="graph")
    v = rt.ctx.n_vocab
    if grammars is None:
        grammars = {k: (lambda k=k: constraint_of(k, v)) for k in ("none", "json")}
    grammars = grammars(rt) if callable(grammars) else grammars
    kinds = list(grammars)
    tps = {m: {k: [] for k in kinds} for m in MODES}
    try:
        for p in prompts:  # warm-up
            for m in MODES:
                for k in kinds:
                    for _ in rt.stream_pieces(rt.prompt_ids(p, think=False), mode=m, max_new_tokens=16,
                                              constraint=grammars[k]()):
                        pass
        for r in range(rounds):
            for m in MODES:
                for k in kinds[r % len(kinds):] + kinds[:r % len(kinds)]:
                    for p in prompts:
                        st = None
                        for piece in rt.stream_pieces(rt.prompt_ids(p, think=False), mode=m, max_new_tokens=n,
                                                      constraint=grammars[k]()):
                            st = piece.stats
                        tps[m][k].append(st.decode_tokens_per_s)
            print(f"  tok/s round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    finally:
        rt.close()
    return {m: {k: statistics.median(xs) for k, xs in d.items()} for m, d in tps.items()}


# ---- forced tokens (issue 54 item 3) ---------------------------------------------------------------------------
FORCED_PROMPTS = ("What is 34 + 58?", "Count from 12 to 17.", "Reverse: c l o v e r")


def forced_grammars(rt) -> dict:
    """The grammars serve builds (clover_gguf.grammar, llguidance) over the model's vocabulary: "schema", a
    json_schema answer (an integer 0-999, an enum, a boolean); "tool_call", tool_choice "required" over one tool of
    two integer parameters (serve.tools.calls_rules) -> {name: constraint factory}."""
    from clover_gguf import grammar
    from clover_gguf.serve import tools as T

    engine = grammar.Engine(grammar.Vocabulary.of(rt))
    small = {"type": "integer", "minimum": 0, "maximum": 999}
    schema = {"type": "object", "properties": {"answer": small, "unit": {"enum": ["apples", "pears"]},
                                               "exact": {"type": "boolean"}}, "required": ["answer", "unit", "exact"]}
    add = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": small, "b": small}, "required": ["a", "b"]}}}
    sources = {"schema": grammar.source(f"body: {grammar.json_value(schema)}\n", "none"),
               "tool_call": grammar.source(T.calls_rules(T.read_tools([add]), None, parallel=False), "none")}
    return {k: (lambda src=src: engine.constraint(src)) for k, src in sources.items()}


def bench_forced(gguf: Path, threads: int | None, rounds: int, n: int,
                 prompts: tuple[str, ...] = FORCED_PROMPTS) -> dict:
    """Each grammar and mode, forced tokens on and off (decoding.generate's `forced`), rounds interleaved (on and off
    in turn, which first alternating), one runtime: decode tok/s (median over rounds and prompts), tokens per pass
    after the prompt's and forced tokens per answer (means: greedy, the same every round), and whether the text was
    the same with and without."""
    from clover_gguf.runtime import CloverRuntime

    rt = CloverRuntime(gguf, n_ctx=n + 512, n_threads=threads, selection="graph")
    grammars = forced_grammars(rt)
    keys = [(g, m) for g in grammars for m in MODES]
    runs = {k: {True: [], False: []} for k in keys}
    texts = {k: {True: {}, False: {}} for k in keys}
    load = [os.getloadavg()]
    try:
        for g, m in keys:  # warm-up: every graph shape once
            for forced in (True, False):
                for _ in rt.stream_pieces(rt.prompt_ids(prompts[0], think=False), mode=m, max_new_tokens=n,
                                          constraint=grammars[g](), forced=forced):
                    pass
        for r in range(rounds):
            for g, m in keys:
                for forced in ((True, False) if r % 2 == 0 else (False, True)):
                    for p in prompts:
                        toks, st = [], None
                        for piece in rt.stream_pieces(rt.prompt_ids(p, think=False), mode=m, max_new_tokens=n,
                                                      constraint=grammars[g](), forced=forced):
                            toks += piece.tokens
                            st = piece.stats
                        runs[(g, m)][forced].append((st.decode_tokens_per_s, st.generated_tokens, st.decode_passes,
                                                     st.forced_tokens))
                        texts[(g, m)][forced][p] = toks
            load.append(os.getloadavg())
            print(f"  forced-tokens round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    finally:
        rt.close()
    res = {}
    for (g, m), d in runs.items():
        row = {}
        for forced, xs in d.items():
            row["on" if forced else "off"] = {
                "tok_s": statistics.median(x[0] for x in xs),
                "tokens_per_decode_pass": sum(x[1] for x in xs) / max(1, sum(x[2] for x in xs)),
                "tokens": sum(x[1] for x in xs) / len(xs), "forced": sum(x[3] for x in xs) / len(xs)}
        row["same_text"] = texts[(g, m)][True] == texts[(g, m)][False]
        res.setdefault(g, {})[m] = row
    return {"figures": res, "loadavg": [list(x) for x in load], "rounds": rounds, "max_tokens": n,
            "prompts": list(prompts)}


def print_forced(out: dict) -> None:
    la = out["loadavg"]
    print(f"\nforced tokens: the same constrained requests with and without ({out['rounds']} interleaved rounds, "
          f"{len(out['prompts'])} prompts, max {out['max_tokens']} tokens; load average "
          f"{la[0][0]:.1f} at the start, {max(x[0] for x in la):.1f} at most):")
    print(f"{'grammar':<10} {'mode':<11} {'tokens':>6} {'forced':>6} {'tok/pass off':>12} {'on':>6} "
          f"{'tok/s off':>10} {'on':>8} {'x':>6} {'same text':>9}")
    for g, modes in out["figures"].items():
        for m, r in modes.items():
            on, off = r["on"], r["off"]
            print(f"{g:<10} {m:<11} {on['tokens']:6.0f} {on['forced']:6.0f} {off['tokens_per_decode_pass']:12.2f} "
                  f"{on['tokens_per_decode_pass']:6.2f} {off['tok_s']:10.0f} {on['tok_s']:8.0f} "
                  f"{on['tok_s'] / off['tok_s']:6.2f} {'yes' if r['same_text'] else 'no':>9}")


def print_constrained(res: dict, tps: dict, bundled: dict | None, vocab: int, history: int) -> None:
    names = {"none": "none", "structure": "structure (60 allowed)", "string": "string (8,300 excluded)",
             "json": "json (4 structure, 12 string)"}
    print(f"\nhost ms per pass with a grammar's masks (synthetic, V = {vocab:,}: the decoders' and the sampler's cost "
          f"of a mask, no engine's own), graph selection, history >= {history} tokens, medians:")
    print(f"{'grammar':<32} {'AR step':>8} {'32-row block pass':>18} {'commit':>8} {'block + commit':>15} "
          f"{'passes/block':>13}")
    for kind, r in res.items():
        both = r["block"] + r["commit"] if r["block"] is not None and r["commit"] is not None else None
        f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        ppb = "-" if r["passes_per_block"] is None else f"{r['passes_per_block']:.2f}"
        print(f"{names[kind]:<32} {f(r['ar']):>8} {f(r['block']):>18} {f(r['commit']):>8} {f(both):>15} {ppb:>13}")
    for label, table in (("this model, synthetic json grammar", tps), ("bundled trained model", bundled)):
        if not table:
            continue
        kinds = list(next(iter(table.values())))
        print(f"\ndecode tok/s, {label}, constrained against unconstrained (medians):")
        print(f"{'mode':<12} " + " ".join(f"{k:>10}" for k in kinds) + " " +
              " ".join(f"{k + ' x':>10}" for k in kinds[1:]))
        for m, d in table.items():
            print(f"{m:<12} " + " ".join(f"{d[k]:10.1f}" for k in kinds) + " " +
                  " ".join(f"{d[k] / d[kinds[0]]:10.3f}" for k in kinds[1:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=ROOT / "out" / "bench-host")
    ap.add_argument("--gguf", type=Path, help="measure this model instead of the grown tiny one")
    ap.add_argument("--vocab-size", type=at_least(UNUSED_VOCAB_ROWS + 512), default=248_320)
    ap.add_argument("--threads", type=at_least(1), default=2)
    ap.add_argument("--rounds", type=at_least(0), default=5, help="interleaved rounds of the per-pass measurements (0: none)")
    ap.add_argument("--history", type=at_least(1), default=400, help="answer tokens before the timed steps")
    ap.add_argument("--bench-rounds", type=at_least(0), default=5, help="generate / llama-bench pairs (0: none)")
    ap.add_argument("--bench-tokens", type=at_least(1), default=256, help="tokens per generate / llama-bench run")
    ap.add_argument("--constrained-rounds", type=at_least(0), default=3,
                    help="interleaved rounds of the per-pass measurements with a grammar (0: none)")
    ap.add_argument("--constrained-tps-rounds", type=at_least(0), default=3,
                    help="rounds of constrained against unconstrained tok/s, each mode (0: none)")
    ap.add_argument("--constrained-tokens", type=at_least(1), default=96, help="tokens per answer of those")
    ap.add_argument("--forced-rounds", type=at_least(0), default=3,
                    help="interleaved rounds of forced tokens on against off, on the bundled model (0: none)")
    ap.add_argument("--forced-tokens", type=at_least(1), default=200, help="tokens per answer of those at most")
    a = ap.parse_args()
    if a.gguf is not None and not a.gguf.is_file():
        ap.error(f"--gguf: no such file: {a.gguf}")
    if a.workdir.exists() and not a.workdir.is_dir():
        ap.error(f"--workdir: {a.workdir} is not a folder")
    from clover_gguf.llama_context import load_binding

    load_binding()  # sets LLAMA_CPP_LIB_PATH for this process and the ones it starts
    a.workdir.mkdir(parents=True, exist_ok=True)
    grown = a.rounds or a.bench_rounds or a.constrained_rounds or a.constrained_tps_rounds  # the forced section
    gguf = a.gguf or (make_model(a.workdir, a.vocab_size) if grown else bundled_gguf(a.workdir))  # runs the bundled
    print(f"model: {gguf} ({gguf.stat().st_size / 2**20:.0f} MiB), {a.threads} threads", flush=True)
    res = bench_passes(gguf, a.threads, a.rounds, a.history) if a.rounds else {}
    if res:
        print(f"\nhost time per pass, card's controls on, history >= {a.history} tokens, medians "
              f"({a.rounds} interleaved rounds):")
        print(f"{'pass':<34} {'path':<7} {'n':>4} {'wall ms':>8} {'llama_decode ms':>16} {'host ms':>8} "
              f"{'llama.cpp share':>16}")
        names = {"ar": "AR step", "block": "32-token block pass (+ its commit)"}
        for kind in ("ar", "block"):
            for k in ("before", "after"):
                r = res[k][kind]
                print(f"{names[kind]:<34} {k:<7} {r['n']:>4} {r['wall_ms']:8.2f} {r['decode_ms']:16.2f} "
                      f"{r['host_ms']:8.2f} {r['llama_share']:16.0%}")
        for kind, g in {"ar": 0.5, "block": 2.0}.items():
            after = res["after"][kind]["host_ms"]
            print(f"goal: host <= {g} ms per {names[kind]}: {after:.2f} ms ({'met' if after <= g else 'NOT met'}; "
                  f"before {res['before'][kind]['host_ms']:.2f} ms)")
    out = {"gguf": str(gguf), "threads": a.threads, "history": a.history, "passes": res}
    if a.bench_rounds:
        print(f"\nAR tokens/s, {a.bench_tokens} tokens, {a.threads} threads, {a.bench_rounds} alternating runs each:")
        tps = bench_tps(gguf, a.threads, a.bench_rounds, a.bench_tokens)
        print(f"clover-gguf generate (decode tok/s): {tps['generate_tok_s']:.1f}; llama-bench tg: "
              f"{tps['llama_bench_tok_s']:.1f}; ratio {tps['ratio']:.3f} (goal >= 0.95: "
              f"{'met' if tps['ratio'] >= 0.95 else 'NOT met'}); before (numpy selection): "
              f"{tps['numpy_selection_tok_s']:.1f} tok/s, ratio {tps['numpy_ratio']:.3f}")
        print(f"the ceiling of a Python driver (bare llama_decode loop, the graph's selection, no controls or text): "
              f"{tps['floor_tok_s']:.1f} tok/s, ratio {tps['floor_ratio']:.3f}")
        out["tok_s"] = tps
    if a.constrained_rounds or a.constrained_tps_rounds:
        cres = bench_constrained(gguf, a.threads, a.constrained_rounds, a.history) if a.constrained_rounds else {}
        tps = bundled = None
        if a.constrained_tps_rounds:
            tps = bench_constrained_tps(gguf, a.threads, a.constrained_tps_rounds, a.constrained_tokens)
            bundled = bench_constrained_tps(bundled_gguf(a.workdir), a.threads, a.constrained_tps_rounds,
                                            a.constrained_tokens, grammars=bundled_grammars,
                                            prompts=("What is 34 + 58?", "Count from 12 to 17.",
                                                     "Reverse: c l o v e r"))
        print_constrained(cres, tps, bundled, a.vocab_size, a.history)
        out["constrained"] = {"passes": cres, "tok_s": tps, "bundled_tok_s": bundled}
    if a.forced_rounds:
        out["forced"] = bench_forced(bundled_gguf(a.workdir), a.threads, a.forced_rounds, a.forced_tokens)
        print_forced(out["forced"])
    (a.workdir / "host.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nfigures in {a.workdir / 'host.json'}")


if __name__ == "__main__":
    main()
