"""Shared by the benches: wall time, CPU time and peak RSS of one command, and page-cache warming."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

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
