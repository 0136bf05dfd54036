"""The AR export on llama.cpp without our patches: the pinned tree as upstream has it (outside CI, which builds
llama.cpp once).

    python bench/compat.py [--unpatched DIR] [--model clover_gguf/assets/tiny-clover] [--workdir out/bench-compat]

1. Convert the model to a clover F32 GGUF, quantize it to Q4_K_M (patched build), export both with export-ar.
2. Causal logits of each clover file on the patched build against its export on the unpatched build: <= 1e-5
   relative (flash attention off, F32 K/V), for a prompt decoded at once and then token by token.
3. The unpatched build refuses the clover files (so it really is unpatched) and `clover-gguf generate --mode
   diffusion` on it is one line and exit 2; its own llama-cli answers an eval prompt from the exported Q4_K_M.

--unpatched DIR is the unpatched build's bin/ folder; without it, `clover-gguf build-llama --no-patches` (cached
after its first build) says where it is.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOL = 1e-5
IDS = np.random.default_rng(7).integers(0, 300, size=37).tolist()
N_AT_ONCE = 29


def logits_worker(gguf: str, out: str) -> None:
    """In a process of its own, bound to $LLAMA_CPP_LIB_PATH: causal logits of IDS, or the load error."""
    from clover_gguf.errors import UserError
    from clover_gguf.llama_context import LlamaContext

    try:
        with LlamaContext(gguf, n_ctx=256, n_ubatch=256, exact=True, n_threads=2) as ctx:
            rows = [ctx.decode(IDS[:N_AT_ONCE], 0, 0)]
            rows += [ctx.decode([t], N_AT_ONCE + i, 0) for i, t in enumerate(IDS[N_AT_ONCE:])]
            arch = ctx.meta("general.architecture")
    except UserError as e:
        Path(out).write_text(json.dumps({"error": str(e)}))
        return
    np.save(out + ".npy", np.concatenate(rows))
    Path(out).write_text(json.dumps({"arch": arch}))


def run_logits(lib: Path, gguf: Path, out: Path) -> tuple[dict, np.ndarray | None]:
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(lib))
    subprocess.run([sys.executable, __file__, "--worker", str(gguf), str(out)], env=env, check=True)
    res = json.loads(out.read_text())
    return res, (np.load(str(out) + ".npy") if "error" not in res else None)


def unpatched_lib(given: Path | None) -> Path:
    if given is not None:
        return given
    p = subprocess.run([sys.executable, "-m", "clover_gguf", "build-llama", "--no-patches", "--no-binding"],
                       capture_output=True, text=True)
    m = re.search(r"^library: (\S+)", p.stdout, re.M)
    if p.returncode != 0 or not m:
        sys.exit(f"build-llama --no-patches failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}")
    return Path(m.group(1))


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        logits_worker(*sys.argv[2:4])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--unpatched", type=Path, help="bin/ of the unpatched build (default: build-llama --no-patches)")
    ap.add_argument("--model", type=Path, default=ROOT / "clover_gguf" / "assets" / "tiny-clover")
    ap.add_argument("--workdir", type=Path, default=ROOT / "out" / "bench-compat")
    a = ap.parse_args()

    from clover_gguf.build import find_library
    from clover_gguf.convert import convert
    from clover_gguf.export import export_ar
    from clover_gguf.quantize import quantize

    patched = find_library()
    if patched is None:
        sys.exit("no patched build: run `clover-gguf build-llama`")
    stock = unpatched_lib(a.unpatched)
    print(f"patched build:   {patched.lib_dir}\nunpatched build: {stock}")
    w = a.workdir
    w.mkdir(parents=True, exist_ok=True)
    files = {"F32": (w / "clover-f32.gguf", w / "ar-f32.gguf"), "Q4_K_M": (w / "clover-q4_k_m.gguf", w / "ar-q4_k_m.gguf")}
    convert(a.model, files["F32"][0], outtype="f32", quiet=True)
    quantize(files["F32"][0], files["Q4_K_M"][0], "Q4_K_M", force=True, quiet=True)
    for clover, ar in files.values():
        export_ar(clover, ar, force=True, quiet=True, arch="qwen35moe")

    ok = True
    print(f"\n{'type':<8} {'clover (patched)':<18} {'export (unpatched)':<20} {'rel. logit diff':>16}")
    for qtype, (clover, ar) in files.items():
        ref, want = run_logits(patched.lib_dir, clover, w / f"{qtype}-clover.json")
        res, got = run_logits(stock, ar, w / f"{qtype}-ar.json")
        if got is None or want is None:
            print(f"{qtype:<8} FAILED: {ref.get('error') or res.get('error')}")
            ok = False
            continue
        err = float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want.astype(np.float64)))
        ok &= err <= TOL and res["arch"] == "qwen35moe"
        print(f"{qtype:<8} {ref['arch']:<18} {res['arch']:<20} {err:16.3e}")

    refused, _ = run_logits(stock, files["F32"][0], w / "refused.json")
    print(f"\nunpatched build on the clover file: {refused.get('error', 'LOADED (the build is patched?)')}")
    ok &= "error" in refused
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(stock))
    evals = [json.loads(x) for x in (a.model / "eval.jsonl").read_text().splitlines() if x.strip()]
    gen = subprocess.run([sys.executable, "-m", "clover_gguf", "generate", str(files["F32"][0]), "-p",
                          evals[0]["prompt"], "--mode", "diffusion"], env=env, capture_output=True, text=True)
    print(f"generate --mode diffusion on the unpatched build: exit {gen.returncode}: {gen.stderr.strip()}")
    ok &= gen.returncode == 2 and len(gen.stderr.strip().splitlines()) == 1

    cli = subprocess.run([str(stock / "llama-cli"), "-m", str(files["Q4_K_M"][1]), "-p", evals[0]["prompt"], "-n", "48",
                          "-st", "--temp", "0", "-t", "2", "-c", "512", "--no-warmup",
                          # llama.cpp turns thinking on only for templates it recognises, not the tiny model's
                          "--chat-template-kwargs", '{"enable_thinking": true}'], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=300)
    answered = evals[0]["answer"] in cli.stdout
    print(f"stock llama-cli on the exported Q4_K_M, {evals[0]['prompt']!r}: "
          f"{'answers ' + repr(evals[0]['answer']) if answered else 'WRONG: ' + cli.stdout[-300:]}")
    ok &= answered
    print("\nOK" if ok else "\nFAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
