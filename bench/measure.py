"""Shared by the benches: wall time, CPU time and peak RSS of one command, page-cache warming, and the one counter of a
runtime's model passes (PassLog)."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

# Peak RSS must be read in a small launcher: a child forked straight from a large benchmark process reports that
# process's resident size as its own high-water mark, since Linux keeps it across fork and exec.
LAUNCHER = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL); "
            "u = resource.getrusage(resource.RUSAGE_CHILDREN); "
            "print('maxrss', u.ru_maxrss, u.ru_utime + u.ru_stime, file=sys.stderr); "
            "sys.exit(r.returncode)")


@dataclass(frozen=True)
class Measured:
    wall: float  # seconds
    cpu: float  # user + system seconds of the command and its children: on a shared machine the steadier figure
    rss: int  # peak resident bytes


def measure(cmd: list[str], env: dict | None = None) -> Measured:
    """Run one command; exits with its stderr tail if it fails."""
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", LAUNCHER, *cmd], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{p.stderr[-2000:]}")
    _, rss_kib, cpu = [ln for ln in p.stderr.splitlines() if ln.startswith("maxrss ")][-1].split()
    return Measured(wall, float(cpu), int(rss_kib) * 1024)


def run_measured(cmd: list[str], env: dict | None = None) -> tuple[float, int]:
    """-> (wall seconds, peak RSS bytes) of one command; exits with its stderr tail if it fails."""
    m = measure(cmd, env)
    return m.wall, m.rss


def warm(path: Path) -> int:
    """Read a file, or every file of a folder, so the runs that follow read from the page cache."""
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(64 << 20):
                total += len(chunk)
    return total


@dataclass
class Pass:
    """One model pass of a runtime: its kind, the llama_decode calls in it (tokens, seconds inside llama_decode) and
    its wall time. Times exclude the passes nested in it (a rollback settled inside a commit)."""

    mode: str
    kind: str
    seconds: float = 0.0
    decode_seconds: float = 0.0
    tokens: int = 0
    decodes: int = 0
    start: float = 0.0  # time.perf_counter() when it began (bench/host.py's pass-to-pass intervals)


class PassLog:
    """Every model pass a CloverRuntime's backend makes, the one pass counter of the benches (bench/scale.py's pass
    mix, bench/device's ms per kind, bench/host.py's host share). Kinds: prompt, block, rollback, and a causal pass
    named by the decoding mode (`mode`: "AR step" in ar, "commit" in diffusion, "verify" in draft-self). Each pass
    ends with llama_synchronize, so a GPU's queued work counts in it; each llama_decode inside is timed (with its
    synchronize) too. The backend's methods are wrapped on the instance; close() unwraps them."""

    KIND_OF = {"prefill": "prompt", "prefill_rows": "prompt", "commit": "commit", "commit_rows": "commit",
               "block_logits": "block", "block_rows": "block", "_apply_rollback": "rollback"}
    CAUSAL = {"ar": "AR step", "diffusion": "commit", "draft-self": "verify"}

    def __init__(self, rt):
        self.rt, self.mode = rt, "ar"
        self.passes: list[Pass] = []
        self._open: list[Pass] = []
        b, ctx = rt.backend, rt.ctx
        self._L = ctx.L
        self._wrapped = [m for m in self.KIND_OF if callable(getattr(b, m, None))]
        for method in self._wrapped:
            setattr(b, method, self._wrap(method, getattr(b, method)))
        if hasattr(self._L, "llama_decode"):  # llama.cpp's own call, timed through a copy of the binding's namespace
            proxy = SimpleNamespace(**{k: getattr(self._L, k) for k in dir(self._L) if not k.startswith("__")})
            proxy.llama_decode = self._timed_decode(self._L.llama_decode, self._L.llama_synchronize)
            ctx.L = proxy

    def _kind(self, method: str) -> str:
        kind = self.KIND_OF[method]
        return self.CAUSAL[self.mode] if kind == "commit" else kind

    def _wrap(self, method, fn):
        L, ctx = self._L, self.rt.ctx

        def timed(*args, **kw):
            p = Pass(self.mode, self._kind(method))
            self._open.append(p)
            t0 = p.start = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                L.llama_synchronize(ctx.ctx)
                p.seconds += time.perf_counter() - t0
                self._open.pop()
                if self._open:  # the enclosing pass's own time excludes this one
                    self._open[-1].seconds -= p.seconds
                self.passes.append(p)
        return timed

    def _timed_decode(self, decode, synchronize):
        def timed(ctx, batch):
            t0 = time.perf_counter()
            rc = decode(ctx, batch)
            synchronize(ctx)
            if self._open:
                p = self._open[-1]
                p.decode_seconds += time.perf_counter() - t0
                p.tokens += int(batch.n_tokens)
                p.decodes += 1
            return rc
        return timed

    def clear(self) -> None:
        self.passes.clear()

    def of(self, mode: str | None = None, kind: str | None = None) -> list[Pass]:
        return [p for p in self.passes if (mode is None or p.mode == mode) and (kind is None or p.kind == kind)]

    def close(self) -> None:
        for method in self._wrapped:
            delattr(self.rt.backend, method)
        self.rt.ctx.L = self._L


# ---- arguments: a bad value is argparse's one error line and exit 2, never a traceback minutes later -------------
def at_least(low: int):
    """An argparse type: an integer >= low."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {n}")
        return n

    parse.__name__ = f"integer >= {low}"
    return parse


def int_list(low: int):
    """An argparse type: one or more comma-separated integers, each >= low."""
    one = at_least(low)

    def parse(text: str) -> list[int]:
        items = [x.strip() for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("give one or more comma-separated integers")
        return [one(x) for x in items]

    parse.__name__ = f"list of integers >= {low}"
    return parse
