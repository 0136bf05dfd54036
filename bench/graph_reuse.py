"""Graph reuse when block and causal passes alternate (draft-self's pattern), against each kind in a row.

    python bench/graph_reuse.py [--gguf FILE] [--passes 200] [--rounds 2] [--threads 2]
        [--workdir out/bench-graph-reuse]

On one context (the bundled model converted to F32 unless --gguf names another file): a 64-token prefix, then
`passes` one-token causal steps in a row, `passes` 32-token block passes in a row (on a scratch copy of the prefix,
as the runtime decodes blocks), and `passes` alternating between the two; rounds repeat the three. Prints llama.cpp's
reused-graph count (llama_perf_context) and the median ms per pass of each kind, and the ratio of a pass alternating
to the same pass in a row: 1.00 when each graph type keeps its graph (patch 0006), above when every switch rebuilds.
Issue 33's target: a block pass alternating within 5% of blocks in a row. `measure` is the one loop: bench/device's
block_checks runs it on the GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

if TYPE_CHECKING:  # measure() is imported by bench/device/steps.py: the project's modules load where they are used
    from clover_gguf.llama_context import LlamaContext

BUNDLED = ROOT / "clover_gguf" / "assets" / "tiny-clover"


def measure(r: LlamaContext, kind: str, passes: int, prefix: list[int], blocks: list[list[int]],
            rng: np.random.Generator) -> dict:
    r.clear()
    r.decode(prefix, 0, 0, logits=False)
    n_past, times = len(prefix), {"causal": [], "block": []}
    before = r.L.llama_perf_context(r.ctx).n_reused
    for i in range(passes):
        if kind == "causal" or (kind == "alternating" and i % 2 == 0):
            t = time.perf_counter()
            r.decode([int(rng.integers(0, r.n_vocab))], n_past, 0)
            times["causal"].append(time.perf_counter() - t)
            n_past += 1
        else:
            t = time.perf_counter()
            r.block(blocks[i], n_past)
            times["block"].append(time.perf_counter() - t)
    return {"passes": passes, "reused": r.L.llama_perf_context(r.ctx).n_reused - before,
            **{f"{k}_ms": 1000 * statistics.median(v) for k, v in times.items() if v}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, help="measure this file instead of the bundled model")
    ap.add_argument("--passes", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=ROOT / "out" / "bench-graph-reuse")
    a = ap.parse_args()
    if a.passes < 2 or a.rounds < 1:
        ap.error("--passes must be at least 2 and --rounds at least 1")
    from clover_gguf.convert import convert
    from clover_gguf.llama_context import LlamaContext

    gguf = a.gguf
    if gguf is None:
        a.workdir.mkdir(parents=True, exist_ok=True)
        gguf = a.workdir / "tiny-clover-f32.gguf"
        if not gguf.exists():
            convert(BUNDLED, gguf, outtype="f32", quiet=True)
    elif not gguf.is_file():
        ap.error(f"--gguf: no such file: {gguf}")

    rng = np.random.default_rng(0)
    r = LlamaContext(gguf, n_ctx=1024, n_ubatch=512, n_seq_max=2, exact=True, n_threads=a.threads)
    try:
        prefix = rng.integers(0, r.n_vocab, 64).tolist()
        blocks = [rng.integers(0, r.n_vocab, 32).tolist() for _ in range(a.passes)]
        rows = []
        for k in range(a.rounds):
            for kind in ("causal", "block", "alternating"):
                rows.append({"round": k + 1, "kind": kind, **measure(r, kind, a.passes, prefix, blocks, rng)})
    finally:
        r.close()

    print(f"{gguf.name}, {a.threads} threads, {a.passes} passes per row")
    print(f"{'round':>5} {'passes':<12} {'reused':>10} {'causal ms':>10} {'block ms':>10}")
    for row in rows:
        print(f"{row['round']:>5} {row['kind']:<12} {row['reused']:>5}/{row['passes']:<4} "
              f"{row.get('causal_ms', float('nan')):>10.3f} {row.get('block_ms', float('nan')):>10.3f}")
    med = {kind: {key: statistics.median(r_[key] for r_ in rows if r_["kind"] == kind and key in r_)
                  for key in ("causal_ms", "block_ms") if any(key in r_ for r_ in rows if r_["kind"] == kind)}
           for kind in ("causal", "block", "alternating")}
    block_ratio = med["alternating"]["block_ms"] / med["block"]["block_ms"]
    causal_ratio = med["alternating"]["causal_ms"] / med["causal"]["causal_ms"]
    print(f"alternating / in a row (medians over rounds): block pass {block_ratio:.3f}, causal step {causal_ratio:.3f}")
    print(f"target: a block pass alternating within 5% of blocks in a row: "
          f"{'met' if block_ratio <= 1.05 else 'not met'}")
    out = a.workdir / "graph_reuse.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"gguf": str(gguf), "threads": a.threads, "rows": rows,
                               "block_ratio": block_ratio, "causal_ratio": causal_ratio}, indent=1))
    print(f"figures in {out}")


if __name__ == "__main__":
    main()
