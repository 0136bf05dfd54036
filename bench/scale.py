"""The 35B's real per-layer sizes end to end, on a 4-layer slice: convert, quantize, vocabulary and CPU decoding
costs, each against a peer measured in the same run (docs/scale.md reads the figures).

    python bench/scale.py [--workdir out/scale] [--num-experts 256] [--vocab-size 248320]
        [--threads 1] [--quantize-threads 2] [--rounds 7] [--keep] [--reuse]

1. `make_tiny --preset slice35b` (4 layers: 3 GDN + 1 attention, hidden 2048, 256 experts top-8 of width 512,
   vocabulary 248,320, BF16), made once in the work folder (`--keep` keeps everything for another run).
2. convert BF16 -> BF16 GGUF against `cp` of the same shard bytes: MB/s and peak RSS (each its own process).
3. quantize Q4_K_M and Q8_0 against `llama-quantize` run directly on the same BF16 GGUF: MB/s, peak RSS, and the
   file size against `quantize --plan` on the same input (to the byte) and on the slice's config.json alone.
4. vocabulary: reading tokenizer.json and writing it as GGUF metadata; llama.cpp loading that vocabulary alone;
   the runtime's start-up (CloverRuntime) on the Q4_K_M file.
5. on the Q4_K_M file, CPU: ms per AR step, per causal pass of 32 tokens, per 32-token block pass with the coreset
   on and off (interleaved round by round), the part of each spent in the output layer (lm_head over 248k rows,
   timed from the graph's `result_norm`), the distinct experts each pass routes to per layer (read from the graph),
   and the ratios; the tok/s each decoding mode would reach at this shape from the bundled model's pass mix
   (its tokens per pass and pass kinds, measured here on the bundled model), on the slice and scaled to 40 layers.
6. peak RSS of the runtime decoding in each mode (own process each), beside `clover-gguf fit --measure`.
--reuse: sections 4-6 only, on the slice and Q4_K_M file an earlier `--keep` run left in the work folder (after a
change that moves only those figures, e.g. a retrained bundled model; 1-3 are not run and not printed).
No asserts on timings: the figures are printed, ratios beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from measure import PassLog, measure, warm  # noqa: E402
from quantize import OURS as QUANTIZE_OURS  # noqa: E402

N_LAYERS_35B = 40
PREFIX_TOKENS = 64
PASS_TOKENS = 32
MB = 1e6


def header(title: str) -> None:
    print(f"\n== {title}", flush=True)


def shards(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("*.safetensors"))


# ---- 1. the slice ---------------------------------------------------------------------------------------------
def make_slice(path: Path, num_experts: int | None, vocab_size: int | None) -> None:
    if (path / "config.json").is_file():
        print(f"slice: {path} (exists)")
        return
    from clover_gguf.testing.make_tiny import make_tiny

    t0 = time.perf_counter()
    make_tiny(path, seed=0, preset="slice35b", num_experts=num_experts, vocab_size=vocab_size,
              shard_size=4_000_000_000, quiet=False)
    print(f"slice: made {path} in {time.perf_counter() - t0:.0f} s")


# ---- 2. convert -----------------------------------------------------------------------------------------------
def bench_convert(ckpt: Path, bf16: Path, env: dict) -> dict:
    header("convert BF16 -> BF16 GGUF, against cp of the same bytes (page cache warm)")
    size = sum(p.stat().st_size for p in shards(ckpt))
    copy_dir = bf16.parent / "cp-target"
    shutil.rmtree(copy_dir, ignore_errors=True)
    copy_dir.mkdir()
    warm(ckpt)
    cp = measure(["cp", *map(str, shards(ckpt)), str(copy_dir)])
    shutil.rmtree(copy_dir)
    warm(ckpt)
    ours = measure([sys.executable, "-m", "clover_gguf", "convert", str(ckpt), "-o", str(bf16), "--outtype", "bf16",
                    "--quiet"], env)
    print(f"{'run':<12} {'wall s':>7} {'CPU s':>7} {'MB/s':>6} {'MB/CPU-s':>9} {'peak RSS MiB':>13}")
    for name, m in (("cp", cp), ("convert", ours)):
        print(f"{name:<12} {m.wall:7.1f} {m.cpu:7.1f} {size / m.wall / MB:6.0f} {size / m.cpu / MB:9.0f} "
              f"{m.rss / 2**20:13.0f}")
    print(f"convert speed / cp speed: {cp.wall / ours.wall:.2f} (wall), {cp.cpu / ours.cpu:.2f} (CPU); convert peak "
          f"RSS {ours.rss / 2**30:.3f} GiB (target < 1 GiB); checkpoint {size / 1e9:.2f} GB -> GGUF "
          f"{bf16.stat().st_size / 1e9:.2f} GB")
    return {"bytes": size, "cp": cp.__dict__, "convert": ours.__dict__}


# ---- 3. quantize ----------------------------------------------------------------------------------------------
def bench_quantize(bf16: Path, ckpt: Path, wd: Path, types: list[str], threads: int, env: dict) -> dict:
    from clover_gguf.quantize import llama_tool, plan

    header(f"quantize from the BF16 GGUF, against llama-quantize on the same input ({threads} threads)")
    tool = llama_tool("llama-quantize")
    env = {**env, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(tool.parent), env.get("LD_LIBRARY_PATH")]))}
    size = bf16.stat().st_size
    out = {}
    print(f"{'type':<7} {'run':<15} {'wall s':>7} {'CPU s':>7} {'MB/s':>6} {'MB/CPU-s':>9} {'peak RSS MiB':>13} "
          f"{'file bytes':>14}")
    for qtype in types:
        rows = {}
        for name in ("llama-quantize", "clover-gguf"):
            dst = wd / f"slice-{qtype.lower()}-{name}.gguf"
            warm(bf16)
            cmd = ([str(tool), str(bf16), str(dst), qtype, str(threads)] if name == "llama-quantize" else
                   [sys.executable, "-c", QUANTIZE_OURS, str(bf16), str(dst), qtype, str(threads)])
            m = measure(cmd, env)
            rows[name] = dict(m.__dict__, bytes=dst.stat().st_size)
            print(f"{qtype:<7} {name:<15} {m.wall:7.1f} {m.cpu:7.1f} {size / m.wall / MB:6.0f} {size / m.cpu / MB:9.0f} "
                  f"{m.rss / 2**20:13.0f} {rows[name]['bytes']:14d}", flush=True)
            if name == "llama-quantize":
                dst.unlink()
        qp = plan(qtype, src=bf16)
        from_config = plan(qtype, config=ckpt / "config.json").size_bytes
        base, ours, got = rows["llama-quantize"], rows["clover-gguf"], rows["clover-gguf"]["bytes"]
        print(f"{qtype:<7} throughput clover-gguf / llama-quantize: {base['wall'] / ours['wall']:.2f} (wall), "
              f"{base['cpu'] / ours['cpu']:.2f} (CPU); peak RSS ratio {ours['rss'] / base['rss']:.2f}")
        print(f"{qtype:<7} file {got} bytes; `quantize --plan` on the BF16 GGUF: {qp.size_bytes} "
              f"({got - qp.size_bytes:+d}); on config.json alone: {from_config} ({got - from_config:+d}, the "
              f"tokenizer metadata); types: " +
              ", ".join(f"{n} x{c} {b / 2**20:.0f} MiB" for n, (c, b) in
                        sorted(qp.by_type().items(), key=lambda kv: -kv[1][1])))
        for note in qp.notes:
            print(f"{qtype:<7} note: {note}")
        out[qtype] = dict(rows=rows, predicted=qp.size_bytes, from_config=from_config, notes=qp.notes)
    return out


# ---- 4. vocabulary ---------------------------------------------------------------------------------------------
def bench_vocab(ckpt: Path, q4: Path, threads: int) -> dict:
    from gguf import GGUFWriter

    from clover_gguf.config import CloverConfig
    from clover_gguf.metadata import GenerationDefaults
    from clover_gguf.convert import ARCH, write_metadata
    from clover_gguf.llama_context import _quiet_log, load_binding
    from clover_gguf.runtime import CloverRuntime
    from clover_gguf.vocab import load_vocab

    header("vocabulary and start-up (wall / CPU seconds)")

    def timed(fn):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        return out, time.perf_counter() - t0, time.process_time() - c0

    cfg = CloverConfig.from_file(ckpt)
    vocab, read_w, read_c = timed(lambda: load_vocab(ckpt, cfg))
    with tempfile.TemporaryDirectory(dir=q4.parent) as tmp:
        def write() -> int:
            w = GGUFWriter(path=None, arch=ARCH)
            write_metadata(w, cfg, vocab, GenerationDefaults(), cfg.num_hidden_layers, "slice")
            w.open_output_file(Path(tmp) / "meta.gguf")
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.close()
            return (Path(tmp) / "meta.gguf").stat().st_size

        meta_bytes, write_w, write_c = timed(write)
    L = load_binding()
    L.llama_backend_init()
    L.llama_log_set(_quiet_log(L), None)
    mp = L.llama_model_default_params()
    mp.vocab_only = True
    model, vocab_w, vocab_c = timed(lambda: L.llama_model_load_from_file(str(q4).encode(), mp))
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    L.llama_model_free(model)
    rt, rt_w, rt_c = timed(lambda: CloverRuntime(q4, n_ctx=1024, n_threads=threads))
    _, eog_w, eog_c = timed(rt._scan_vocab)
    rt.close()
    n_real = sum(1 for t in vocab.tokens if not t.startswith("[PAD"))
    print(f"tokenizer.json ({n_real:,} tokens, {len(vocab.merges):,} merges, {cfg.vocab_size:,} rows) read: "
          f"{read_w:.2f} / {read_c:.2f} s; written as GGUF metadata ({meta_bytes / 2**20:.1f} MiB): "
          f"{write_w:.2f} / {write_c:.2f} s")
    print(f"llama.cpp loading the vocabulary alone ({n_vocab:,} tokens): {vocab_w:.2f} / {vocab_c:.2f} s")
    print(f"runtime start-up (CloverRuntime on the Q4_K_M file, n_ctx 1024): {rt_w:.2f} / {rt_c:.2f} s, of which the "
          f"vocabulary scan (end tokens, control-token texts) {eog_w:.2f} / {eog_c:.2f} s")
    return dict(read=(read_w, read_c), write=(write_w, write_c), vocab_only=(vocab_w, vocab_c),
                runtime=(rt_w, rt_c), eog_scan=(eog_w, eog_c), meta_bytes=meta_bytes)


# ---- 5. passes -------------------------------------------------------------------------------------------------
PASSES = ("AR step", "causal 32", "block 32, coreset on", "block 32, coreset off")


class PassRunner:
    """Two contexts on the Q4_K_M file (coreset on / off: a load-time setting), each after the same prefix on seq 0.
    An AR step commits a token on seq 0 of the coreset-on context; the other kinds run on a scratch copy of seq 0
    and leave it as it was (a causal pass the same way as a block pass, so both pay the same sequence copy)."""

    def __init__(self, gguf: Path, threads: int, vocab_size: int, probe=None):
        from clover_gguf.llama_context import LlamaContext
        from clover_gguf.metadata import CORESET_ENABLED

        rng = np.random.default_rng(0)
        self.prefix = rng.integers(0, vocab_size, PREFIX_TOKENS).tolist()
        self.block = rng.integers(0, vocab_size, PASS_TOKENS).tolist()
        self.ar = rng.integers(0, vocab_size, 4096).tolist()
        cb = None if probe is None else probe.callback
        self.ctxs = {c: LlamaContext(gguf, n_ctx=512, n_ubatch=512, n_seq_max=3, n_threads=threads,
                                     eval_callback=cb, overrides={CORESET_ENABLED: c == "on"})
                     for c in ("on", "off")}
        for c in self.ctxs.values():
            c.decode(self.prefix, 0, 0, logits=False)
        self.n_past = {c: PREFIX_TOKENS for c in self.ctxs}

    def run(self, kind: str):
        if kind == "AR step":
            n = self.n_past["on"]
            self.n_past["on"] += 1
            return self.ctxs["on"].decode([self.ar[n - PREFIX_TOKENS]], n, 0)
        if kind == "causal 32":
            ctx = self.ctxs["on"]
            ctx.seq_cp(0, 1)
            try:
                return ctx.decode(self.block, self.n_past["on"], 1)
            finally:
                ctx.seq_rm(1)
        c = "on" if kind.endswith("on") else "off"
        return self.ctxs[c].block(self.block, self.n_past[c])

    def close(self) -> None:
        for c in self.ctxs.values():
            c.close()


def _callback_cost(probe) -> float:
    """Seconds one ask-call of the probe costs, calling it through ctypes as llama.cpp does (from C it is cheaper:
    an upper bound)."""
    import ctypes

    from clover_gguf.graph_probe import _GGMLTensor

    t = _GGMLTensor()
    t.name = b"not-asked-for"
    ptr = ctypes.cast(ctypes.pointer(t), ctypes.c_void_p)
    n = 20_000
    c0 = time.process_time()
    for _ in range(n):
        probe.callback(ptr, True, None)
    return (time.process_time() - c0) / n


def bench_passes(q4: Path, threads: int, rounds: int, vocab_size: int) -> dict:
    """Per pass kind: wall and CPU ms (medians), split at the graph's final norm into the layers' part and the output
    part (the output layer over the whole vocabulary and the logits copied out), the layers scaled to 40, and the
    distinct experts the pass routed to."""
    from clover_gguf.graph_probe import GraphProbe

    header(f"CPU passes on the Q4_K_M slice ({threads} thread(s); {rounds} rounds, kinds interleaved; "
           f"prefix {PREFIX_TOKENS} tokens)")
    # every kind once per round (the machine's drift lands on all kinds alike); each pass is split where the graph
    # computes `result_norm`, so the split and the total come from the same pass
    mark = GraphProbe("result_norm", read_data=False)
    runner = PassRunner(q4, threads, vocab_size, mark)
    samples: dict[str, dict[str, list[float]]] = {k: {f: [] for f in ("wall", "cpu", "wall_out", "cpu_out")}
                                                  for k in PASSES}
    asked = {}
    try:
        for kind in PASSES:  # warm-up
            runner.run(kind)
        for _ in range(rounds):
            for kind in PASSES:
                mark.clear()
                t0, c0 = time.perf_counter(), time.process_time()
                runner.run(kind)
                t1, c1 = time.perf_counter(), time.process_time()
                m = mark.records[-1]
                x = samples[kind]
                x["wall"].append(t1 - t0)
                x["cpu"].append(c1 - c0)
                x["wall_out"].append(t1 - m.seconds)
                x["cpu_out"].append(c1 - m.cpu_seconds)
                asked[kind] = mark.asked
        per_call = _callback_cost(mark)
    finally:
        runner.close()
    mark.check()
    # the experts each pass routed to, from the top-k tensors of every MoE layer (a pass of each kind, not timed)
    probe = GraphProbe(r"ffn_moe_topk-\d+")
    runner = PassRunner(q4, threads, vocab_size, probe)
    experts = {}
    try:
        for kind in PASSES:
            probe.clear()
            runner.run(kind)
            experts[kind] = [len(e) for _, e in sorted(probe.experts_per_layer().items())]
    finally:
        runner.close()
    res = {}
    for kind in PASSES:
        x = samples[kind]
        r = res[kind] = dict(experts=experts[kind], callbacks=asked[kind], callback_ms=asked[kind] * per_call * 1e3)
        for key in ("wall", "cpu"):
            total, out = float(np.median(x[key])) * 1e3, float(np.median(x[f"{key}_out"])) * 1e3
            r[f"{key}_ms"], r[f"{key}_out_ms"], r[f"{key}_layers_ms"] = total, out, total - out
            r[f"{key}_ms_35b"] = (total - out) * N_LAYERS_35B / 4 + out
            r[f"{key}_range_ms"] = (min(x[key]) * 1e3, max(x[key]) * 1e3)
    for r in res.values():
        for key in ("wall", "cpu"):
            r[f"{key}_x_ar"] = r[f"{key}_ms"] / res["AR step"][f"{key}_ms"]
            r[f"{key}_x_ar_35b"] = r[f"{key}_ms_35b"] / res["AR step"][f"{key}_ms_35b"]
    print(f"{'pass':<22} {'CPU ms':>7} {'min-max':>13} {'x AR':>5} {'output':>7} {'layers':>7} {'35B ms':>7} "
          f"{'x AR':>5} | {'wall ms':>8} {'x AR':>5} | distinct experts per layer")
    for kind, r in res.items():
        lo, hi = r["cpu_range_ms"]
        print(f"{kind:<22} {r['cpu_ms']:7.1f} {lo:6.0f}-{hi:<6.0f} {r['cpu_x_ar']:5.2f} {r['cpu_out_ms']:7.1f} "
              f"{r['cpu_layers_ms']:7.1f} {r['cpu_ms_35b']:7.0f} {r['cpu_x_ar_35b']:5.2f} | {r['wall_ms']:8.1f} "
              f"{r['wall_x_ar']:5.2f} | {r['experts']} (mean {np.mean(r['experts']):.1f})")
    print("medians. CPU ms: the process's CPU time (with one thread the work itself; the steadier figure on a shared "
          "machine); output: from the graph's final norm to the logits copied out (the output layer over the whole "
          "vocabulary); layers: the rest; 35B ms: layers x 40/4 + output. The split costs each pass "
          + ", ".join(f"{r['callbacks']} node callbacks (<= {r['callback_ms']:.1f} ms)" for r in res.values())
          + " in the layers' part, kinds in the order above")
    return res


def bundled_pass_mix(wd: Path, threads: int, n_prompts: int) -> dict:
    """Per decoding mode on the bundled trained model: generated tokens, and every llama.cpp call after the
    prompt's pass (block passes; causal passes with their token counts, rollback re-decodes included). The slice's
    random weights cannot resolve blocks; this model can."""
    from clover_gguf.convert import convert
    from clover_gguf.runtime import CloverRuntime

    model = ROOT / "clover_gguf" / "assets" / "tiny-clover"
    gguf = wd / "tiny-clover-f32.gguf"
    if not gguf.is_file():
        convert(model, gguf, outtype="f32", quiet=True)
    evals = [json.loads(line) for line in (model / "eval.jsonl").read_text().splitlines() if line.strip()]
    prompts = [e["prompt"] for e in evals][::max(1, len(evals) // n_prompts)][:n_prompts]
    mix = {}
    for mode in ("ar", "diffusion", "draft-self"):
        with CloverRuntime(gguf, n_ctx=1024, n_threads=threads) as rt:
            log = PassLog(rt)
            log.mode = mode
            tokens, blocks, causal = 0, 0, []
            for p in prompts:
                log.clear()
                tokens += rt.generate(p, mode=mode, max_new_tokens=96).stats.generated_tokens
                after_prompt = [q for q in log.passes if q.kind != "prompt" and q.decodes]
                blocks += sum(1 for q in after_prompt if q.kind == "block")
                causal += [q.tokens for q in after_prompt if q.kind != "block"]  # rollback re-decodes too
            log.close()
        mix[mode] = dict(tokens=tokens, block_passes=blocks, causal_passes=causal)
    return mix


def pass_cost(res: dict, n_tokens: int, key: str) -> float:
    """A causal pass of n tokens, priced between the measured 1-token and 32-token passes (linear in tokens)."""
    one, full = res["AR step"][key], res["causal 32"][key]
    return one + (full - one) * (min(n_tokens, PASS_TOKENS) - 1) / (PASS_TOKENS - 1)


def bench_mode_ratios(res: dict, mix: dict) -> dict:
    header("tok/s each decoding mode would reach, from the bundled model's pass mix priced at this shape's passes")
    print("pass mix (bundled trained model, after the prompt's pass): tokens, block passes, causal passes "
          "(mean tokens each)")
    for mode, m in mix.items():
        c = m["causal_passes"]
        print(f"  {mode:<11} {m['tokens']:5d} tokens  {m['block_passes']:4d} block  {len(c):5d} causal "
              f"(mean {np.mean(c) if c else 0:.1f})  -> {m['tokens'] / (m['block_passes'] + len(c)):.2f} tokens/pass")
    # the bundled answers fit in one block, so diffusion never commits one; a long answer commits each 32-token
    # block with one causal pass of 32 tokens
    d = mix["diffusion"]
    long_answers = dict(tokens=PASS_TOKENS * d["tokens"], block_passes=PASS_TOKENS * d["block_passes"],
                        causal_passes=[PASS_TOKENS] * d["tokens"])
    out = {}
    print(f"{'mode':<40} {'slice, CPU':>11} {'35B, CPU':>9} {'slice, wall':>12}   (tok/s x AR)")
    for mode, m in [*mix.items(), ("diffusion, long answers", long_answers)]:
        for coreset in (("on", "off") if mode != "ar" else ("-",)):
            row = {}
            for key in ("cpu_ms", "cpu_ms_35b", "wall_ms"):
                block = res[f"block 32, coreset {coreset}"][key] if coreset != "-" else 0.0
                total = m["block_passes"] * block + sum(pass_cost(res, n, key) for n in m["causal_passes"])
                ar_total = m["tokens"] * res["AR step"][key]  # AR: one step per token
                row[key] = ar_total / total
            name = mode if coreset == "-" else f"{mode}, coreset {coreset}"
            out[name] = row
            print(f"{name:<40} {row['cpu_ms']:11.2f} {row['cpu_ms_35b']:9.2f} {row['wall_ms']:12.2f}")
    print("long answers: the diffusion mix with a 32-token causal commit for every 32 tokens")
    return out


# ---- 6. memory per mode ----------------------------------------------------------------------------------------
MODE_RUN = """
import sys, resource
from clover_gguf.runtime import CloverRuntime
gguf, mode, coreset, threads = sys.argv[1], sys.argv[2], sys.argv[3] == "on", int(sys.argv[4])
rollback = "snapshot" if mode == "draft-self-snapshot" else "redecode"
with CloverRuntime(gguf, n_ctx=1024, n_threads=threads, coreset=coreset, rollback=rollback) as rt:
    # threshold 0: every masked position resolves in the first pass (random weights resolve nothing otherwise)
    a = rt.generate("Count from 3 to 90.", mode=mode.replace("-snapshot", ""), max_new_tokens=32, threshold=0.0)
    print(a.stats.generated_tokens, a.stats.forward_passes, file=sys.stderr)
