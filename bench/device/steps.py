"""The steps of the GPU check; bench/device/run.sh calls them in order (read the order and the times there).

Each measuring step writes its figures to $WORK/sections/<name>.json; run.sh records how each step ended
(`record`) and rewrites $OUT/results.json and $OUT/results.md after every step (`report`), so a run stopped at any
point leaves what it measured. A step that cannot run here exits with SKIP_RC and says why on its last line.

    steps.py env | build | parity | decode | slice | host | block-checks | memory | record | report   (--help on each)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the project: the kit's copy on the device
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from measure import PassLog  # noqa: E402  (the benches' one pass counter)

SKIP_RC = 3  # "not possible here": run.sh records the step as skipped, with the last line printed as the reason
# What the device builds: the libraries the runtime loads, llama.cpp's own fit tool (the memory step) and its test of
# every architecture on every device (the llama_archs step). The same cmake options as a user's build.
DEVICE_TARGETS = ("llama", "ggml", "llama-fit-params", "test-llama-archs")
BUILD_STAMP = "clover-device-build.json"
ASSET = ROOT / "clover_gguf" / "assets" / "tiny-clover"
MODES = ("ar", "diffusion", "draft-self")


def work() -> Path:
    return Path(os.environ["WORK"])


def models() -> Path:
    """Where the model files go: $MODELS (run.sh: one folder per kit, kept for a second try), else $WORK/models."""
    return Path(os.environ.get("MODELS") or work() / "models")


def section_path(name: str) -> Path:
    return work() / "sections" / f"{name}.json"


def write_section(name: str, data: dict) -> None:
    p = section_path(name)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, p)


def model_from(step: str) -> Path:
    """The model file a slice step made; a one-line failure when it made none."""
    try:
        gguf = Path(json.loads(section_path(step).read_text())["gguf"])
    except (OSError, ValueError, KeyError):
        raise SystemExit(f"no model: step {step} did not make one") from None
    if not gguf.is_file():
        raise SystemExit(f"no model: {gguf} is missing")
    return gguf


def skip(name: str, reason: str) -> None:
    write_section(name, {"skipped": reason})
    print(reason)
    sys.exit(SKIP_RC)


def sh(cmd: list[str], timeout: float | None = None) -> str:
    """stdout of a probe command, or "" when it is missing or fails."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout or 60)
    except (OSError, subprocess.SubprocessError):
        return ""
    return p.stdout.strip() if p.returncode == 0 else ""


