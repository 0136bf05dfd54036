"""Tokens per second of Clover on MLX, per decoding mode, against `mlx_lm.generate` on the same folder: the script a
Mac user runs and reports (docs/mac.md).

    python bench/mac.py FOLDER [--prompts 4] [--max-new-tokens 256] [--modes ar,draft-self,diffusion] [--json]

FOLDER: an MLX folder (`clover-gguf mlx-convert`, or a community conversion with `clover-gguf graft` applied).
Each prompt is answered once by mlx-lm's own `stream_generate` (greedy, its AR loop: the baseline the community
quotes) and once per mode by clover-gguf's decoders on MlxBackend (greedy, controls off, so that draft-self's answer
is AR's); every run starts with one warm-up answer that is not counted. Decode tok/s counts the answer's tokens over
the time after the prompt's pass (mlx-lm's generation_tps is the same measure). The last lines are one JSON object:
paste it into an issue, with the machine (chip, memory) and the folder (which conversion, bits).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash map works, with an example in Python.",
    "List ten European capitals and one fact about each.",
    "What is 17 * 23? Show your steps.",
    "Summarise the causes of the French Revolution in five bullet points.",
    "Write a haiku about autumn, then explain its imagery.",
    "Translate 'The weather is nice today, let us go for a walk' into French, German and Spanish.",
    "Describe the water cycle to a ten-year-old.",
]


def mlx_lm_run(folder: Path, prompts: list[list[int]], max_new: int) -> dict:
    """mlx-lm's own AR loop on the same prompt tokens -> decode tok/s and tokens."""
    from mlx_lm import load, stream_generate

    model, tokenizer = load(str(folder))
    tps, toks = [], 0
    for i, ids in enumerate([prompts[0]] + prompts):  # the first is a warm-up
        last = None
        for last in stream_generate(model, tokenizer, ids, max_tokens=max_new):
            pass
        if i and last is not None:
            tps.append(last.generation_tps)
            toks += last.generation_tokens
    del model
    return {"decode_tokens_per_s": round(sum(tps) / len(tps), 2), "tokens": toks}


def clover_run(rt, prompts: list[list[int]], modes: list[str], max_new: int) -> dict:
    out = {}
    for mode in modes:
        decode_s = total_tokens = passes = 0
        accepted = drafted = 0
        for i, ids in enumerate([prompts[0]] + prompts):
            run = None
            for _, run in rt.stream_ids(ids, mode=mode, max_new_tokens=max_new, controls=rt.controls.off()):
                pass
            if not i:
                continue
            decode_s += run.seconds - run.prompt_seconds
            total_tokens += run.generated_tokens
            passes += run.forward_passes
            accepted, drafted = accepted + run.accepted_tokens, drafted + run.drafted_tokens
        out[mode] = {"decode_tokens_per_s": round(total_tokens / decode_s, 2) if decode_s else 0.0,
                     "tokens": total_tokens, "tokens_per_pass": round(total_tokens / passes, 3) if passes else 0.0,
                     "acceptance": round(accepted / drafted, 3) if drafted else None}
    return out


def main(argv: list[str] | None = None) -> int:
    from clover_gguf import decoding

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--modes", default=",".join(decoding.MODES), help="comma-separated decoding modes")
    ap.add_argument("--no-think", action="store_true", help="render the prompts with thinking off")
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]

    import mlx.core as mx

    from clover_gguf.mlx_runtime import MlxRuntime

    rt = MlxRuntime(a.folder)
    if not rt.block_mode:
        modes = [m for m in modes if m == "ar"]
        print("note: the folder has no block tensors (clover-gguf graft adds them): ar only", file=sys.stderr)
    prompts = [rt.prompt_ids(p, think=not a.no_think) for p in (PROMPTS * 4)[:a.prompts]]
    t0 = time.perf_counter()
    ours = clover_run(rt, prompts, modes, a.max_new_tokens)
    del rt
    base = mlx_lm_run(a.folder, prompts, a.max_new_tokens)
    import mlx_lm

    report = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "device": str(mx.default_device()), "metal": bool(mx.metal.is_available())},
        "versions": {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__},
        "folder": str(a.folder), "prompts": len(prompts), "max_new_tokens": a.max_new_tokens,
        "mlx_lm_generate": base, "clover_gguf": ours,
        "ratio_to_mlx_lm": {m: round(v["decode_tokens_per_s"] / base["decode_tokens_per_s"], 3)
                            for m, v in ours.items() if base["decode_tokens_per_s"]},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(f"mlx_lm.generate: {base['decode_tokens_per_s']} tok/s")
    for m, v in ours.items():
        print(f"{m:<11} {v['decode_tokens_per_s']:>8} tok/s  {v['tokens_per_pass']:.2f} tokens/pass  "
              f"x{report['ratio_to_mlx_lm'].get(m, 0):.2f} of mlx_lm"
              + (f"  acceptance {v['acceptance']:.0%}" if v["acceptance"] is not None else ""))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
