"""clover-gguf quantize against plain llama-quantize on the same F16 GGUF (over 2 GB), in one run.

    python bench/quantize.py [--workdir out/bench-quantize] [--checkpoint out/bench-convert/clover] [--type Q4_K_M]
        [--threads N] [--keep]

Converts a `make_tiny --preset large` BF16 Clover checkpoint (made if absent) to an F16 GGUF, then times, each as
its own process with peak RSS from a small launcher (wait4 on a fresh child: a child forked straight from a large
parent would report the parent's resident size as its own high-water mark):
  llama-quantize   the patched build's tool: IN OUT TYPE THREADS (llama.cpp's default mixture)
  clover-gguf      clover_gguf.quantize.quantize (recipe quant_recipes/<type>.toml, progress off)
Both run llama_model_quantize of the same library; the recipe only adds tensor-type overrides for a few tiny
tensors. Target (issue 5): clover-gguf throughput >= 0.9x llama-quantize's. The page cache is warmed first.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import run_measured, warm  # noqa: E402


OURS = ("import sys; from clover_gguf.quantize import quantize; "
        "quantize(sys.argv[1], sys.argv[2], sys.argv[3], threads=int(sys.argv[4]), force=True, quiet=True)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=ROOT / "out" / "bench-quantize")
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "out" / "bench-convert" / "clover")
    ap.add_argument("--type", default="Q4_K_M")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--repeat", type=int, default=1, help="runs of each (alternating); the best is reported")
    ap.add_argument("--keep", action="store_true", help="keep the F16 GGUF for another run")
    a = ap.parse_args()
    from clover_gguf.llama_context import load_binding
    from clover_gguf.build import llama_tool
    from clover_gguf.quantize import read_header

    load_binding()  # sets LLAMA_CPP_LIB_PATH to the patched build when it is not set
    tool = llama_tool("llama-quantize")
    wd = a.workdir
    wd.mkdir(parents=True, exist_ok=True)
    f16 = wd / "clover-f16.gguf"
    if not f16.is_file():
        if not (a.checkpoint / "config.json").is_file():
            from clover_gguf.testing.make_tiny import make_tiny

            print(f"making {a.checkpoint} (large, bf16) ...", flush=True)
            make_tiny(a.checkpoint, seed=0, preset="large", dtype="bf16", shard_size=1 << 30)
        print(f"converting {a.checkpoint} -> {f16} (f16) ...", flush=True)
        subprocess.run([sys.executable, "-m", "clover_gguf", "convert", str(a.checkpoint), "-o", str(f16),
                        "--outtype", "f16", "--quiet"], check=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    size = f16.stat().st_size
    h = read_header(f16)
    print(f"input: {f16} {size / 1e9:.2f} GB, {len(h.tensors)} tensors; type {a.type}, {a.threads} threads")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.setdefault("LD_LIBRARY_PATH", str(tool.parent))
    results: dict[str, tuple[float, int]] = {}
    for _ in range(a.repeat):
        for name in ("llama-quantize", "clover-gguf"):
            out = wd / f"{name}.gguf"
            warm(f16)
            cmd = ([str(tool), str(f16), str(out), a.type, str(a.threads)] if name == "llama-quantize" else
                   [sys.executable, "-c", OURS, str(f16), str(out), a.type, str(a.threads)])
            wall, rss = run_measured(cmd, env)
            out_size = out.stat().st_size
            out.unlink()
            if name not in results or wall < results[name][0]:
                results[name] = (wall, rss)
            print(f"  {name:<15} {wall:7.2f} s  {size / wall / 1e6:7.1f} MB/s  peak RSS {rss / 2**20:7.0f} MiB  "
                  f"-> {out_size / 2**20:.1f} MiB", flush=True)
    base, ours = results["llama-quantize"], results["clover-gguf"]
    print(f"\n{'run':<15} {'seconds':>8} {'MB/s':>8} {'peak RSS MiB':>13}")
    for name, (wall, rss) in results.items():
        print(f"{name:<15} {wall:8.2f} {size / wall / 1e6:8.1f} {rss / 2**20:13.0f}")
    print(f"\nthroughput clover-gguf / llama-quantize: {base[0] / ours[0]:.3f} (target >= 0.9)")
    print(f"peak RSS clover-gguf / llama-quantize: {ours[1] / base[1]:.3f}")
    if not a.keep:
        f16.unlink()


if __name__ == "__main__":
    main()
