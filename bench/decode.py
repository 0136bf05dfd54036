"""Decoding speed on the patched llama.cpp, as ratios measured in one run.

    python bench/decode.py [--model clover_gguf/assets/tiny-clover] [--prompts 16] [--workdir out/bench-decode]

1. On the bundled trained model (converted to F32 GGUF, and quantized from it to Q8_0): tokens/s and forward passes
   per token of ar, diffusion and draft-self (both rollback strategies) over N eval prompts spread over the five
   tasks, greedy; ratios to ar, for the whole request and for the decode after the prompt pass.
   Target (issue 7): diffusion and draft-self >= 1.5x ar tokens/s.
   With --rpc HOST:PORT[,...] (or --rpc loopback: two ggml-rpc-servers started here on 127.0.0.1), ar, diffusion
   and draft-self also run with every layer on the RPC servers, interleaved with the local rows: tok/s over RPC
   against local, in the same run.
2. On a random `small` model: the wall time of one 32-token block pass relative to one AR step, coreset on and off,
   and the distinct experts a block pass touches per MoE layer (from the reference model's routing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clover_gguf.convert import convert  # noqa: E402
from clover_gguf.offload import Offload, add_argparse, from_namespace  # noqa: E402
from clover_gguf.metadata import CORESET_ENABLED  # noqa: E402
from clover_gguf.quantize import quantize  # noqa: E402
from clover_gguf.rpc import parse_endpoints  # noqa: E402
from clover_gguf.runtime import CloverRuntime  # noqa: E402
from clover_gguf.testing.rpc_servers import rpc_servers  # noqa: E402


# (row name, mode, rollback strategy, threads for one-token calls, threshold); None = the runtime's default
MODES = (("ar", "ar", "redecode", None, None), ("diffusion", "diffusion", "redecode", None, None),
         ("draft-self/redecode", "draft-self", "redecode", None, None),
         ("draft-self/snapshot", "draft-self", "snapshot", None, None),
         # exact acceptance gives the AR text whatever drafts: a lower threshold drafts in fewer block passes
         ("draft-self, thr 0.3", "draft-self", "redecode", None, 0.3),
         # on this tiny model a one-token call is cheaper on one thread than on two: AR at its own best
         ("ar, 1 decode thread", "ar", "redecode", 1, None))
RPC_ROWS = ("ar", "diffusion", "draft-self/redecode")  # rows repeated over RPC as "<row> over RPC"


def bench_modes(gguf: Path, prompts: list[str], max_new: int, label: str, rounds: int = 3,
                offload: Offload = Offload(threads=2), ctx: int = 1024, rpc: list[str] | None = None) -> dict:
    """Every mode answers every prompt, interleaved prompt by prompt, `rounds` times over: a shared machine's speed
    drifts within seconds, and interleaving puts the same drift into every mode's time. With `rpc`, the RPC_ROWS
    modes run a second time with every layer on those servers (the ratio against local in the same run)."""
    threads = offload.threads or max(1, min(8, os.cpu_count() or 1))
    modes = MODES + tuple((f"{m[0]} over RPC", *m[1:]) for m in MODES if rpc and m[0] in RPC_ROWS)
    runtimes = {name: CloverRuntime(gguf, n_ctx=ctx, rollback=rollback, n_threads=one or threads,
                                    n_threads_batch=threads, offload=offload,
                                    rpc=rpc if name.endswith(" over RPC") else ())
                for name, _, rollback, one, _ in modes}
    rows = {name: dict(tokens=0, seconds=0.0, prompt_s=0.0, passes=0, rollback_passes=0) for name, *_ in modes}
    try:
        for name, mode, *_ in modes:  # warm-up
            runtimes[name].generate(prompts[0], mode=mode, max_new_tokens=8)
        for _ in range(rounds):
            for p in prompts:
                for name, mode, _, _, threshold in modes:
                    t0 = time.perf_counter()
                    a = runtimes[name].generate(p, mode=mode, max_new_tokens=max_new, threshold=threshold)
                    r = rows[name]
                    r["seconds"] += time.perf_counter() - t0
                    r["tokens"] += a.stats.generated_tokens
                    r["prompt_s"] += a.stats.prompt_seconds
                    r["passes"] += a.stats.forward_passes
                    r["rollback_passes"] += a.stats.rollback_passes
    finally:
        for rt in runtimes.values():
            rt.close()
    for r in rows.values():
        r["tps"] = r["tokens"] / r["seconds"]
        r["decode_tps"] = r["tokens"] / (r["seconds"] - r["prompt_s"])
    base, dbase = rows["ar"]["tps"], rows["ar"]["decode_tps"]
    print(f"\n{label}: {len(prompts)} eval prompts x {rounds} rounds, greedy, {threads} threads for multi-token calls"
          f"{', offload ' + ' '.join(offload.cli_args()) if offload.cli_args() else ''}. "
          f"tok/s counts the whole request (prompt pass included); decode tok/s the time after the prompt pass")
    w = max(len(name) for name in rows)
    print(f"{'mode':<{w}} {'tokens':>7} {'tok/s':>8} {'x ar':>6} {'decode tok/s':>13} {'x ar':>6} {'passes/tok':>11} "
          f"{'rollback passes':>16}")
    for name, r in rows.items():
        print(f"{name:<{w}} {r['tokens']:>7} {r['tps']:8.1f} {r['tps'] / base:6.2f} {r['decode_tps']:13.1f} "
              f"{r['decode_tps'] / dbase:6.2f} {r['passes'] / max(r['tokens'], 1):11.3f} {r['rollback_passes']:>16}")
    ratios = {k: {"x_ar": round(v["tps"] / base, 3), "decode_x_ar": round(v["decode_tps"] / dbase, 3)}
              for k, v in rows.items()}
    if rpc:
        print(f"over RPC ({len(rpc)} servers: {', '.join(rpc)}; every layer remote) against the same mode locally:")
        for name in RPC_ROWS:
            here, there = rows[name], rows[f"{name} over RPC"]
            same = "same tokens" if here["tokens"] == there["tokens"] else "OTHER TOKENS"
            print(f"  {name:<22} local {here['tps']:8.1f} tok/s, RPC {there['tps']:8.1f} tok/s, "
                  f"x local {there['tps'] / here['tps']:5.2f} ({same})")
            ratios[f"{name} over RPC"]["x_local"] = round(there["tps"] / here["tps"], 3)
    print(json.dumps({label: ratios}))
    return ratios


def bench_block_cost(workdir: Path, offload: Offload = Offload(threads=2)) -> None:
    import torch

    from clover_gguf.llama_context import LlamaContext
    from clover_gguf.reference import CloverModel, recorded_routes
    from clover_gguf.testing.make_tiny import make_tiny

    ckpt = workdir / "small"
    if not (ckpt / "config.json").is_file():
        make_tiny(ckpt, seed=0, preset="small")
    gguf = workdir / "small.gguf"
    if not gguf.is_file():
        convert(ckpt, gguf, outtype="f32", quiet=True)
    rng = np.random.default_rng(0)
    prefix = rng.integers(0, 300, size=64).tolist()
    block = rng.integers(0, 300, size=32).tolist()
    reps = 20
    print(f"\nsmall random model: one 32-token block pass vs one AR step ({reps} reps each)")
    for coreset in (True, False):
        with LlamaContext(gguf, n_ctx=512, overrides={CORESET_ENABLED: coreset},
                          n_threads=offload.threads or 2, offload=offload) as ctx:
            ctx.decode(prefix, 0, 0, logits=False)
            t0 = time.perf_counter()
            for i in range(reps):
                ctx.decode([block[i]], len(prefix), 1, logits=True)  # one AR step on a scratch sequence
                ctx.seq_rm(1)
            ar = (time.perf_counter() - t0) / reps
            t0 = time.perf_counter()
            for _ in range(reps):
                ctx.block(block, len(prefix))
            blk = (time.perf_counter() - t0) / reps
        print(f"  coreset {'on ' if coreset else 'off'}: block pass {blk * 1e3:7.2f} ms, AR step {ar * 1e3:6.2f} ms, "
              f"ratio {blk / ar:5.2f} (32 tokens per block pass)")
    model = CloverModel.from_pretrained(ckpt)
    with torch.no_grad():
        _, st = model.prefill(prefix)
        for name, coreset in (("on", True), ("off", False)):
            with recorded_routes(model) as calls:
                model.block_logits(None, block, coreset=coreset, state=st)
            touched = [int(idx.unique().numel()) for _, idx in calls]
            print(f"  coreset {name:<3}: distinct experts per layer per block pass {touched} "
                  f"(mean {np.mean(touched):.1f} of {model.cfg.num_experts})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "clover_gguf" / "assets" / "tiny-clover")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3, help="passes over the prompts (modes interleaved per prompt)")
    ap.add_argument("--ctx", type=int, default=1024, help="context of each runtime")
    add_argparse(ap)  # --gpu-layers, --cpu-moe, --n-cpu-moe, --threads, --mmap: as on every clover-gguf command
    ap.add_argument("--rpc", help="HOST:PORT[,HOST:PORT...] of ggml-rpc-servers, or `loopback` to start two here")
    ap.add_argument("--workdir", type=Path, default=ROOT / "out" / "bench-decode")
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    gguf = a.workdir / "tiny-clover-f32.gguf"
    convert(a.model, gguf, outtype="f32", quiet=True, force=True)
    q8 = a.workdir / "tiny-clover-q8_0.gguf"
    quantize(gguf, q8, "Q8_0", force=True, quiet=True)
    evals = [json.loads(line) for line in (a.model / "eval.jsonl").read_text().splitlines() if line.strip()]
    prompts = [e["prompt"] for e in evals]
    prompts = prompts[::max(1, len(prompts) // a.prompts)][:a.prompts]  # spread over the tasks (eval is in task order)
    with contextlib.ExitStack() as stack:
        rpc = (stack.enter_context(rpc_servers(2, threads=a.threads or 2)) if a.rpc == "loopback"
               else parse_endpoints(a.rpc))
        for label, path in (("F32", gguf), ("Q8_0", q8)):
            bench_modes(path, prompts, a.max_new_tokens, label, a.rounds, from_namespace(a), a.ctx, rpc)
    bench_block_cost(a.workdir, from_namespace(a))


if __name__ == "__main__":
    main()
