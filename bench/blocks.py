"""What the chat page's block view costs: greedy tok/s of `clover-gguf serve` with and without `clover_blocks`, and
against a tree without the decoders' observer hook (what the hook costs when nobody asks for it).

    python bench/blocks.py [--baseline-tree PATH] [--model clover_gguf/assets/tiny-clover] [--modes ar,diffusion,...]
                           [--requests 16] [--max-tokens 64] [--rounds 5] [--threads T] [--workdir out/bench-blocks]

Servers run as subprocesses on loopback on the same GGUF, --parallel 1, all up all along, no browser open: this
tree's, and with --baseline-tree (a checkout without the hook: `git archive <commit> | tar -x -C /tmp/base`) that
tree's. Each round sends, per mode, the same streamed greedy chat requests (the bundled model's eval prompts), one
at a time, each question to every configuration in a shuffled order: the baseline tree without the field, this tree
without it, this tree with `clover_blocks: true` (the client parses every chunk, as the page does). Per
configuration: tokens over the seconds the server's clover_stats report (the decode, the prompt's pass included) and
over the client's wall seconds (request to [DONE]); the ratios printed are medians of the rounds' ratios, since this
machine's speed drifts within minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402

from clover_gguf.convert import convert  # noqa: E402
from clover_gguf.decoding import MODES  # noqa: E402
from serve import free_port, start_logged, stop, wait_ready  # noqa: E402


def start(tree: Path, gguf: Path, args, name: str) -> tuple[subprocess.Popen, str]:
    """`serve` of the package in `tree` (its clover_gguf first on the path)."""
    port = free_port()
    code = ("from clover_gguf.serve import serve; "
            f"serve({str(gguf)!r}, port={port}, parallel=1, ctx={args.ctx}, n_threads={args.threads}, "
            "log_level='warning')")
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = start_logged([sys.executable, "-c", code], args.workdir / f"serve-{name}.log", cwd=tree, env=env)
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, proc, f"clover-gguf serve ({name})", seconds=900)
    return proc, base


def ask(base: str, prompt: str, mode: str, max_tokens: int, blocks: bool) -> tuple[int, float, float, int]:
    """One streamed greedy answer -> (tokens, the server's seconds, the client's wall seconds, block events)."""
    body = {"messages": [{"role": "user", "content": prompt}], "mode": mode, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, **({"clover_blocks": True} if blocks else {})}
    events, stats = 0, None
    t = time.perf_counter()
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=1800) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            events += len(chunk.get("clover_blocks", ()))
            stats = chunk.get("clover_stats") or stats
    wall = time.perf_counter() - t
    return int(stats["generated_tokens"]), float(stats["seconds"]), wall, events


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-tree", type=Path, default=None,
                    help="a checkout without the observer hook, served beside this tree")
    ap.add_argument("--model", type=Path, default=ROOT / "clover_gguf" / "assets" / "tiny-clover",
                    help="a GGUF, or a checkpoint folder (converted to F32 first)")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--requests", type=int, default=16, help="requests per mode and configuration in a round")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0, help="of the configurations' order in each round")
    ap.add_argument("--workdir", type=Path, default=ROOT / "out" / "bench-blocks")
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    modes = [m for m in args.modes.split(",") if m]

    gguf = args.model
    if gguf.is_dir():
        gguf = args.workdir / "model-f32.gguf"
        convert(args.model, gguf, outtype="f32", quiet=True, force=True)
    eval_file = args.model / "eval.jsonl" if args.model.is_dir() else None
    if eval_file is not None and eval_file.is_file():
        prompts = [json.loads(x)["prompt"] for x in eval_file.read_text().splitlines() if x.strip()][::7]
    else:
        prompts = ["Count from 3 to 9.", "What is 12 + 30?", "Reverse: a b c d", "Copy: q r s t"]
    prompts = (prompts * (args.requests // max(1, len(prompts)) + 1))[:args.requests]

    procs = []
    try:
        proc, base = start(ROOT, gguf, args, "this")
        procs.append(proc)
        configs = {"no field": (base, False), "clover_blocks": (base, True)}
        if args.baseline_tree is not None:
            bproc, bbase = start(args.baseline_tree.resolve(), gguf, args, "baseline")
            procs.append(bproc)
            configs = {"baseline": (bbase, False), **configs}
        rng = random.Random(args.seed)
        for name, (b, blocks) in configs.items():  # warm-up: every mode's graphs and passes once
            for mode in modes:
                ask(b, prompts[0], mode, args.max_tokens, blocks)
        runs: dict[tuple[str, str], list[dict]] = {}
        for rnd in range(args.rounds):
            for mode in modes:
                got: dict[str, list] = {name: [] for name in configs}
                for p in prompts:  # each question to every configuration in turn: a drift moves them all
                    order = list(configs)
                    rng.shuffle(order)
                    for name in order:
                        b, blocks = configs[name]
                        got[name].append(ask(b, p, mode, args.max_tokens, blocks))
                for name, g in got.items():
                    tokens = sum(x[0] for x in g)
                    runs.setdefault((mode, name), []).append({
                        "tokens": tokens, "server_tps": tokens / sum(x[1] for x in g),
                        "wall_tps": tokens / sum(x[2] for x in g), "events": sum(x[3] for x in g)})
            print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        for p in procs:
            stop(p)

    def median(mode: str, name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[(mode, name)])

    def ratio(mode: str, a: str, b: str, key: str) -> float:
        return statistics.median(x[key] / y[key] for x, y in zip(runs[(mode, a)], runs[(mode, b)]))

    names = list(configs)
    head = ["mode"] + [f"{n} tok/s (server, wall)" for n in names] + ["clover_blocks / no field"]
    if "baseline" in configs:
        head.append("no field / baseline")
    print(" | ".join(head))
    report = {"threads": args.threads, "requests": args.requests, "max_tokens": args.max_tokens,
              "rounds": args.rounds, "runs": {f"{m}/{n}": v for (m, n), v in runs.items()}, "rows": []}
    for mode in modes:
        cells = [mode] + [f"{median(mode, n, 'server_tps'):.1f}, {median(mode, n, 'wall_tps'):.1f}" for n in names]
        row = {"mode": mode, "events_per_request": runs[(mode, "clover_blocks")][0]["events"] / args.requests}
        for key in ("server_tps", "wall_tps"):
            row[f"blocks_over_plain_{key}"] = ratio(mode, "clover_blocks", "no field", key)
            if "baseline" in configs:
                row[f"plain_over_baseline_{key}"] = ratio(mode, "no field", "baseline", key)
        cells.append(f"{row['blocks_over_plain_server_tps']:.3f}, {row['blocks_over_plain_wall_tps']:.3f}")
        if "baseline" in configs:
            cells.append(f"{row['plain_over_baseline_server_tps']:.3f}, {row['plain_over_baseline_wall_tps']:.3f}")
        report["rows"].append(row)
        print(" | ".join(cells))
    out = args.workdir / "blocks.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