# ---- env ----------------------------------------------------------------------------------------------------------
def cmd_env(a) -> None:
    """The machine, its tools and the kit, for the record."""
    import importlib.util
    import platform

    import numpy

    info = {
        "backend": a.backend,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "numpy": numpy.__version__,
        "gpu": sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap", "--format=csv,noheader"])
        or "no nvidia-smi / no GPU",
        "nvcc": (sh(["nvcc", "--version"]).splitlines() or ["not found"])[-1],
        "cmake": (sh(["cmake", "--version"]).splitlines() or ["not found"])[0],
        "ninja": sh(["ninja", "--version"]) or "not found",
        "kit": json.loads((Path(a.kit) / "kit.json").read_text()),
        # where the project, the binding and the wheels come from (the kit's copies), found without importing them
        "imports": {n: importlib.util.find_spec(n).origin for n in ("clover_gguf", "llama_cpp", "gguf", "diskcache")},
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.cuda.is_available() and torch.cuda.get_device_name(0)
    except ImportError:
        info["torch"] = "not installed"
    for k, v in info.items():
        if k not in ("kit", "imports"):
            print(f"{k:>10}: {v}")
    for k, v in info["imports"].items():
        print(f"{'import':>10}: {k} from {v}")
    print(f"{'kit':>10}: llama.cpp {info['kit']['llama_cpp_commit']}, patches {info['kit']['patches']}, project "
          f"{info['kit']['project_commit']}, made {info['kit']['created']}")
    write_section("env", info)


# ---- build --------------------------------------------------------------------------------------------------------
def cmd_build(a) -> None:
    """Configure and build DEVICE_TARGETS from the kit's sources with clover_gguf.build's options for the backend (plus
    ccache off), into a folder kept between runs on a warm machine: a second run with the same sources and options
    reuses it. --reuse-build takes the cached build `clover-gguf build-llama` made instead (a CPU test of the scripts).
    Prints the library folder on its last line; run.sh exports it as LLAMA_CPP_LIB_PATH."""
    from clover_gguf import build

    t0 = time.monotonic()
    if a.reuse_build:
        info = build.find_library(a.backend)
        if info is None:
            raise SystemExit(f"no cached {a.backend} build of these patches: run `make llama BACKEND={a.backend}`")
        missing = [t for t in DEVICE_TARGETS[2:] if not info.tool(t).exists()]
        if missing:
            raise SystemExit(f"the cached build in {info.bin_dir} lacks {', '.join(missing)}")
        write_section("build", {"reused_cache": str(info.prefix), "backend": info.backend, "seconds": 0.0})
        print(info.lib_dir)
        return
    options = build.cmake_options(a.backend, a.cuda_arch) + ["-DGGML_CCACHE=OFF"]
    tarball = Path(a.kit) / "llama.cpp.tar.xz"
    h = hashlib.sha256()
    with open(tarball, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    key = {"sources": h.hexdigest(), "options": options, "targets": list(DEVICE_TARGETS),
           "sampler": build.sampler_hash()}
    folder = Path(a.build_dir)
    bin_dir = folder / "build" / "bin"
    old = {}
    with contextlib.suppress(OSError, ValueError):
        old = json.loads((folder / BUILD_STAMP).read_text())
    if old.get("key") == key and (bin_dir / "libllama.so").exists() and (bin_dir / "libclover_sampler.so").exists():
        print(f"reusing the build in {folder} (same sources, options and targets; built in {old['seconds']:.0f} s)")
        write_section("build", dict(old, reused=True, seconds=0.0))
        print(bin_dir)
        return
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    with tarfile.open(tarball) as tar:
        tar.extractall(folder, filter="data")
    print(f"cmake {' '.join(options)}\ntargets: {' '.join(DEVICE_TARGETS)}; {a.jobs} jobs", flush=True)
    log = folder / "build.log"
    log.write_text("")
    build.configure_and_build(folder / "llama.cpp", folder / "build", a.backend, options, a.jobs, log,
                              targets=DEVICE_TARGETS)
    build.build_sampler(folder / "llama.cpp", bin_dir, folder / "sampler-build", log, a.backend)  # the runtime loads it
    data = {"key": key, "backend": a.backend, "options": options, "targets": list(DEVICE_TARGETS), "jobs": a.jobs,
            "seconds": round(time.monotonic() - t0, 1)}
    (folder / BUILD_STAMP).write_text(json.dumps(data, indent=1) + "\n")
    write_section("build", data)
    print(f"built in {data['seconds']:.0f} s")
    print(bin_dir)


def cmd_llama_archs(a) -> None:
    """llama.cpp's own test of the clover architecture on every device it finds (logits, causal toggle, save/load)."""
    from clover_gguf.build import llama_tool

    t0 = time.monotonic()
    p = subprocess.run([str(llama_tool("test-llama-archs")), "-a", "clover_moe"], capture_output=True, text=True)
    out = (p.stdout + p.stderr).strip().splitlines()
    print("\n".join(out[-15:]))
    write_section("llama_archs", {"rc": p.returncode, "tail": out[-15:], "seconds": round(time.monotonic() - t0, 1)})
    if p.returncode:
        raise SystemExit(f"test-llama-archs exited with {p.returncode}")


# ---- parity -------------------------------------------------------------------------------------------------------
def cmd_parity(a) -> None:
    """The parity tests (pytest) against the float64 reference with every layer offloaded, in the exact settings or in
    llama.cpp's defaults; the errors each test compared are collected from CLOVER_GGUF_PARITY_LOG."""
    import xml.etree.ElementTree as ET

    d = work() / "parity"
    d.mkdir(parents=True, exist_ok=True)
    log, junit = d / f"{a.name}.jsonl", d / f"{a.name}.xml"
    log.unlink(missing_ok=True)
    env = dict(os.environ, CLOVER_GGUF_PARITY=a.settings, CLOVER_GGUF_PARITY_LOG=str(log),
               CLOVER_GGUF_TEST_GPU_LAYERS=str(a.gpu_layers))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", str(junit), "-rfE",
           "--durations=5", *a.pytest_args]
    print(" ".join(cmd[2:]), flush=True)
    t0 = time.monotonic()
    rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
    tests = []
    if junit.is_file():
        for tc in ET.parse(junit).getroot().iter("testcase"):
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                el = tc.find(tag)
                if el is not None:
                    outcome = {"failure": "failed"}.get(tag, tag)
                    msg = (el.get("message") or "").splitlines()
                    break
            row = {"test": f"{tc.get('classname', '').rsplit('.', 1)[-1]}::{tc.get('name')}", "outcome": outcome,
                   "seconds": round(float(tc.get("time") or 0), 2)}
            if outcome != "passed":
                row["message"] = msg[0][:300] if msg else ""
            tests.append(row)
    errs: dict[str, list[float]] = {}
    if log.is_file():
        for line in log.read_text().splitlines():
            rec = json.loads(line)
            errs.setdefault(rec["test"].split("::", 1)[-1], []).append(rec["rel_err"])
    for row in tests:
        e = errs.get(row["test"].split("::", 1)[-1])
        if e:
            row["max_rel_err"], row["comparisons"] = max(e), len(e)
    all_errs = [x for e in errs.values() for x in e]
    data = {
        "settings": a.settings,
        "what": "exact: flash attention off, F32 K/V" if a.settings == "exact"
        else "llama.cpp defaults: flash attention auto (on where supported), F16 K/V",
        "tolerance": 1e-4 if a.settings == "exact" else "none (errors reported; the tests run with a 1e-2 bound)",
        "gpu_layers": a.gpu_layers,
        "pytest_rc": rc,
        "passed": sum(r["outcome"] == "passed" for r in tests),
        "failed": sum(r["outcome"] in ("failed", "error") for r in tests),
        "skipped_tests": sum(r["outcome"] == "skipped" for r in tests),
        "max_rel_err": max(all_errs) if all_errs else None,
        "comparisons": len(all_errs),
        "seconds": round(time.monotonic() - t0, 1),
        "tests": tests,
    }
    write_section(a.name, data)
    print(f"{a.name}: {data['passed']} passed, {data['failed']} failed; max relative error {data['max_rel_err']} "
          f"over {len(all_errs)} comparisons")
    if rc not in (0, 1) or not tests:
        raise SystemExit(f"pytest exited with {rc}")
    if a.settings == "exact" and rc:
        raise SystemExit(f"{data['failed']} parity test(s) failed")


# ---- slice --------------------------------------------------------------------------------------------------------
def cmd_slice(a) -> None:
    """make_tiny --preset slice35b (the 35B's layers at real size, 4 layers, random weights) converted to BF16 GGUF,
    then (--quantize, which needs the library) quantized; files kept in models() for a rerun on a warm machine."""
    from clover_gguf.convert import convert

    d = models()
    d.mkdir(parents=True, exist_ok=True)
    tag = f"slice35b-e{a.num_experts}-v{a.vocab_size}"
    bf16, done = d / f"{tag}-bf16.gguf", d / f"{tag}-bf16.done"
    t0 = time.monotonic()
    data = {"preset": "slice35b", "num_experts": a.num_experts, "vocab_size": a.vocab_size}
    if not done.is_file():
        from clover_gguf.testing.make_tiny import make_tiny

        ckpt = d / f"{tag}-ckpt"
        shutil.rmtree(ckpt, ignore_errors=True)
        make_tiny(ckpt, seed=0, preset="slice35b", num_experts=a.num_experts, vocab_size=a.vocab_size,
                  shard_size=4_000_000_000, quiet=True)
        data["make_s"] = round(time.monotonic() - t0, 1)
        data["checkpoint_bytes"] = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
        convert(ckpt, bf16, outtype="bf16", quiet=True)
        data["convert_s"] = round(time.monotonic() - t0 - data["make_s"], 1)
        shutil.rmtree(ckpt)
        done.write_text("ok\n")
    else:
        data["reused"] = True
    data["bf16_bytes"] = bf16.stat().st_size
    print(f"{bf16.name}: {data['bf16_bytes'] / 2**30:.2f} GiB ({time.monotonic() - t0:.0f} s)", flush=True)
    if a.quantize:
        from clover_gguf.quantize import quantize

        out = d / f"{tag}-{a.quantize.lower()}.gguf"
        t1 = time.monotonic()
        if not out.is_file():
            quantize(bf16, out, a.quantize, threads=os.cpu_count(), quiet=True)
        data.update({"type": a.quantize, "gguf": str(out), "bytes": out.stat().st_size,
                     "quantize_s": round(time.monotonic() - t1, 1)})
        print(f"{out.name}: {data['bytes'] / 2**30:.2f} GiB ({data['quantize_s']:.0f} s)")
    write_section(a.name, data)


# ---- decode -------------------------------------------------------------------------------------------------------
def eval_prompts(n: int) -> list[str]:
    rows = [json.loads(x) for x in (ASSET / "eval.jsonl").read_text().splitlines() if x.strip()]
    return [r["prompt"] for r in rows][:: max(1, len(rows) // n)][:n]  # spread over the tasks (eval is in task order)


def cmd_decode(a) -> None:
    """ar, diffusion and draft-self on one model: tok/s, passes per token and ms per pass kind (AR step, block pass,
    commit / verification pass, rollback re-decode), modes interleaved prompt by prompt."""
    from clover_gguf.runtime import CloverRuntime
    from clover_gguf.testing.device import offload_kwargs

    gguf = Path(a.gguf) if a.gguf else None
    if a.bundled:  # the bundled trained model, converted to F32 once per work folder
        from clover_gguf.convert import convert

        gguf = models() / "tiny-clover-f32.gguf"
        if not gguf.is_file():
            gguf.parent.mkdir(parents=True, exist_ok=True)
            convert(ASSET, gguf, outtype="f32", quiet=True)
    if a.gguf_from:
        gguf = model_from(a.gguf_from)
    if gguf is None or not gguf.is_file():
        raise SystemExit(f"no model file: {gguf}")
    try:
        place = offload_kwargs(a.gpu_layers, a.n_cpu_moe)
    except NotImplementedError as e:
        skip(a.name, f"skipped: {e} (branch fit adds --n-cpu-moe to the runtime)")
    from clover_gguf.llama_context import capture_llama_log

    prompts = eval_prompts(a.prompts)
    t_load = time.perf_counter()
    with capture_llama_log() as log:  # where llama.cpp put the weights and how many pieces its graphs run in
        rt = CloverRuntime(gguf, n_ctx=a.ctx, n_threads=a.threads, **place)
    load_s = time.perf_counter() - t_load
    placement = [line.strip() for line in log.text()
                 if re.search(r"offload|model buffer size|compute buffer size|splits|KV buffer size|RS buffer", line)]
    timer = PassLog(rt)
    rows = {m: dict(tokens=0, seconds=0.0, prompt_s=0.0, passes=0, rollback_passes=0, answers=0) for m in MODES}
    try:
        for mode in MODES:  # warm-up: first calls of each graph shape (and CUDA's first launches)
            timer.mode = mode
            rt.generate(prompts[0], mode=mode, max_new_tokens=8, threshold=a.threshold)
        timer.clear()
        for p in prompts:
            for mode in MODES:
                timer.mode = mode
                t0 = time.perf_counter()
                ans = rt.generate(p, mode=mode, max_new_tokens=a.max_new_tokens, threshold=a.threshold)
                r = rows[mode]
                r["seconds"] += time.perf_counter() - t0
                r["tokens"] += ans.stats.generated_tokens
                r["prompt_s"] += ans.stats.prompt_seconds
                r["passes"] += ans.stats.forward_passes
                r["rollback_passes"] += ans.stats.rollback_passes
                r["answers"] += 1
    finally:
        breakdown = rt.ctx.memory_breakdown()
        rt.close()
    out = {"gguf": str(gguf), "file_bytes": gguf.stat().st_size, "prompts": len(prompts),
           "max_new_tokens": a.max_new_tokens, "threshold": a.threshold if a.threshold is not None else "the model's",
           "n_ctx": a.ctx, "gpu_layers": a.gpu_layers, "n_cpu_moe": a.n_cpu_moe,
           "load_s": round(load_s, 2), "memory_breakdown": breakdown, "llama_log": placement, "modes": {}}
    for mode, r in rows.items():
        per_kind = {}
        done = timer.of(mode)
        for kind in dict.fromkeys(p.kind for p in done):
            ts = [p.seconds for p in done if p.kind == kind]
            per_kind[kind] = {"count": len(ts), "per_token": len(ts) / max(r["tokens"], 1),
                              "mean_ms": 1e3 * statistics.fmean(ts), "median_ms": 1e3 * statistics.median(ts)}
        model_s = sum(p.seconds for p in done)
        decode_s = sum(p.decode_seconds for p in done)
        out["modes"][mode] = dict(r, tok_s=r["tokens"] / r["seconds"] if r["seconds"] else 0.0,
                                  model_share=model_s / r["seconds"] if r["seconds"] else 0.0,
                                  decode_share=decode_s / r["seconds"] if r["seconds"] else 0.0,
                                  host_ms_per_pass=1e3 * (r["seconds"] - decode_s) / max(len(done), 1),
                                  decode_tok_s=r["tokens"] / (r["seconds"] - r["prompt_s"])
                                  if r["seconds"] > r["prompt_s"] else 0.0,
                                  passes_per_token=r["passes"] / max(r["tokens"], 1), passes=per_kind)
    if a.project_from:
        try:
            out["projected"] = project(out, json.loads(section_path(a.project_from).read_text()))
        except (OSError, ValueError, KeyError):
            out["projected_note"] = f"no projection: step {a.project_from} has no pass mix"
    write_section(a.name, out)
    print_decode(a.name, out)


# a diffusion commit and a draft-self verification are both one causal pass over a block's tokens
SAME_SHAPE = {"commit": "verify", "verify": "commit"}


def project(this: dict, mix_from: dict) -> dict:
    """tok/s each mode would reach with this model's pass costs (median ms per kind) and the pass mix (passes of each
    kind per generated token) of a trained model (the bundled one): random weights resolve almost nothing per block
    pass, so their own tok/s says little about block decoding."""
    cost = {}
    for mode in MODES:
        for kind, p in this["modes"][mode]["passes"].items():
            cost.setdefault(kind, p["median_ms"])
    for kind, twin in SAME_SHAPE.items():  # a kind this run never made, priced by its twin of the same shape
        if kind not in cost and twin in cost:
            cost[kind] = cost[twin]
    out = {}
    for mode in MODES:
        mix = mix_from["modes"][mode]["passes"]
        kinds = [k for k in mix if k != "prompt"]
        if all(k in cost for k in kinds):
            ms = sum(mix[k]["per_token"] * cost[k] for k in kinds)
            out[mode] = {"tok_s": 1e3 / ms if ms else 0.0, "ms_per_token": ms,
                         "mix": {k: round(mix[k]["per_token"], 4) for k in kinds}}
    if "ar" in out:
        for v in out.values():
            v["x_ar"] = v["tok_s"] / out["ar"]["tok_s"]
    return out


def print_decode(name: str, d: dict) -> None:
    print(f"\n{name}: {Path(d['gguf']).name} ({d['file_bytes'] / 2**20:.0f} MiB), {d['prompts']} prompts, "
          f"max {d['max_new_tokens']} new tokens, gpu_layers {d['gpu_layers']}, n_cpu_moe {d['n_cpu_moe']}")
    print(f"{'mode':<11} {'tokens':>6} {'tok/s':>8} {'decode':>8} {'pass/tok':>8} {'model':>6}  "
          f"ms per pass (median, count)")
    for mode, r in d["modes"].items():
        kinds = ", ".join(f"{k} {p['median_ms']:.2f} ({p['count']})" for k, p in r["passes"].items())
        print(f"{mode:<11} {r['tokens']:>6} {r['tok_s']:8.1f} {r['decode_tok_s']:8.1f} {r['passes_per_token']:8.3f} "
              f"{r['model_share']:6.0%}  {kinds}")
    for mode, r in d["modes"].items():
        if "decode_share" in r:
            print(f"{mode:<11} host {r['host_ms_per_pass']:.2f} ms per pass (all but llama_decode), llama_decode "
                  f"{r['decode_share']:.0%} of the wall time")
    print("model: the share of the wall time spent in the backend's passes (the rest is the decoding loop in Python)")
    for mode, p in d.get("projected", {}).items():
        print(f"projected {mode:<11} {p['tok_s']:8.1f} tok/s ({p.get('x_ar', 0):.2f} x ar), pass mix {p['mix']}")


# ---- host ---------------------------------------------------------------------------------------------------------
def cmd_host(a) -> None:
    """bench/host.py's per-pass figures on a model (the slice: the 35B's vocabulary): host ms per AR step and per
    32-token block pass outside llama_decode, selection in numpy (before) and in the graph (after), interleaved."""
    from host import bench_passes
    from clover_gguf.testing.device import offload_kwargs

    gguf = model_from(a.gguf_from)
    t0 = time.monotonic()
    res = bench_passes(gguf, a.threads, a.rounds, a.history, **offload_kwargs(a.gpu_layers))
    data = {"gguf": str(gguf), "history": a.history, "rounds": a.rounds, "gpu_layers": a.gpu_layers, "passes": res,
            "seconds": round(time.monotonic() - t0, 1)}
    write_section(a.name, data)
    for kind in ("ar", "block"):
        for path in ("before", "after"):
            r = res[path][kind]
            print(f"{kind:<6} {path:<7} wall {r['wall_ms']:8.2f} ms, llama_decode {r['decode_ms']:8.2f} ms, host "
                  f"{r['host_ms']:7.2f} ms ({r['n']} passes)")


# ---- block checks (the patch's GPU questions) -----------------------------------------------------------------------
def cmd_block_checks(a) -> None:
    """What the patch review asks the GPU (docs/llama-cpp-patch.md, "Backends"): (1) graph reuse when block and
    causal passes alternate, as draft-self runs them: llama.cpp's reuse count and ms per pass of each kind, causal
    only, blocks only, alternating; (2) the experts the block coreset routes to on this device against the CPU's, for
    the same blocks (F32 matmuls use TF32 on CUDA, GPU argsort is not stable): the share of (layer, token) whose top-k
    expert sets are equal."""
    import numpy as np

    from graph_reuse import measure as measure_reuse  # the one reuse loop (bench/graph_reuse.py)

    from clover_gguf.graph_probe import GraphProbe
    from clover_gguf.llama_context import LlamaContext
    from clover_gguf.testing.device import offload_kwargs

    gguf = model_from(a.gguf_from)
    t0 = time.monotonic()
    rng = np.random.default_rng(0)
    r = LlamaContext(gguf, n_ctx=1024, n_ubatch=512, n_seq_max=2, exact=True, n_threads=a.threads,
                     **offload_kwargs(a.gpu_layers))
    try:
        vocab = r.n_vocab
        prefix = rng.integers(0, vocab, 64).tolist()
        blocks = [rng.integers(0, vocab, 32).tolist() for _ in range(a.passes)]
        reuse = {}
        for kind in ("causal", "block", "alternating"):
            row = measure_reuse(r, kind, a.passes, prefix, blocks, rng)
            reuse[kind] = {"passes": a.passes, "graphs_reused": row["reused"],
                           **{k: round(v, 3) for k, v in row.items() if k.endswith("_ms")}}
            print(f"{kind:<12} {reuse[kind]}")
    finally:
        r.close()

    experts = {}
    probes = {}
    for where, layers in (("cpu", 0), ("device", a.gpu_layers)):
        probe = GraphProbe(r"ffn_moe_topk-\d+")
        r = LlamaContext(gguf, n_ctx=1024, n_ubatch=512, n_seq_max=2, exact=True, n_threads=a.threads,
                         eval_callback=probe.callback, **offload_kwargs(layers))
        try:
            r.decode(prefix, 0, 0, logits=False)
            probe.clear()
            for b in blocks[:4]:
                r.block(b, len(prefix))
            probe.check()
            probes[where] = [(rec.name, np.sort(rec.data.reshape(-1, rec.data.shape[-1]), axis=1))
                             for rec in probe.records]
        finally:
            r.close()
    same = total = 0
    first_diff = None
    for (name, cpu), (_, dev) in zip(probes["cpu"], probes["device"]):
        eq = (cpu == dev).all(axis=1)
        same, total = same + int(eq.sum()), total + eq.size
        if first_diff is None and not eq.all():
            first_diff = name
    experts = {"layer_tokens": total, "equal_share": round(same / total, 6) if total else None,
               "first_difference": first_diff, "records": [len(probes["cpu"]), len(probes["device"])]}
    print(f"coreset experts, device against CPU: {experts}")
    write_section(a.name, {"gguf": str(gguf), "gpu_layers": a.gpu_layers, "graph_reuse": reuse, "experts": experts,
                           "seconds": round(time.monotonic() - t0, 1)})


# ---- memory -------------------------------------------------------------------------------------------------------
def gpu_used_mib() -> dict:
    """nvidia-smi's view: memory used on the GPU, and by this process."""
    total = sh(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"])
    apps = sh(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"])
    mine = [int(m) for pid, m in (ln.split(",") for ln in apps.splitlines() if "," in ln)
            if pid.strip() == str(os.getpid()) and m.strip().isdigit()]
    if not total:
        return {"nvidia_smi": "not available"}
    used, cap = (int(x) for x in total.split(",")[:2])
    return {"gpu_used_mib": used, "gpu_total_mib": cap, "this_process_mib": mine[0] if mine else None}


def cmd_memory(a) -> None:
    """For the slice at one context size: llama.cpp's own estimate (llama-fit-params --fit-print, and its fitted
    arguments), clover-gguf fit's prediction when the command exists, against what llama.cpp holds once the runtime
    has made its context and run a block pass (LlamaContext.memory_breakdown) and what nvidia-smi sees."""
    from clover_gguf.build import llama_tool
    from clover_gguf.runtime import CloverRuntime
    from clover_gguf.testing.device import offload_kwargs

    gguf = model_from(a.gguf_from)
    data: dict = {"gguf": str(gguf), "n_ctx": a.ctx, "file_bytes": gguf.stat().st_size}
    write_section(a.name, data)
    tool = str(llama_tool("llama-fit-params"))
    common = ["-m", str(gguf), "-c", str(a.ctx), "-ngl", "999" if a.gpu_layers < 0 else str(a.gpu_layers)]
    for key, extra in (("llama_fit_print", ["--fit-print", "on"]), ("llama_fit_params", [])):
        # hang guards far above the work (the step's cap in run.sh is the device run's limit; `--budget 0` has none)
        p = subprocess.run([tool, *common, *extra], capture_output=True, text=True, timeout=1200)
        lines = [ln for ln in (p.stderr + p.stdout).splitlines() if re.search(r"fit|MiB|^-c ", ln)]
        data[key] = {"cmd": " ".join(["llama-fit-params", *common, *extra]), "rc": p.returncode,
                     "stdout": p.stdout.strip().splitlines()[-12:], "log": lines[-12:]}
        print(f"$ {data[key]['cmd']}\n" + "\n".join(data[key]["stdout"] or lines[-6:]), flush=True)
    write_section(a.name, data)
    fit_help = subprocess.run([sys.executable, "-m", "clover_gguf", "fit", "--help"], capture_output=True)
    has_fit = fit_help.returncode == 0
    if has_fit:
        cmd = ["fit", str(gguf), "--ctx", str(a.ctx), "--measure", "--json"]  # prediction and llama.cpp's own bytes
        p = subprocess.run([sys.executable, "-m", "clover_gguf", *cmd], capture_output=True, text=True, timeout=1800)
        data["clover_fit_cmd"] = "clover-gguf " + " ".join(cmd)
        try:
            data["clover_fit"] = json.loads(p.stdout)
        except ValueError:
            data["clover_fit"] = {"rc": p.returncode, "output": (p.stdout + p.stderr).strip().splitlines()[-8:]}
        print(f"clover-gguf fit: {json.dumps(data['clover_fit'])[:2000]}", flush=True)
    else:
        data["clover_fit"] = {"skipped": "`clover-gguf fit` is not in this project yet (branch fit)"}
        print(data["clover_fit"]["skipped"])
    write_section(a.name, data)
    before = gpu_used_mib()
    with CloverRuntime(gguf, n_ctx=a.ctx, n_threads=a.threads, **offload_kwargs(a.gpu_layers)) as rt:
        created = rt.ctx.memory_breakdown()
        b = rt.backend  # each kind of pass once: a prompt, a full block, a commit of it
        b.prefill(rt.ctx.tokenize("Count from 3 to 90.", special=True))
        block = [rt.mask_token_id] * rt.block_size
        b.block_logits(block)
        b.commit(block)
        after_block = rt.ctx.memory_breakdown()
        during = gpu_used_mib()
    mib = lambda b: {k: {f: round(v / 2**20, 1) for f, v in parts.items()} for k, parts in b.items()}  # noqa: E731
    data["runtime"] = {"settings": "CloverRuntime defaults: 3 sequences, unified KV, n_ubatch 512",
                       "breakdown_mib_at_creation": mib(created), "breakdown_mib_after_decoding": mib(after_block),
                       "nvidia_smi_before": before, "nvidia_smi_loaded": during}
    write_section(a.name, data)
    print("llama.cpp memory breakdown (MiB: model, context, compute) at creation / after decoding:")
    for buft in created:
        print(f"  {buft:<14} {mib(created)[buft]}  /  {mib(after_block).get(buft)}")
    print(f"nvidia-smi: before {before}, loaded {during}")


# ---- record / report ----------------------------------------------------------------------------------------------
STEP_FILE = "steps.jsonl"


def cmd_record(a) -> None:
    """One line per finished (or skipped) step, in run order."""
    rec = {"step": a.step, "status": a.status, "seconds": a.seconds, "expected_s": a.expected, "cap_s": a.cap,
           "reason": a.reason}
    with open(work() / STEP_FILE, "a") as f:
        f.write(json.dumps(rec) + "\n")


def cmd_report(a) -> None:
    """$OUT/results.json (every step's status and every section's figures) and $OUT/results.md (the same, read)."""
    out = Path(os.environ["OUT"])
    out.mkdir(parents=True, exist_ok=True)
    steps = [json.loads(x) for x in (work() / STEP_FILE).read_text().splitlines()] if (work() / STEP_FILE).is_file() \
        else []
    sections = {}
    for p in sorted((work() / "sections").glob("*.json")):
        with contextlib.suppress(ValueError):
            sections[p.stem] = json.loads(p.read_text())
    planned = [s for s in a.planned.split(",") if s]
    done = {s["step"] for s in steps}
    results = {"run": {"backend": a.backend, "budget_s": a.budget, "elapsed_s": a.elapsed,
                       "finished": not (set(planned) - done),
                       "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
               "steps": steps, "not_reached": [s for s in planned if s not in done], "sections": sections}
    for name in (out / "results.json", out / "results.md"):
        tmp = name.with_suffix(f".{os.getpid()}.tmp")  # the background step reports too
        tmp.write_text(json.dumps(results, indent=1, default=str) + "\n" if name.suffix == ".json"
                       else markdown(results))
        os.replace(tmp, name)


def _cell(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v).replace("|", "/").replace("\n", " ")


def markdown(r: dict) -> str:
    run, sec = r["run"], r["sections"]
    budget = f"a {run['budget_s']} s budget" if run["budget_s"] else "no time budget (--budget 0)"
    lines = [f"# GPU check results ({run['backend']})", "",
             f"Written {run['written']}, {run['elapsed_s']} s into {budget}; "
             f"{'all steps reached' if run['finished'] else 'not finished: ' + ', '.join(r['not_reached'])}.", "",
             "| step | status | s | expected s | note |", "|---|---|---|---|---|"]
    for s in r["steps"]:
        lines.append(f"| {s['step']} | {s['status']} | {s['seconds']} | {s['expected_s']} | {_cell(s['reason'])} |")
    env = sec.get("env")
    if env:
        lines += ["", "## Machine", "", *[f"- {k}: {_cell(v)}" for k, v in env.items() if k not in ("kit", "imports")],
                  f"- kit: llama.cpp {env['kit']['llama_cpp_commit']}, patches {', '.join(env['kit']['patches'])}, "
                  f"project {env['kit']['project_commit']}"]
    for name in ("parity_exact", "parity_real_shape", "parity_runtime", "parity_defaults"):
        p = sec.get(name)
        if not p or "tests" not in p:
            continue
        errs = (f"max relative error {_cell(p['max_rel_err'])} over {p['comparisons']} comparisons with the "
                f"reference (tolerance {p['tolerance']})" if p["comparisons"] else "pass or fail: no logged errors")
        lines += ["", f"## {name}: {p['what']}", "",
                  f"{p['passed']} passed, {p['failed']} failed; {errs}; {p['seconds']} s", "",
                  "| test | outcome | max rel err | s |", "|---|---|---|---|"]
        for t in p["tests"]:
            note = f" ({_cell(t['message'])})" if t.get("message") else ""
            err = _cell(t.get("max_rel_err", "-"))
            lines.append(f"| {t['test']} | {t['outcome']}{note} | {err} | {t['seconds']} |")
    for name in ("decode_bundled", "decode_slice", "decode_slice_cpu_moe"):
        d = sec.get(name)
        if not d or "modes" not in d:
            continue
        lines += ["", f"## {name}: {Path(d['gguf']).name}", "",
                  f"{d['prompts']} prompts, max {d['max_new_tokens']} new tokens, gpu_layers {d['gpu_layers']}, "
                  f"n_cpu_moe {d['n_cpu_moe']}, load {d['load_s']} s", "",
                  "| mode | tokens | tok/s | decode tok/s | passes/token | in llama.cpp | host ms per pass | "
                  "ms per pass (median, n) |",
                  "|---|---|---|---|---|---|---|---|"]
        for mode, m in d["modes"].items():
            kinds = ", ".join(f"{k} {p['median_ms']:.2f} ({p['count']})" for k, p in m["passes"].items())
            host = f"{m['host_ms_per_pass']:.2f}" if "host_ms_per_pass" in m else "-"
            lines.append(f"| {mode} | {m['tokens']} | {m['tok_s']:.1f} | {m['decode_tok_s']:.1f} | "
                         f"{m['passes_per_token']:.3f} | {m['model_share']:.0%} | {host} | {kinds} |")
        for mode, p in d.get("projected", {}).items():
            lines.append(f"| {mode}, projected from the bundled model's pass mix | | {p['tok_s']:.1f} | | | | | "
                         f"{p.get('x_ar', 0):.2f} x ar |")
        if d.get("llama_log"):
            lines += ["", "llama.cpp at load:", "", "```", *d["llama_log"][:24], "```"]
    h = sec.get("host_slice")
    if h and "passes" in h:
        lines += ["", f"## host_slice: {Path(h['gguf']).name}, history {h['history']} tokens", "",
                  "| pass | selection | wall ms | llama_decode ms | host ms | n |", "|---|---|---|---|---|---|"]
        for kind, name in (("ar", "AR step"), ("block", "32-token block pass + commit")):
            for path in ("before", "after"):
                r = h["passes"][path][kind]
                lines.append(f"| {name} | {'numpy' if path == 'before' else 'graph'} | {r['wall_ms']:.2f} | "
                             f"{r['decode_ms']:.2f} | {r['host_ms']:.2f} | {r['n']} |")
    m = sec.get("memory")
    if m:
        lines += ["", f"## memory: {Path(m['gguf']).name}, n_ctx {m['n_ctx']}", ""]
        for key in ("llama_fit_print", "llama_fit_params"):
            if key in m:
                cols = " (per device: model, context, compute MiB)" if key == "llama_fit_print" else ""
                lines += [f"`{m[key]['cmd']}` (rc {m[key]['rc']}){cols}:", "", "```",
                          *(m[key]["stdout"] or m[key]["log"]), "```", ""]
        fit = m.get("clover_fit") or {}
        if "parts" in fit:
            meas = fit.get("measured") or {}
            lines += [f"`{m.get('clover_fit_cmd')}`: {'fits' if fit.get('fits') else 'does not fit'}, "
                      f"gpu_layers {fit.get('gpu_layers')}, n_cpu_moe {fit.get('n_cpu_moe')}, ctx {fit.get('ctx')}; "
                      f"llama-fit-params there: {_cell(fit.get('llama_fit_params', '-'))}", "",
                      "| part | predicted MiB | measured MiB |", "|---|---|---|"]
            for part, v in fit["parts"].items():
                got = meas.get(part)
                lines.append(f"| {part} | {v / 2**20:.1f} | {'-' if got is None else f'{got / 2**20:.1f}'} |")
            lines.append("")
        elif fit:
            lines += [f"clover-gguf fit: {_cell(json.dumps(fit))[:1500]}", ""]
        rt = m.get("runtime")
        if rt:
            lines += ["llama.cpp's own bytes (LlamaContext.memory_breakdown) with the runtime's settings, MiB of "
                      "model / context (KV + recurrent states) / compute:", "",
                      "| buffer | at creation | after a prompt, a block pass and a commit |", "|---|---|---|"]
            fmt = lambda v: "-" if not v else f"{v['model']} / {v['context']} / {v['compute']}"  # noqa: E731
            for buft, v in rt["breakdown_mib_at_creation"].items():
                lines.append(f"| {buft} | {fmt(v)} | {fmt(rt['breakdown_mib_after_decoding'].get(buft))} |")
            lines += ["", f"nvidia-smi before: {_cell(rt['nvidia_smi_before'])}; loaded: "
                      f"{_cell(rt['nvidia_smi_loaded'])}"]
    for name, s in sec.items():
        if isinstance(s, dict) and isinstance(s.get("skipped"), str):
            lines += ["", f"## {name}: skipped", "", s["skipped"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("env")
    p.add_argument("--kit", required=True)
    p.add_argument("--backend", required=True)
    p = sub.add_parser("build")
    p.add_argument("--kit", required=True)
    p.add_argument("--build-dir", required=True)
    p.add_argument("--backend", required=True)
    p.add_argument("--cuda-arch")
    p.add_argument("--jobs", type=int, default=os.cpu_count())
    p.add_argument("--reuse-build", action="store_true")
    sub.add_parser("llama-archs")
    p = sub.add_parser("parity")
    p.add_argument("name")
    p.add_argument("--settings", choices=("exact", "defaults"), required=True)
    p.add_argument("--gpu-layers", type=int, default=-1)
    p = sub.add_parser("slice")
    p.add_argument("name")
    p.add_argument("--num-experts", type=int, required=True)
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--quantize", help="a llama.cpp type, e.g. Q4_K_M")
    p = sub.add_parser("decode")
    p.add_argument("name")
    p.add_argument("--gguf")
    p.add_argument("--gguf-from", help="a section naming the model file (a slice step)")
    p.add_argument("--bundled", action="store_true", help="the bundled trained model, as F32 GGUF")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--gpu-layers", type=int, default=-1)
    p.add_argument("--n-cpu-moe", type=int, default=0)
    p.add_argument("--threads", type=int, help="llama.cpp threads (default: the runtime's)")
    p.add_argument("--project-from", help="a decode section whose pass mix projects tok/s")
    p.add_argument("--threshold", type=float, help="block decoding's confidence threshold (default: the model's); 0 "
                   "resolves a whole block per pass, whatever the weights")
    def model_step(step: str) -> argparse.ArgumentParser:
        """A step on the model file a slice step made: its section name, that section, offload and threads."""
        q = sub.add_parser(step)
        q.add_argument("name")
        q.add_argument("--gguf-from", required=True)
        q.add_argument("--gpu-layers", type=int, default=-1)
        q.add_argument("--threads", type=int, help="llama.cpp threads (default: the runtime's)")
        return q

    p = model_step("host")
    p.add_argument("--history", type=int, default=100)
    p.add_argument("--rounds", type=int, default=1)
    p = model_step("block-checks")
    p.add_argument("--passes", type=int, default=16)
    p = model_step("memory")
    p.add_argument("--ctx", type=int, default=8192)
    p = sub.add_parser("record")
    p.add_argument("step")
    p.add_argument("status")
    p.add_argument("seconds", type=int)
    p.add_argument("expected", type=int)
    p.add_argument("cap", type=int)
    p.add_argument("reason")
    p = sub.add_parser("report")
    p.add_argument("--backend", required=True)
    p.add_argument("--budget", type=int, required=True)
    p.add_argument("--elapsed", type=int, required=True)
    p.add_argument("--planned", default="")
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)  # parity: what follows -- goes to pytest
    a = ap.parse_args(argv[:cut])
    a.pytest_args = argv[cut + 1:]
    from clover_gguf.errors import UserError

    try:
        {"env": cmd_env, "build": cmd_build, "llama-archs": cmd_llama_archs, "parity": cmd_parity,
         "slice": cmd_slice, "decode": cmd_decode, "host": cmd_host, "block-checks": cmd_block_checks,
         "memory": cmd_memory, "record": cmd_record,
         "report": cmd_report}[a.cmd](a)
    except UserError as e:  # one line, the step's reason in the results
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
