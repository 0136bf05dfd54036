"""--flash-attn against the cache's depth: our runtime's passes and llama.cpp's own llama-bench, side by side.

    python bench/flash_attn.py [--model GGUF] [--depths 512,2048,8192] [--rounds 5] [--threads N] [--json]

The model defaults to the 35B-wide slice bench/contention.py makes (out/bench-contention/slice35b-e16-v1024-q4_k_m.gguf:
the 35B's layer widths, 16 experts, Q4_K_M). Per depth and per setting (`--flash-attn off`, `on`): our context
(clover_gguf.runtime, F16 K/V) holds `depth` prompt tokens, then `rounds` AR steps (one-token causal passes, each
extending the cache by one) and `rounds` 32-row block passes over the same state (a draft's or diffusion's pass: a
block pass leaves the cache as it was), after one of each that warms the graphs; medians in ms. Beside them
`llama-bench -fa 0,1 -p 32 -n 16 -d DEPTH -r ROUNDS` on the same file and threads (its pp32 is a 32-row causal pass,
its tg16 sixteen AR steps), in ms per pass. Printed: each figure, and off / on per setting (above 1: off is faster).
Figures only, no asserts on timing; the load average at the start and the end is printed beside them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from clover_gguf.offload import Offload  # noqa: E402
from clover_gguf.runtime import CloverRuntime  # noqa: E402
from contention import loadavg  # noqa: E402
from measure import at_least, int_list  # noqa: E402
from host import llama_bench_runs  # noqa: E402

SLICE = ROOT / "out" / "bench-contention" / "slice35b-e16-v1024-q4_k_m.gguf"
SETTINGS = ("off", "on")


def ours(gguf: Path, depth: int, flash_attn: str, rounds: int, threads: int | None) -> dict:
    """Medians in ms: {"ar": one AR step, "block32": one 32-row block pass} at `depth` cached tokens."""
    with CloverRuntime(gguf, n_ctx=depth + rounds + 64, n_threads=threads,
                       offload=Offload(flash_attn=flash_attn, threads=threads)) as rt:
        b = rt.backend
        first = 16  # ids past the special ones at the start of the vocabulary: any text would do
        span = b.n_vocab - 2 * first
        prompt = [first + (i * 7919) % span for i in range(depth)]
        b.reset()
        b.prefill(prompt)
        block = [prompt[-1]] + [b.mask_token_id] * (b.block_size - 1)
        b.keep_backup = False
        times: dict[str, list[float]] = {"ar": [], "block32": []}
        for r in range(rounds + 1):  # the first of each warms its graph
            t0 = time.perf_counter()
            b.block_logits(block)
            t1 = time.perf_counter()
            b.commit([prompt[r]])
            t2 = time.perf_counter()
            if r:
                times["block32"].append((t1 - t0) * 1e3)
                times["ar"].append((t2 - t1) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def peer(gguf: Path, depths: list[int], rounds: int, threads: int | None) -> dict:
    """llama-bench's ms per pass: {(depth, "off"|"on"): {"pp32": ms, "tg1": ms}}."""
    args = ["-fa", "0,1", "-p", "32", "-n", "16", "-d", ",".join(map(str, depths)), "-r", str(rounds)]
    runs = llama_bench_runs(gguf, *args, *(["-t", str(threads)] if threads else []))
    out: dict = {}
    for run in runs:
        key = (int(run["n_depth"]), "on" if run["flash_attn"] in (1, True, "1", "on", "enabled") else "off")
        if run["n_prompt"]:
            out.setdefault(key, {})["pp32"] = 32 / run["avg_ts"] * 1e3
        else:
            out.setdefault(key, {})["tg1"] = 1 / run["avg_ts"] * 1e3
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=SLICE)
    ap.add_argument("--depths", type=int_list(0), default="512,2048,8192")
    ap.add_argument("--rounds", type=at_least(1), default=5)
    ap.add_argument("--threads", type=at_least(1))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    if not a.model.is_file():
        print(f"bench/flash_attn.py: no model {a.model} (python bench/contention.py makes the slice; or --model)",
              file=sys.stderr)
        return 2
    depths = a.depths
    print(f"flash attention: {a.model.name}, depths {depths}, {a.rounds} rounds, threads {a.threads or 'default'}, "
          f"load average {loadavg()}, {time.strftime('%Y-%m-%d %H:%M')}")
    res = {}
    for d in depths:
        for fa in SETTINGS:
            res[(d, fa)] = ours(a.model, d, fa, a.rounds, a.threads)
    theirs = peer(a.model, depths, a.rounds, a.threads)
    print("\n| depth | ours: AR step off / on (ms) | off faster | ours: 32-row block pass off / on | off faster | "
          "llama-bench: tg1 off / on | off faster | llama-bench: pp32 off / on | off faster |\n"
          "|---|---|---|---|---|---|---|---|---|")
    rows = []
    for d in depths:
        o, n = res[(d, "off")], res[(d, "on")]
        po, pn = theirs.get((d, "off"), {}), theirs.get((d, "on"), {})
        row = {"depth": d, "ours_ar": [o["ar"], n["ar"]], "ours_block32": [o["block32"], n["block32"]],
               "peer_tg1": [po.get("tg1"), pn.get("tg1")], "peer_pp32": [po.get("pp32"), pn.get("pp32")]}
        rows.append(row)
        cells = []
        for key in ("ours_ar", "ours_block32", "peer_tg1", "peer_pp32"):
            off, on = row[key]
            cells.append(f"{off:.2f} / {on:.2f} | {on / off:.2f}x" if off and on else "- | -")
        print(f"| {d} | " + " | ".join(cells) + " |")
    print(f"\nload average at the end: {loadavg()}")
    if a.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
