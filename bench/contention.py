"""Decoding speed when other programs share the cores: thread count and polling settings, with 0, 1 and 2 busy
processes beside the model (issue 50; the table in docs/runtime.md, "Threads on a busy machine").

    python bench/contention.py [--workdir out/bench-contention] [--runs 5] [--busy 0,1,2]
        [--settings before,after,1:50,2:0] [--models bundled,slice] [--slice PATH.gguf] [--before-tree DIR] [--json]
        [--no-llama-bench]

Models: (a) the bundled trained tiny Clover (F32 GGUF); (b) the slice35b (`make_tiny --preset slice35b`: the 35B's
layer widths, 3 GDN layers and one attention layer, here with --slice-experts experts and a --slice-vocab vocabulary,
quantized Q4_K_M; or --slice PATH).
Settings, each in a process of its own (libgomp reads how to wait once per process), held for the whole run:
  before    what clover-gguf did before issue 50: min(8, os.cpu_count()) threads, libgomp's own waiting (--poll 50
            is GOMP_SPINCOUNT 300,000, libgomp's default), no stall guard; with --before-tree DIR: that checkout's
            code itself (its defaults, its auto), run with no GOMP setting in the environment
  after     the runtime's defaults (clover_gguf.threads: poll 50 and the stall guard since issue 67)
  T:P       --threads T --poll P --no-stall-guard (a fixed setting)
  T:P:guard --threads T --poll P with the stall guard
Beside every busy level, llama-bench on the same file (tg of --max-new-tokens tokens at the `after` setting's
threads, its own waiting, -r 3): the peer's figure under the same load.
Busy processes: `python -c "while True: pass"`, as many as --busy says, started before the level's runs and stopped
after them, at the bench's own priority. Per level, --runs rounds; each round runs every setting once, in a seeded
random order; a setting's round is one answer per prompt and pass kind:
  ar      greedy AR answers (--max-new-tokens)
  block   diffusion answers at threshold 0 (every block pass fills its whole block): block passes and their commits
  auto    greedy auto answers (auto against ar, and its text against ar's)
Each answer is a run: tok/s over the whole request. The table gives, per model, pass kind and setting, the median and
the worst run at each busy level, and the worst loaded run against the idle median and against its own prompt's
idle median (answers differ in length; a short one's tok/s is lower idle too). A round that has run longer than
--round-cap seconds starts no more answers (a stalled setting is reported with the answers it finished).
No asserts on timings: the figures are printed, ratios beside them.
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
BUNDLED = ROOT / "clover_gguf" / "assets" / "tiny-clover"
KINDS = ("ar", "block", "auto")
GOMP_ENV = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


# ---- the worker: one setting, one model, in its own process ------------------------------------------------------
def worker(a: argparse.Namespace) -> None:
    """Load the model with the setting, then answer a round per "run" line on stdin with one JSON line."""
    sys.path.insert(0, os.environ.get("CONTENTION_TREE", str(ROOT)))
    from clover_gguf.runtime import CloverRuntime

    kw = {}
    if a.threads:
        kw.update(n_threads=a.threads, n_threads_batch=a.threads)
    if a.poll is not None or a.no_stall_guard:
        from clover_gguf.offload import Offload

        kw["offload"] = Offload(poll=a.poll, stall_guard=not a.no_stall_guard)
    rt = CloverRuntime(a.gguf, n_ctx=1024, **kw)
    prompts = json.loads(a.prompt_json)
    kinds = a.kinds.split(",")
    threading = getattr(rt.ctx, "threading", None)
    if threading is not None:
        desc, n = threading.describe(), threading.n_threads
    else:  # a tree from before clover_gguf.threads: llama.cpp's thread count, libgomp's own waiting (no GOMP setting)
        n = int(rt.ctx.L.llama_n_threads(rt.ctx.ctx))
        desc = f"{n} thread{'s' * (n > 1)} (the tree's default); poll 50 (libgomp's own: 300,000 spins)"
    for kind in kinds:  # warm: a process's first passes of a kind build graphs and touch cold memory
        answer(rt, kind, prompts[0], 8)
    print(json.dumps({"ready": desc, "threads": n}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        t_round, out = time.perf_counter(), []
        for p in prompts:
            for kind in kinds:
                if time.perf_counter() - t_round > a.round_cap:
                    break
                t0 = time.perf_counter()
                text, tokens = answer(rt, kind, p, a.max_new_tokens)
                out.append({"kind": kind, "prompt": p, "tokens": tokens, "seconds": time.perf_counter() - t0,
                            "text": text})
        print(json.dumps({"runs": out}), flush=True)
    rt.close()


def answer(rt, kind: str, prompt: str, max_new: int) -> tuple[str, int]:
    if kind == "block":
        a = rt.generate(prompt, mode="diffusion", max_new_tokens=max_new, threshold=0.0, think=False)
    else:
        a = rt.generate(prompt, mode=kind, max_new_tokens=max_new, think=False)
    return a.raw, a.stats.generated_tokens


# ---- the parent ---------------------------------------------------------------------------------------------------
class Setting:
    def __init__(self, name: str, gguf: Path, prompts: list[str], kinds: list[str], max_new: int,
                 a: argparse.Namespace):
        args = [sys.executable, str(Path(__file__).resolve()), "--worker", "--gguf", str(gguf), "--prompt-json",
                json.dumps(prompts), "--kinds", ",".join(kinds), "--max-new-tokens", str(max_new),
                "--round-cap", str(a.round_cap)]
        env = {k: v for k, v in os.environ.items() if k not in GOMP_ENV}
        if name == "before" and a.before_tree:
            gguf = tree_gguf(gguf, a.before_tree)
            args[args.index("--gguf") + 1] = str(gguf)
            env["CONTENTION_TREE"] = str(a.before_tree)
            env["PYTHONPATH"] = os.pathsep.join([str(a.before_tree), env.get("PYTHONPATH", "")])
        elif name == "before":
            args += ["--threads", str(max(1, min(8, os.cpu_count() or 1))), "--poll", "50", "--no-stall-guard"]
        elif name != "after":
            t, p, *guard = name.split(":")
            args += ["--threads", t, "--poll", p] + ([] if guard == ["guard"] else ["--no-stall-guard"])
        self.name = name
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        ready = json.loads(self._line())
        self.desc, self.threads = ready["ready"], ready["threads"]

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"contention: the worker of setting {self.name} ended (exit {self.proc.wait()})")
        return line

    def run(self) -> list[dict]:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return json.loads(self._line())["runs"]

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def busy_processes(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "n/a"


def tree_gguf(gguf: Path, tree: Path) -> Path:
    """The model's GGUF as the tree before makes it: GGUF keys, config fields and the readings' names moved since
    (review round 3), and a tree reads what its own code writes. The bundled model: converted from the tree's own
    copy (F32); the slice: made by the tree's own make_tiny, convert and quantize from the same seed and shapes."""
    if gguf.name == "tiny-clover-f32.gguf":
        out = gguf.with_name("tiny-clover-f32-before.gguf")
        code = ("import sys; from pathlib import Path; from clover_gguf.convert import convert; "
                "convert(Path(sys.argv[1]), Path(sys.argv[2]), outtype='f32', quiet=True, force=True)")
        _in_tree(tree, code, tree / BUNDLED.relative_to(ROOT), out)
        return out
    if gguf.name.startswith("slice35b-e") and gguf.name.endswith("-q4_k_m.gguf"):
        experts, vocab = (int(x[1:]) for x in gguf.name.split("-")[1:3])
        return make_slice(gguf.parent, experts, vocab, tree)
    raise SystemExit(f"contention: --before-tree makes the bundled model and the slice, not {gguf.name}")


