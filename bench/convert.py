"""Converter throughput and memory, against `cp` and llama.cpp's convert_hf_to_gguf.py, in one run.

    python bench/convert.py [--workdir out/bench-convert] [--preset large] [--keep]

Makes a `make_tiny --preset large` BF16 Clover checkpoint (over 2 GB) and its plain Qwen3.5-MoE twin, then times
(each as its own process, peak RSS from wait4):
  cp         the Clover shards copied to another folder
  ours       clover-gguf convert, bf16 -> bf16, on the Clover checkpoint
  ours-qwen  clover-gguf convert on the plain twin
  upstream   convert_hf_to_gguf.py from the pinned sdist (bf16) on the plain twin
Targets (issue 3): peak RSS under 1 GiB; ours >= 0.5x the speed of cp; faster than convert_hf_to_gguf.py.
The page cache is warmed by a first read of every file so that all runs read from memory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import run_measured, warm  # noqa: E402

from clover_gguf.testing.make_tiny import make_tiny  # noqa: E402
from clover_gguf.testing.upstream import upstream_convert_command  # noqa: E402

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=ROOT / "out" / "bench-convert")
    ap.add_argument("--preset", default="large")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints for another run")
    a = ap.parse_args()
    wd = a.workdir
    wd.mkdir(parents=True, exist_ok=True)
    clover, plain = wd / "clover", wd / "plain"
    for path, plain_qwen in ((clover, False), (plain, True)):
        if not (path / "config.json").is_file():
            print(f"making {path} ({a.preset}, bf16) ...", flush=True)
            make_tiny(path, seed=0, preset=a.preset, dtype="bf16", plain_qwen=plain_qwen, shard_size=1 << 30)
    size = sum(f.stat().st_size for f in clover.glob("*.safetensors"))
    print(f"checkpoint: {size / 1e9:.2f} GB of safetensors", flush=True)

    results = {}
    warm(clover)
    copy_dir = wd / "cp-target"
    shutil.rmtree(copy_dir, ignore_errors=True)
    copy_dir.mkdir()
    results["cp"] = run_measured(["cp", *map(str, sorted(clover.glob("*.safetensors"))), str(copy_dir)])
    shutil.rmtree(copy_dir)
    py = sys.executable
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for name, src in (("ours", clover), ("ours-qwen", plain)):
        warm(src)
        out = wd / f"{name}.gguf"
        results[name] = run_measured([py, "-m", "clover_gguf", "convert", str(src), "-o", str(out), "--outtype", "bf16",
                                      "--quiet"], env)
        out.unlink()
    warm(plain)
    out = wd / "upstream.gguf"
    results["upstream"] = run_measured(upstream_convert_command(plain, out, "bf16"))
    out.unlink()

    print(f"\n{'run':<10} {'seconds':>8} {'GB/s':>7} {'peak RSS MiB':>13} {'speed vs cp':>12}")
    for name, (wall, rss) in results.items():
        print(f"{name:<10} {wall:8.2f} {size / wall / 1e9:7.2f} {rss / 2**20:13.0f} "
              f"{results['cp'][0] / wall:12.2f}")
    ours, up = results["ours-qwen"][0], results["upstream"][0]
    print(f"\nours (plain twin) vs convert_hf_to_gguf.py: {up / ours:.2f}x faster")
    print(f"ours peak RSS: {results['ours'][1] / 2**30:.3f} GiB (target < 1 GiB)")
    print(f"ours speed / cp speed: {results['cp'][0] / results['ours'][0]:.2f} (target >= 0.5)")
    if not a.keep:
        shutil.rmtree(clover)
        shutil.rmtree(plain)


if __name__ == "__main__":
    main()
