"""What a new user waits for: `make demo` on a fresh clone and home, `make demo` again, `make test-fast`, `make test`,
timed in a scratch clone of this checkout, each figure kept with its date, machine and the machine's load.

    python bench/first_use.py --runs demo-fresh-home,demo-again,test-fast   # time them, add them to the record
    python bench/first_use.py --runs demo-fresh-clone,demo-again            # llama.cpp from your cache (~/.cache)
    python bench/first_use.py --readme                                     # write the record's table into README.md
    python bench/first_use.py --table                                      # print that table

Runs, in the order given, in one scratch clone (`git clone` of this checkout's HEAD, so uncommitted changes are not
in it):
  demo-fresh-home   `make demo` with HOME and the caches in a new empty folder: Python packages downloaded and
                    installed into a new .venv, the llama.cpp source downloaded and built;
  demo-fresh-clone  `make demo` in the new clone with your own home: a new .venv, llama.cpp from your cache;
  demo-again        `make demo` once more in the same clone (the .venv and the build there already);
  test-fast, test   `make test-fast`, `make test` in the clone (the .venv gets the test extra first).
Each run records its wall time, its CPU time (user + system of every process it ran: make waits for all of them),
llama.cpp's build seconds when it built, pytest's summary for the tests, the 1-minute load average sampled every 5 s
(at the start, mean, highest), the date, the machine (CPU model, cores, memory, OS) and the commit. Wall time
depends mostly on what else runs on the machine; CPU time hardly does. The record (bench/first_use.json) is a list
of such rows, also rows taken from reports (their `source` says which); the README's table of times shows the latest
row of each run, between its markers (`--readme`), and tests/test_first_use.py checks that they agree.

Nothing here asserts on time: the figures are recorded, with the load they were measured under.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "bench" / "first_use.json"
README = ROOT / "README.md"
BEGIN = "<!-- figures: bench/first_use.py --readme writes this table from bench/first_use.json -->"
END = "<!-- end of figures -->"

# run -> (the make target, what the README's table calls it)
RUNS = {
    "demo-fresh-home": ("demo", "first `make demo`, fresh clone and home"),
    "demo-fresh-clone": ("demo", "first `make demo` in a fresh clone (llama.cpp cached)"),
    "demo-again": ("demo", "`make demo` again"),
    "test-fast": ("test-fast", "`make test-fast`"),
    "test": ("test", "`make test`"),
}


# ---- the machine ------------------------------------------------------------------------------------------------
def machine() -> str:
    """'Intel(R) Xeon(R) Processor, 2 cores, 31 GiB, Linux 6.1': what the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        mem_s = f", {mem:.0f} GiB"
    except (ValueError, OSError, AttributeError):
        mem_s = ""
    return f"{cpu}, {os.cpu_count()} cores{mem_s}, {platform.system()} {platform.release().split('-')[0]}"


class LoadSampler:
    """The 1-minute load average every `every` seconds while a run goes on, on a thread of its own."""

    def __init__(self, every: float = 5.0):
        self.every, self.samples = every, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> float | None:
        try:
            return float(Path("/proc/loadavg").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return os.getloadavg()[0] if hasattr(os, "getloadavg") else None

    def _run(self) -> None:
        while True:
            value = self.now()
            if value is not None:
                self.samples.append(value)
            if self._stop.wait(self.every):
                return

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, float] | None:
        if not self.samples:
            return None
        return {"start": self.samples[0], "mean": round(sum(self.samples) / len(self.samples), 2),
                "max": max(self.samples)}


# ---- one run ----------------------------------------------------------------------------------------------------
BUILT_RE = re.compile(r"llama\.cpp \(\w+\) built in (\d+) s")
PYTEST_RE = re.compile(r"=+ (.*(?:passed|failed|error).*) in [\d.]+s")


