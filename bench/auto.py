"""`auto` against ar, draft-self and diffusion, modes interleaved prompt by prompt (seeded order), in one run.

    python bench/auto.py [--workdir out/bench-auto] [--prompts 39] [--rounds 2] [--slice PATH.gguf] [--json]

Models (each a warm runtime per mode, held for the whole run, so auto's pass costs and its view of the drafts carry
from one prompt to the next as they do in chat and serve):
  (a) the bundled trained tiny Clover (F32 GGUF): drafts are accepted;
  (b) the same model with its four block tensors drawn at random (testing.make_tiny.with_random_block_tensors):
      what a reading that does not fit the weights looks like; drafts are rejected;
  (c) with --slice: a slice35b GGUF (the 35B's layer widths, vocabulary and expert count; random weights, so drafts
      are rejected and block passes cost what they cost at that width on this machine).
Prompts: the bundled model's held-out eval rows (never trained on), spread over its tasks; for (c) the same texts.
Greedy, the card's controls on. For each model: tok/s of every mode over the same prompts (whole requests, the
prompt pass included), auto against the faster of ar and draft-self, auto's choices (AR steps, drafts, block passes,
accepted tokens per draft, predicted against measured tok/s), whether auto's text equals ar's on every prompt, and
what a draft costs in AR steps in model passes alone (each runtime's measured pass costs).
No asserts on timings: the figures are printed, ratios beside them.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clover_gguf.convert import convert  # noqa: E402
from clover_gguf.runtime import CloverRuntime  # noqa: E402
from clover_gguf.testing.make_tiny import with_random_block_tensors  # noqa: E402

BUNDLED = ROOT / "clover_gguf" / "assets" / "tiny-clover"
MODES = ("ar", "draft-self", "diffusion", "auto")


def bench_model(label: str, gguf: Path, prompts: list[str], max_new: int, rounds: int, threads: int,
                ctx: int) -> dict:
    runtimes = {m: CloverRuntime(gguf, n_ctx=ctx, n_threads=threads, n_threads_batch=threads) for m in MODES}
    rows = {m: dict(tokens=0, seconds=0.0, ar_steps=0, drafts=0, block_passes=0, accepted=0, drafted=0, passes=0,
                    predicted_s=0.0, measured_s=0.0) for m in MODES}
    texts: dict[str, list[str]] = {m: [] for m in MODES}
    rng = random.Random(0)
    try:
        for m in MODES:  # warm-up (a fresh process's first calls cost more than a pass)
            runtimes[m].generate(prompts[0], mode=m, max_new_tokens=8)
        for r in range(rounds):
            for p in prompts:
                # a seeded shuffle per prompt: a rotation of one order kept each mode behind the same one (auto always
                # ran right after diffusion's block passes, whose memory traffic the next answer pays for)
                order = list(MODES)
                rng.shuffle(order)
                for m in order:
                    t0 = time.perf_counter()
                    a = runtimes[m].generate(p, mode=m, max_new_tokens=max_new)
                    row, st = rows[m], a.stats
                    row["seconds"] += time.perf_counter() - t0
                    row["tokens"] += st.generated_tokens
                    row["passes"] += st.forward_passes
                    row["ar_steps"] += st.ar_steps
                    row["drafts"] += st.drafts
                    row["block_passes"] += st.block_passes
                    row["accepted"] += st.accepted_tokens
                    row["drafted"] += st.drafted_tokens
                    if st.predicted_tokens_per_s and st.measured_tokens_per_s:
                        row["predicted_s"] += st.generated_tokens / st.predicted_tokens_per_s
                        row["measured_s"] += st.generated_tokens / st.measured_tokens_per_s
                    if r == 0:
                        texts[m].append(a.raw)
        passes_of_a_draft = draft_in_passes(rows, {m: rt.pass_costs for m, rt in runtimes.items()})
    finally:
        for rt in runtimes.values():
            rt.close()
    for row in rows.values():
        row["tok_s"] = row["tokens"] / row["seconds"]
    best = max(rows["ar"]["tok_s"], rows["draft-self"]["tok_s"])
    same = sum(a == b for a, b in zip(texts["ar"], texts["auto"]))
    au = rows["auto"]
    print(f"\n({label}) {gguf.name}: {len(prompts)} prompts x {rounds} rounds, greedy, controls on, {threads} threads")
    print(f"{'mode':<11} {'tokens':>7} {'tok/s':>9} {'x ar':>6} {'passes/tok':>11}")
    for m, row in rows.items():
        print(f"{m:<11} {row['tokens']:>7} {row['tok_s']:9.1f} {row['tok_s'] / rows['ar']['tok_s']:6.2f} "
              f"{row['passes'] / max(row['tokens'], 1):11.3f}")
    per_draft = au["accepted"] / au["drafts"] if au["drafts"] else 0.0
    pred = au["tokens"] / au["predicted_s"] if au["predicted_s"] else None
    meas = au["tokens"] / au["measured_s"] if au["measured_s"] else None
    print(f"auto: {au['tok_s'] / best:.3f}x the faster of ar and draft-self; {au['ar_steps']} AR steps, "
          f"{au['drafts']} drafts in {au['block_passes']} block passes, {per_draft:.1f} accepted per draft; "
          f"predicted {pred or 0:.1f} against measured {meas or 0:.1f} tok/s over its moves; "
          f"text equal to ar's on {same} of {len(prompts)} prompts")
    if passes_of_a_draft:
        c = passes_of_a_draft
        print(f"draft-self's passes: a draft ({c['block_passes']:.2f} block passes of {c['block_rows']} rows at "
              f"{c['block_ms']:.2f} ms, a verification of {c['verify_rows']} rows at {c['verify_ms']:.2f} ms) costs "
              f"{c['draft_in_steps']:.1f} AR steps ({c['step_ms']:.3f} ms, a step timed as a pass) and yields "
              f"{c['accepted']:.1f} tokens: {c['x_ar_passes']:.2f}x ar on the passes alone (the host work between "
              f"passes not counted)")
    return {"model": label, "tok_s": {m: round(r["tok_s"], 2) for m, r in rows.items()},
            "auto_x_best": round(au["tok_s"] / best, 4), "auto_x_ar": round(au["tok_s"] / rows["ar"]["tok_s"], 4),
            "draft_self_x_ar": round(rows["draft-self"]["tok_s"] / rows["ar"]["tok_s"], 4),
            "ar_steps": au["ar_steps"], "drafts": au["drafts"], "block_passes": au["block_passes"],
            "accepted_per_draft": round(per_draft, 3), "predicted_tok_s": pred, "measured_tok_s": meas,
            "same_text_as_ar": f"{same}/{len(prompts)}", "draft_self_passes": passes_of_a_draft}


def draft_in_passes(rows: dict, costs: dict) -> dict | None:
    """What a draft costs against AR steps in model passes alone, from the pass costs each mode's runtime measured
    (auto.PassCosts: a pass timed with its selection, without the host work between passes): its block passes and
    its verification against the AR steps that would have written its accepted tokens. None without drafts or AR
    steps."""
    ds = rows["draft-self"]
    step = costs["ar"].predict("causal", 1)
    blocks = [(a.n, r) for (k, r), a in costs["draft-self"].buckets.items() if k == "block"]
    if not ds["drafts"] or not rows["ar"]["ar_steps"] or step is None or not blocks:
        return None
    block_rows = max(blocks)[1]  # the block size: the row count most block passes had
    verify_rows = round(ds["drafted"] / ds["drafts"])
    block_s = costs["draft-self"].predict("block", block_rows)
    verify_s = costs["draft-self"].predict("causal", verify_rows)
    passes = ds["block_passes"] / ds["drafts"]
    accepted = ds["accepted"] / ds["drafts"]
    draft_s = passes * block_s + verify_s
    return {"step_ms": step * 1e3, "block_rows": block_rows, "block_ms": block_s * 1e3, "block_passes": passes,
            "verify_rows": verify_rows, "verify_ms": verify_s * 1e3, "accepted": accepted,
            "draft_in_steps": draft_s / step, "x_ar_passes": accepted * step / draft_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=ROOT / "out" / "bench-auto")
    ap.add_argument("--prompts", type=int, default=39, help="held-out eval prompts, spread over the tasks")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the prompts (modes interleaved per prompt)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--slice", type=Path, help="(c): a slice35b GGUF (e.g. Q4_K_M) to run as well")
    ap.add_argument("--slice-prompts", type=int, default=6, help="prompts for (c), whose passes cost far more")
    ap.add_argument("--slice-max-new-tokens", type=int, default=48)
    ap.add_argument("--only", choices=["a", "b", "c"], action="append", help="run only these models")
    ap.add_argument("--json", action="store_true", help="print one JSON line with every figure at the end")
    a = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # each model's table as it is done, also into a file
    a.workdir.mkdir(parents=True, exist_ok=True)
    only = set(a.only or ("a", "b", "c"))
    evals = [json.loads(x) for x in (BUNDLED / "eval.jsonl").read_text().splitlines() if x.strip()]
    prompts = [e["prompt"] for e in evals]
    prompts = prompts[::max(1, len(prompts) // a.prompts)][:a.prompts]  # eval.jsonl is in task order
    results = []
    if "a" in only:
        good = a.workdir / "tiny-clover-f32.gguf"
        convert(BUNDLED, good, outtype="f32", quiet=True, force=True)
        results.append(bench_model("a: bundled", good, prompts, a.max_new_tokens, a.rounds, a.threads, a.ctx))
    if "b" in only:
        bad = a.workdir / "tiny-clover-random-block-f32.gguf"
        convert(with_random_block_tensors(BUNDLED, a.workdir / "random-block"), bad, outtype="f32", quiet=True,
                force=True)
        results.append(bench_model("b: random block tensors", bad, prompts, a.max_new_tokens, a.rounds, a.threads,
                                   a.ctx))
    if "c" in only and a.slice is not None:
        sp = prompts[::max(1, len(prompts) // a.slice_prompts)][:a.slice_prompts]
        results.append(bench_model("c: slice35b", a.slice, sp, a.slice_max_new_tokens, 1, a.threads, a.ctx))
    if a.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