"""


def bench_memory(q4: Path, threads: int, env: dict) -> dict:
    header("peak RSS of the runtime per decoding mode (own process each: load, a 32-token answer)")
    out = {}
    for mode, coreset in (("ar", "on"), ("diffusion", "on"), ("diffusion", "off"), ("draft-self", "on"),
                          ("draft-self-snapshot", "on")):
        m = measure([sys.executable, "-c", MODE_RUN, str(q4), mode, coreset, str(threads)], env)
        name = f"{mode}, coreset {coreset}" if mode != "ar" else mode
        out[name] = m.rss
        print(f"  {name:<32} peak RSS {m.rss / 2**20:7.0f} MiB  ({m.wall:.0f} s wall, {m.cpu:.0f} s CPU)", flush=True)
    print(f"  Q4_K_M file: {q4.stat().st_size / 2**20:.0f} MiB; llama.cpp's buffers for that runtime (its log):")
    log = subprocess.run([sys.executable, "-c", "import sys; from clover_gguf.runtime import CloverRuntime; "
                          "CloverRuntime(sys.argv[1], n_ctx=1024, n_threads=1).close()", str(q4)],
                         env={**env, "CLOVER_GGUF_LLAMA_LOG": "1"}, capture_output=True, text=True).stderr
    for line in log.splitlines():
        if "buffer size" in line and "~llama_context" not in line:
            print("   ", line.split(":", 1)[-1].strip())
    print("  against `clover-gguf fit --measure` at the same context (prediction / llama.cpp's bytes, MiB):")
    print(f"  {'mode':<32} {'weights':>15} {'kv+recurrent':>15} {'compute':>15} {'total':>15} {'peak RSS':>9}")
    out["fit"] = {}
    for mode, rollback, name in (("ar", "redecode", "ar"), ("diffusion", "redecode", "diffusion, coreset on"),
                                 ("draft-self", "redecode", "draft-self, coreset on"),
                                 ("draft-self", "snapshot", "draft-self-snapshot, coreset on")):
        p = subprocess.run([sys.executable, "-m", "clover_gguf", "fit", str(q4), "--ctx", "1024", "--mode", mode,
                            "--rollback", rollback, "--measure", "--json"], env=env, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"clover-gguf fit failed: {p.stderr.strip()[-500:]}")
        f = json.loads(p.stdout)
        pred, meas = f["parts"], f["measured"]
        mib = lambda d, *ks: sum(d[k] for k in ks) / 2**20  # noqa: E731
        cols = [("weights_device", "weights_host"), ("kv", "recurrent"), ("compute",),
                ("weights_device", "weights_host", "kv", "recurrent", "compute")]
        cells = [f"{mib(pred, *k):6.0f} / {mib(meas, *k):6.0f}" for k in cols]
        print(f"  {name:<32} {cells[0]:>15} {cells[1]:>15} {cells[2]:>15} {cells[3]:>15} {out[name] / 2**20:9.0f}")
        out["fit"][name] = {"predicted": pred, "measured": meas}
    print("  (on the CPU llama.cpp also holds a CPU_REPACK copy of the weights its kernels repack, listed above: fit "
          "counts the file's bytes once, docs/hardware.md)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=ROOT / "out" / "scale")
    ap.add_argument("--num-experts", type=int, default=None, help="cheaper variant (default: the 35B's 256)")
    ap.add_argument("--vocab-size", type=int, default=None, help="cheaper variant (default: the 35B's 248,320)")
    ap.add_argument("--threads", type=int, default=1,
                    help="llama.cpp threads for decoding (1: on a shared machine, two threads spin waiting on each "
                         "other at every op)")
    ap.add_argument("--quantize-threads", type=int, default=2, help="threads for both quantizers")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds of each pass kind")
    ap.add_argument("--prompts", type=int, default=30, help="bundled-model prompts for the pass mix")
    ap.add_argument("--keep", action="store_true", help="keep the slice and its GGUFs for another run")
    ap.add_argument("--reuse", action="store_true", help="sections 4-6 on an earlier --keep run's slice and Q4_K_M")
    a = ap.parse_args()
    t_start, cpu_start = time.perf_counter(), os.times()
    from clover_gguf.llama_context import load_binding

    load_binding()  # sets LLAMA_CPP_LIB_PATH for this process and the ones it starts
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    wd = a.workdir
    wd.mkdir(parents=True, exist_ok=True)
    ckpt, bf16 = wd / "ckpt", wd / "slice-bf16.gguf"
    q4 = wd / "slice-q4_k_m-clover-gguf.gguf"
    if a.reuse:
        if not (ckpt / "config.json").is_file() or not q4.is_file():
            raise SystemExit(f"--reuse needs {ckpt} and {q4} from an earlier --keep run")
        conv, quant = None, {}
        print(f"--reuse: the slice and {q4.name} from an earlier run; convert and quantize not run")
    else:
        make_slice(ckpt, a.num_experts, a.vocab_size)
        conv = bench_convert(ckpt, bf16, env)
        quant = bench_quantize(bf16, ckpt, wd, ["Q4_K_M", "Q8_0"], a.quantize_threads, env)
        (wd / "slice-q8_0-clover-gguf.gguf").unlink()
        if not a.keep:
            bf16.unlink()
    vocab = bench_vocab(ckpt, q4, a.threads)
    from clover_gguf.config import CloverConfig

    res = bench_passes(q4, a.threads, a.rounds, CloverConfig.from_file(ckpt).vocab_size)
    mix = bundled_pass_mix(wd, a.threads, a.prompts)
    ratios = bench_mode_ratios(res, mix)
    mem = bench_memory(q4, a.threads, env)
    wall, cpu_end = time.perf_counter() - t_start, os.times()
    cpu = sum(getattr(cpu_end, f) - getattr(cpu_start, f) for f in ("user", "system", "children_user",
                                                                       "children_system"))
    summary = dict(convert=conv, quantize={k: {"predicted": v["predicted"], "from_config": v["from_config"],
                                               "rows": v["rows"]} for k, v in quant.items()},
                   vocab=vocab, passes=res, mode_ratios=ratios, memory=mem, wall_s=wall, cpu_s=cpu)
    (wd / "scale.json").write_text(json.dumps(summary, indent=1, default=float) + "\n")
    header(f"bench/scale.py: {wall / 60:.1f} min wall, {cpu / 60:.1f} min CPU (this process and its children); "
           f"figures in {wd / 'scale.json'}")
    if not a.keep and not a.reuse:
        shutil.rmtree(ckpt)
        q4.unlink()


if __name__ == "__main__":
    main()
