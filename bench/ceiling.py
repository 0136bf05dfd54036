"""Each decoding mode against the ceiling llama.cpp's own pass costs imply (issue 67 item 2): how near the runtime's
passes come to their cost, per model, with llama-bench on the same file and threads interleaved in the same run.

    python bench/ceiling.py [--models bundled,slice] [--rounds 3] [--modes ar,diffusion,draft-self,auto]
        [--prompts 8] [--max-new-tokens 48] [--slice PATH] [--slice-max-new-tokens 16] [--workdir out/bench-ceiling]
        [--profile MODE] [--threads N] [--poll N] [--no-stall-guard]

Models: (a) the bundled trained tiny Clover (F32 GGUF, its held-out prompts, greedy); (b) the slice35b (make_tiny's
preset: the 35B's layer widths, Q4_K_M, as bench/contention.py makes it; its weights are random, so its answers run
to the token limit, ignore_eos). One warm runtime per model at its defaults (or the offload options given).
Per round: llama-bench (`-t` the runtime's one-token and batch thread counts, `-n` --tg-tokens, `-p` every row count
the warm-up's passes had, `-d` their median position, `-r 2`), then every mode's answers, each prompt once.
Each answer's passes are counted by bench/measure.PassLog. Its ceiling: every pass after the prompt's costed as
llama-bench's (one row: a tg token at n_threads; r rows: pp r at n_threads_batch; the prompt's pass left out on
both sides); its fraction = ceiling seconds / the answer's seconds after its prompt (stats.prompt_seconds split
off). A mode's fraction is the median over rounds of its answers' summed ceiling over their summed time; the
host ms per pass is that time less the passes' llama_decode, over the passes. --profile MODE: one more round of
that mode's answers under cProfile, the top functions by own time. No asserts: figures are printed (and
ceiling.json in the work folder); the goal is each mode >= 0.85.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import PassLog, at_least  # noqa: E402

GOAL = 0.85
MODES = ("ar", "diffusion", "draft-self", "auto")


def prompts_of(n: int) -> list[str]:
    """n of the bundled model's held-out prompts, spread over its tasks (as bench/contention.py picks them)."""
    rows = [json.loads(x) for x in (ROOT / "clover_gguf" / "assets" / "tiny-clover" / "eval.jsonl").read_text()
            .splitlines() if x.strip()]
    held = [r["prompt"] for r in rows]
    return held[::max(1, len(held) // n)][:n]


def answer(rt, log: PassLog, mode: str, prompt: str, max_new: int, ignore_eos: bool) -> dict:
    """One greedy answer -> its seconds after the prompt, its passes after the prompt's (rows each) and their
    llama_decode seconds."""
    log.clear()
    log.mode = mode if mode in PassLog.CAUSAL else "draft-self"  # auto's causal passes: its AR steps and verifies
    st = None
    for piece in rt.stream_pieces(rt.prompt_ids(prompt, think=False), mode=mode, max_new_tokens=max_new,
                                  ignore_eos=ignore_eos):
        st = piece.stats
    passes = [p for p in log.passes if p.kind != "prompt" and p.tokens]
    return {"seconds": st.seconds - st.prompt_seconds, "tokens": st.generated_tokens,
            "rows": [p.tokens for p in passes], "decode_seconds": sum(p.decode_seconds for p in passes),
            "thread_drops": st.thread_drops}


def llama_bench_costs(gguf: Path, threads: tuple[int, int], rows: list[int], depth: int, tg: int) -> dict:
    """llama-bench on `gguf` -> {"tg": seconds a token at n_threads, r: seconds of pp r at n_threads_batch}."""
    from host import llama_bench_runs

    n1, nb = threads
    return costs_of(llama_bench_runs(gguf, "-t", ",".join(str(t) for t in dict.fromkeys((n1, nb))), "-p",
                                     ",".join(str(r) for r in rows), "-n", str(tg), "-d", str(depth), "-r", "2"),
                    threads)


def costs_of(recs: list[dict], threads: tuple[int, int]) -> dict:
    """llama-bench's JSON records -> {"tg": seconds a generated token at n_threads, r: seconds of a pp of r tokens at
    n_threads_batch} (avg_ns is a whole test's time: n_gen tokens, or the n_prompt tokens' one pass)."""
    n1, nb = threads
    out = {}
    for r in recs:
        t, p, n = int(r["n_threads"]), int(r["n_prompt"]), int(r["n_gen"])
        if n and t == n1:
            out["tg"] = r["avg_ns"] / 1e9 / n
        elif p and t == nb:
            out[p] = r["avg_ns"] / 1e9
    return out


def cost(costs: dict, rows: int) -> float:
    return costs["tg"] if rows == 1 else costs[rows]


def bench_model(label: str, gguf: Path, prompts: list[str], max_new: int, ignore_eos: bool, a, offload) -> dict:
    from clover_gguf.runtime import CloverRuntime

    rt = CloverRuntime(gguf, n_ctx=max_new + 512, offload=offload)
    log = PassLog(rt)
    t = rt.ctx.threading
    threads = (t.n_threads, t.n_threads_batch)
    modes = [m for m in a.modes if m == "ar" or rt.default_mode != "ar"]
    runs = {m: [] for m in modes}
    benches = []
    try:
        seen, positions = set(), []
        for m in modes:  # warm-up: every graph once, and the row counts llama-bench must cost
            for p in prompts:
                x = answer(rt, log, m, p, max_new, ignore_eos)
                seen.update(r for r in x["rows"] if r > 1)
                positions.append(len(rt.prompt_ids(p, think=False)) + x["tokens"] // 2)
        rows, depth = sorted(seen) or [2], int(statistics.median(positions))
        print(f"{label}: {gguf.name}, threads {threads[0]}/{threads[1]} (one-token/batch), "
              f"{t.describe().split('; poll ')[1].split(' (')[0]} poll; llama-bench pp {rows}, -d {depth}", flush=True)
        for r in range(a.rounds):
            costs = llama_bench_costs(gguf, threads, rows, depth, a.tg_tokens)
            benches.append(costs)
            for m in modes:
                runs[m].append(round_of(costs, [answer(rt, log, m, p, max_new, ignore_eos) for p in prompts]))
            line = ", ".join(f"{m} {x[-1]['ceiling'] / x[-1]['seconds']:.3f}" for m, x in runs.items())
            print(f"  round {r + 1}/{a.rounds}: {line} of the ceiling (llama-bench tg {1e3 * costs['tg']:.3f} ms, "
                  f"pp{rows[-1]} {1e3 * costs[rows[-1]]:.3f} ms; load average {os.getloadavg()[0]:.2f})", flush=True)
        if a.profile in modes:
            profile(rt, log, a.profile, prompts, max_new, ignore_eos)
    finally:
        log.close()
        rt.close()
    return {"model": label, "gguf": str(gguf), "threads": list(threads), "llama_bench": benches,
            "pp_rows": rows, "depth": depth, "modes": summarize(runs)}


def round_of(costs: dict, answers: list[dict]) -> dict:
    """One round of a mode's answers (answer()'s dicts) against llama-bench's pass costs: their summed ceiling (every
    pass after the prompt's at llama-bench's cost of its rows), time, tokens, passes, llama_decode time, drops."""
    return {"ceiling": sum(cost(costs, k) for x in answers for k in x["rows"]),
            "seconds": sum(x["seconds"] for x in answers), "tokens": sum(x["tokens"] for x in answers),
            "passes": sum(len(x["rows"]) for x in answers),
            "decode_seconds": sum(x["decode_seconds"] for x in answers),
            "thread_drops": sum(x["thread_drops"] for x in answers)}


def summarize(runs: dict[str, list[dict]]) -> dict:
    """{mode: its rounds (round_of)} -> per mode the medians over rounds: the fraction of the ceiling (ceiling
    seconds / seconds), tok/s and the ceiling's, host ms per pass ((seconds - llama_decode) / passes) and
    llama_decode / ceiling."""
    table = {}
    for m, xs in runs.items():
        frac = statistics.median(x["ceiling"] / x["seconds"] for x in xs)
        table[m] = {"fraction": frac, "tok_s": statistics.median(x["tokens"] / x["seconds"] for x in xs),
                    "ceiling_tok_s": statistics.median(x["tokens"] / x["ceiling"] for x in xs),
                    "passes": xs[0]["passes"], "tokens": xs[0]["tokens"],
                    "host_ms_per_pass": statistics.median(1e3 * (x["seconds"] - x["decode_seconds"]) / x["passes"]
                                                          for x in xs),
                    "decode_x_ceiling": statistics.median(x["decode_seconds"] / x["ceiling"] for x in xs),
                    "thread_drops": sum(x["thread_drops"] for x in xs), "rounds": xs}
    return table


def profile(rt, log: PassLog, mode: str, prompts: list[str], max_new: int, ignore_eos: bool) -> None:
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for p in prompts:
        answer(rt, log, mode, p, max_new, ignore_eos)
    pr.disable()
    print(f"\ncProfile, {mode}, {len(prompts)} answers, top 25 by own time:")
    pstats.Stats(pr, stream=sys.stdout).sort_stats("tottime").print_stats(25)


def report(results: list[dict]) -> None:
    print("\n| model | mode | threads | tok/s | ceiling tok/s | fraction of the ceiling | llama_decode / ceiling | "
          "host ms per pass | passes (tokens) a round | guard drops |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for res in results:
        for m, r in res["modes"].items():
            print(f"| {res['model']} | {m} | {res['threads'][0]}/{res['threads'][1]} | {r['tok_s']:.1f} | "
                  f"{r['ceiling_tok_s']:.1f} | **{r['fraction']:.3f}** | {r['decode_x_ceiling']:.3f} | "
                  f"{r['host_ms_per_pass']:.3f} | {r['passes']} ({r['tokens']}) | {r['thread_drops']} |")
    for res in results:
        for m, r in res["modes"].items():
            busy = "; above 1: llama-bench's own passes were slower, a busy machine (rerun in a quiet window)" \
                if r["fraction"] > 1.05 else ""
            print(f"goal {res['model']} {m}: {r['fraction']:.3f} of the ceiling "
                  f"({'met' if r['fraction'] >= GOAL else 'NOT met'}, >= {GOAL}{busy})")


def main() -> None:
    from clover_gguf.offload import add_argparse, from_namespace

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=ROOT / "out" / "bench-ceiling")
    ap.add_argument("--models", default="bundled,slice")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=at_least(1), default=3)
    ap.add_argument("--prompts", type=at_least(1), default=8, help="bundled model: held-out prompts a round")
    ap.add_argument("--max-new-tokens", type=at_least(1), default=48)
    ap.add_argument("--tg-tokens", type=at_least(1), default=64, help="llama-bench's -n")
    ap.add_argument("--slice", type=Path, help="a slice35b GGUF to use instead of making one")
    ap.add_argument("--slice-experts", type=at_least(1), default=16)
    ap.add_argument("--slice-vocab", type=at_least(1024), default=1024)
    ap.add_argument("--slice-prompts", type=at_least(1), default=1)
    ap.add_argument("--slice-max-new-tokens", type=at_least(1), default=16)
    ap.add_argument("--profile", choices=MODES, help="profile one more round of this mode's answers (cProfile)")
    add_argparse(ap)
    a = ap.parse_args()
    a.modes = a.modes.split(",")
    if bad := [m for m in a.modes if m not in MODES]:
        ap.error(f"--modes: unknown {', '.join(bad)} (choose from {', '.join(MODES)})")
    if bad := [m for m in a.models.split(",") if m not in ("bundled", "slice")]:
        ap.error(f"--models: unknown {', '.join(bad)} (bundled, slice)")
    if a.slice is not None and not a.slice.is_file():
        ap.error(f"--slice: no such file: {a.slice}")
    offload = from_namespace(a)
    from clover_gguf.llama_context import load_binding

    load_binding(offload.poll)  # sets LLAMA_CPP_LIB_PATH (and the waiting) for this process and llama-bench
    a.workdir.mkdir(parents=True, exist_ok=True)
    print(f"ceiling: {os.cpu_count()} CPUs, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())} at the "
          f"start, {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    results = []
    if "bundled" in a.models:
        from host import bundled_gguf

        results.append(bench_model("a: bundled", bundled_gguf(a.workdir), prompts_of(a.prompts), a.max_new_tokens,
                                   False, a, offload))
    if "slice" in a.models:
        from contention import make_slice

        gguf = a.slice or make_slice(a.workdir, a.slice_experts, a.slice_vocab)
        results.append(bench_model("b: slice35b", gguf, prompts_of(a.slice_prompts), a.slice_max_new_tokens, True,
                                   a, offload))
    report(results)
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    (a.workdir / "ceiling.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"figures in {a.workdir / 'ceiling.json'}")


if __name__ == "__main__":
    main()