def _in_tree(tree: Path, code: str, *args: object) -> None:
    """Run `code` in a fresh interpreter on the checkout `tree`'s clover_gguf."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    subprocess.run([sys.executable, "-c", code, *(str(Path(x).resolve()) if isinstance(x, Path) else str(x)
                                                  for x in args)], env=env, check=True, cwd=str(tree))


def bench_model(label: str, gguf: Path, prompts: list[str], kinds: list[str], max_new: int,
                a: argparse.Namespace) -> dict:
    settings: list[Setting] = []
    results: dict[tuple[str, int, str], list[dict]] = {}
    peer: dict[int, float] = {}  # busy level -> llama-bench tg tok/s
    rng = random.Random(0)
    try:
        for name in a.settings:
            settings.append(Setting(name, gguf, prompts, kinds, max_new, a))
        threads = next((s.threads for s in settings if s.name == "after"), settings[0].threads)
        for busy in a.busy:
            procs = busy_processes(busy)
            try:
                time.sleep(0.5)
                for _ in range(a.runs):
                    order = list(settings)
                    rng.shuffle(order)
                    for s in order:
                        for r in s.run():
                            results.setdefault((s.name, busy, r["kind"]), []).append(r)
                if a.llama_bench:
                    peer[busy] = llama_bench_tg(gguf, threads, max_new)
            finally:
                stop(procs)
            print(f"  ({label}: {busy} busy done, load average {loadavg()})", flush=True)
    finally:
        for s in settings:
            s.close()
    out = report(label, gguf, settings, results, kinds, len(prompts), a)
    out["llama_bench_tg"] = {"threads": threads, "tok_s": peer}
    if peer:
        print(f"  {label}: llama-bench tg{max_new} at {threads} thread{'s' * (threads > 1)}: "
              + ", ".join(f"{b} busy {v:.1f} tok/s" for b, v in peer.items()))
    return out


def llama_bench_tg(gguf: Path, threads: int, n: int) -> float:
    """llama-bench's tg tok/s on `gguf` (its own waiting: no GOMP setting of ours in its environment), -r 3."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from host import llama_bench_runs

    saved = {k: os.environ.pop(k) for k in GOMP_ENV if k in os.environ}
    try:
        return float(llama_bench_runs(gguf, "-p", "0", "-n", str(n), "-t", str(threads), "-r", "3")[0]["avg_ts"])
    finally:
        os.environ.update(saved)