def timed(cmd: list[str], cwd: Path, env: dict[str, str], log: Path) -> dict:
    """Run `cmd`, its output appended to `log` -> wall and CPU seconds (every process it waited for), exit code,
    the load while it ran, and what its output says (llama.cpp's build seconds, pytest's summary)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    with LoadSampler() as load, open(log, "ab") as out:
        p = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    wall = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    text = log.read_text(errors="replace")
    built = BUILT_RE.findall(text)
    tests = PYTEST_RE.findall(text)
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "exit_code": p.returncode, "load": load.summary(),
            "build_s": int(built[-1]) if built else None, "result": tests[-1] if tests else None}


def run_all(names: list[str], keep: bool = False) -> list[dict]:
    """Time the runs in one scratch clone of HEAD -> their record rows."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    scratch = Path(tempfile.mkdtemp(prefix="clover-first-use-"))
    clone, home = scratch / "clover-gguf", scratch / "home"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    home.mkdir()
    rows, demo_done = [], False
    try:
        for name in names:
            target, _ = RUNS[name]
            env = dict(os.environ)
            for var in ("VIRTUAL_ENV", "PYTHONPATH", "CLOVER_GGUF_CACHE_DIR", "LLAMA_CPP_LIB_PATH"):
                env.pop(var, None)  # what the user's shell may set: a new user's has none of it
            if name == "demo-fresh-home":
                env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), PIP_CACHE_DIR=str(home / ".cache/pip"))
            if name == "demo-again" and not demo_done:  # "again" needs a first one, not recorded
                timed(["make", target], clone, env, scratch / "warm-up.log")
            log = scratch / f"{name}.log"
            print(f"first_use: {name}: make {target} in {clone} ...", flush=True)
            res = timed(["make", target], clone, env, log)
            demo_done |= target == "demo" and res["exit_code"] == 0
            row = {"run": name, "command": f"make {target}", **res, "date": dt.date.today().isoformat(),
                   "machine": machine(), "commit": commit, "source": "bench/first_use.py"}
            print(f"first_use: {name}: {json.dumps(row)}", flush=True)
            if res["exit_code"] != 0:
                print(f"first_use: {name} failed (exit code {res['exit_code']}): see {log}", file=sys.stderr)
            rows.append(row)
    finally:
        if keep:
            print(f"first_use: scratch kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    return rows


# ---- the record and the README's table ---------------------------------------------------------------------------
def load_record(path: Path = RECORD) -> list[dict]:
    return json.loads(path.read_text())["runs"] if path.is_file() else []


def save_record(rows: list[dict], path: Path = RECORD) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"runs": rows}, indent=1) + "\n")
    tmp.replace(path)


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    m, s = divmod(seconds, 60)
    return f"{m} min {s:02d} s"


def _measured(row: dict) -> str:
    parts = [f"{_duration(row['wall_s'])} wall"]
    if row.get("cpu_s") is not None:
        parts.append(f"{row['cpu_s'] / 60:.1f} CPU-minutes" if row["cpu_s"] >= 60 else f"{row['cpu_s']:.0f} CPU-s")
    if row.get("build_s") is not None:
        parts.append(f"llama.cpp's build {row['build_s']} s of it")
    if row.get("result"):
        parts.append(row["result"])
    if row.get("exit_code"):
        parts.append(f"exit code {row['exit_code']}")
    return ", ".join(parts)


def _when(row: dict) -> str:
    load = row.get("load") or {}
    if "mean" in load:
        how = f"load average {load['start']:.1f} at the start, {load['mean']:.1f} mean, {load['max']:.1f} at most"
    else:
        how = f"load average {load['range']}" if "range" in load else "load not recorded"
    src = "" if row.get("source") == "bench/first_use.py" else f"; {row['source']}"
    return f"{row['date']}, {how}{src}"


def latest(rows: list[dict]) -> list[dict]:
    """The latest row of each run (by date; the record's order within a date), in RUNS' order: what the README shows
    (the record keeps every measurement)."""
    last: dict[str, dict] = {}
    for r in rows:
        if r["run"] not in last or r["date"] >= last[r["run"]]["date"]:
            last[r["run"]] = r
    return [last[name] for name in RUNS if name in last]


def render(rows: list[dict]) -> str:
    """The README's table: the latest row of each run (latest), in RUNS' order."""
    rows = latest(rows)
    lines = ["| run | measured | when | machine |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {RUNS[r['run']][1]} | {_measured(r)} | {_when(r)} | {r['machine']} |")
    return "\n".join(lines)


def readme_table(text: str) -> str:
    """The table between the README's markers."""
    start = text.index(BEGIN) + len(BEGIN)
    return text[start:text.index(END, start)].strip("\n")


def write_readme(rows: list[dict], path: Path = README) -> None:
    text = path.read_text()
    start = text.index(BEGIN) + len(BEGIN)
    end = text.index(END, start)
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text(text[:start] + "\n" + render(rows) + "\n" + text[end:])
    tmp.replace(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", help=f"comma-separated, from: {', '.join(RUNS)}")
    ap.add_argument("--record", type=Path, default=RECORD, help="the record to add the rows to")
    ap.add_argument("--no-record", action="store_true", help="print the rows only")
    ap.add_argument("--keep", action="store_true", help="keep the scratch clone and its logs")
    ap.add_argument("--note", help="said with the rows in the table (e.g. 'under nice, beside other jobs')")
    ap.add_argument("--readme", action="store_true", help="write the record's table into README.md")
    ap.add_argument("--table", action="store_true", help="print the record's table")
    a = ap.parse_args()
    if a.runs:
        names = [n.strip() for n in a.runs.split(",") if n.strip()]
        if bad := [n for n in names if n not in RUNS]:
            ap.error(f"unknown run(s) {', '.join(bad)}: choose from {', '.join(RUNS)}")
        rows = run_all(names, keep=a.keep)
        for row in rows:
            row["source"] += f"; {a.note}" if a.note else ""
        if not a.no_record:
            save_record(load_record(a.record) + rows, a.record)
    if a.readme:
        write_readme(load_record(a.record))
    if a.table or not (a.runs or a.readme):
        print(render(load_record(a.record)))


if __name__ == "__main__":
    main()