def rates(runs: list[dict]) -> list[float]:
    return [r["tokens"] / r["seconds"] for r in runs if r["seconds"] > 0 and r["tokens"]]


def worst_against_own_prompt(results: dict, setting: str, kind: str, a: argparse.Namespace) -> float | None:
    """The worst loaded answer against the idle median of the same prompt (same setting and pass kind). Prompts'
    answers differ in length, and a short answer spends more of its time in its prompt pass: the bundled model's idle
    answers alone span 0.4-1x their median tok/s, which the column against the overall idle median counts as a stall."""
    idle: dict[str, list[float]] = {}
    for r in results.get((setting, 0, kind), []):
        idle.setdefault(r["prompt"], []).extend(rates([r]))
    worst = [rate / statistics.median(idle[r["prompt"]])
             for b in a.busy if b > 0 for r in results.get((setting, b, kind), []) if idle.get(r["prompt"])
             for rate in rates([r])]
    return min(worst) if worst else None


def report(label: str, gguf: Path, settings: list[Setting], results: dict, kinds: list[str], n_prompts: int,
           a: argparse.Namespace) -> dict:
    rows = []
    for kind in kinds:
        for s in settings:
            figs = {}
            for b in a.busy:
                v = rates(results.get((s.name, b, kind), []))
                figs[b] = {"median": statistics.median(v) if v else None, "worst": min(v) if v else None,
                           "answers": len(v), "asked": a.runs * n_prompts}
            idle = figs.get(0, {}).get("median")
            loaded = [f["worst"] for b, f in figs.items() if b > 0 and f["worst"] is not None]
            rows.append({"kind": kind, "setting": s.name, "threading": s.desc, "by_busy": figs,
                         "worst_loaded_x_idle_median": min(loaded) / idle if idle and loaded else None,
                         "worst_loaded_x_prompt_idle_median": worst_against_own_prompt(results, s.name, kind, a)})
    out = {"model": label, "gguf": str(gguf), "rows": rows}
    if "auto" in kinds and "ar" in kinds:
        out["auto"] = auto_against_ar(settings, results, a)
    return out


def table(results: list[dict], a: argparse.Namespace) -> None:
    """One markdown table for every model: tok/s per answer, median (worst), per busy level."""
    head = ["model", "pass", "setting", "threads, poll"] + [f"{b} busy" for b in a.busy] + \
        ["worst loaded / idle median", "worst loaded / its prompt's idle median"]
    print("\n| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for res in results:
        for r in res["rows"]:
            cells = []
            for b in a.busy:
                f = r["by_busy"][b]
                cell = f"{f['median']:.1f} ({f['worst']:.1f})" if f["median"] is not None else "-"
                cells.append(cell + (f" [{f['answers']} of {f['asked']} answers]" if f["answers"] < f["asked"] else ""))
            ratios = [r["worst_loaded_x_idle_median"], r["worst_loaded_x_prompt_idle_median"]]
            desc = r["threading"]
            print(f"| {res['model']} | {r['kind']} | {r['setting']} | {desc.split(' (')[0]}, poll {_poll_of(desc)} | "
                  + " | ".join(cells + [f"{x:.3f}" if x is not None else "-" for x in ratios]) + " |")


def _poll_of(desc: str) -> str:
    return desc.split("; poll ")[1].split(" (")[0] if "; poll " in desc else "?"


def auto_against_ar(settings: list[Setting], results: dict, a: argparse.Namespace) -> dict:
    """Per setting and busy level: auto's median tok/s against ar's, and auto's text against ar's prompt by prompt."""
    out = {}
    print("auto against ar (medians over the same rounds), and auto's text against ar's:")
    for s in settings:
        for b in a.busy:
            ar, au = results.get((s.name, b, "ar"), []), results.get((s.name, b, "auto"), [])
            if not ar or not au:
                continue
            ratio = statistics.median(rates(au)) / statistics.median(rates(ar))
            texts = {r["prompt"]: r["text"] for r in ar}
            same = sum(texts.get(r["prompt"]) == r["text"] for r in au if r["prompt"] in texts)
            compared = sum(r["prompt"] in texts for r in au)
            out[f"{s.name}/{b}"] = {"auto_x_ar": ratio, "same_text": same, "compared": compared}
            print(f"  {s.name:<8} {b} busy: auto {ratio:.3f}x ar, text = ar's on {same}/{compared} answers")
    return out


def make_slice(wd: Path, experts: int, vocab: int, tree: Path = ROOT) -> Path:
    """The slice35b as `tree`'s code makes it (make_tiny's preset, seed 5; BF16, then Q4_K_M), made once."""
    tag = "" if tree == ROOT else "-before"
    q4 = wd / f"slice35b-e{experts}-v{vocab}-q4_k_m{tag}.gguf"
    if q4.is_file():
        return q4
    ckpt = wd / f"slice35b-e{experts}-v{vocab}{tag}"
    code = ("import sys; from pathlib import Path; from clover_gguf.convert import convert; "
            "from clover_gguf.quantize import quantize; from clover_gguf.testing.make_tiny import make_tiny; "
            "ckpt, q4, e, v = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]); "
            "bf16 = q4.with_name(q4.name.replace('q4_k_m', 'bf16')); "
            "make_tiny(ckpt, seed=5, preset='slice35b', num_experts=e, vocab_size=v, quiet=True); "
            "convert(ckpt, bf16, outtype='bf16', quiet=True, force=True); "
            "quantize(bf16, q4, 'Q4_K_M', quiet=True, force=True); bf16.unlink()")
    _in_tree(tree, code, ckpt, q4, experts, vocab)
    return q4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=ROOT / "out" / "bench-contention")
    ap.add_argument("--runs", type=int, default=5, help="rounds per busy level (each runs every setting once)")
    ap.add_argument("--busy", default="0,1,2", help="busy processes beside the model, a level per number")
    ap.add_argument("--settings", default="before,after,1:50,2:0",
                    help="before, after, THREADS:POLL or THREADS:POLL:guard")
    ap.add_argument("--models", default="bundled,slice")
    ap.add_argument("--prompts", type=int, default=4, help="bundled model: held-out prompts per round")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--slice", type=Path, help="a slice35b GGUF to use instead of making one")
    ap.add_argument("--slice-experts", type=int, default=16)
    ap.add_argument("--slice-vocab", type=int, default=1024)
    ap.add_argument("--slice-prompts", type=int, default=1)
    ap.add_argument("--slice-max-new-tokens", type=int, default=16)
    ap.add_argument("--round-cap", type=float, default=60.0, help="seconds after which a round starts no answer")
    ap.add_argument("--before-tree", type=Path, help="a checkout of the code before: `before` runs it")
    ap.add_argument("--json", action="store_true", help="print one JSON line with every figure at the end")
    ap.add_argument("--llama-bench", action=argparse.BooleanOptionalAction, default=True,
                    help="llama-bench's tg beside every busy level (default: on)")
    # the worker's own arguments
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--prompt-json", help=argparse.SUPPRESS)
    ap.add_argument("--kinds", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--poll", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--no-stall-guard", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    sys.path.insert(0, str(ROOT))
    sys.stdout.reconfigure(line_buffering=True)
    a.busy = [int(x) for x in a.busy.split(",")]
    a.settings = a.settings.split(",")
    a.workdir.mkdir(parents=True, exist_ok=True)
    evals = [json.loads(x) for x in (BUNDLED / "eval.jsonl").read_text().splitlines() if x.strip()]
    held = [e["prompt"] for e in evals]
    held = held[::max(1, len(held) // a.prompts)][:a.prompts]
    models = a.models.split(",")
    print(f"contention: {os.cpu_count()} CPUs, nice {os.nice(0)}, load average {loadavg()} at the start, "
          f"{time.strftime('%Y-%m-%d %H:%M')}; settings {', '.join(a.settings)}; busy levels {a.busy}")
    results = []
    if "bundled" in models:
        from clover_gguf.convert import convert

        gguf = a.workdir / "tiny-clover-f32.gguf"
        convert(BUNDLED, gguf, outtype="f32", quiet=True, force=True)
        results.append(bench_model("a: bundled", gguf, held, list(KINDS), a.max_new_tokens, a))
    if "slice" in models:
        gguf = a.slice or make_slice(a.workdir, a.slice_experts, a.slice_vocab)
        results.append(bench_model("b: slice35b", gguf, held[:a.slice_prompts], list(KINDS),
                                   a.slice_max_new_tokens, a))
    table(results, a)
    print(f"\nload average at the end: {loadavg()}")
    if a.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
