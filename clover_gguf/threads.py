"""CPU threads: how many llama.cpp computes a pass with, and how its threads wait (docs/runtime.md, "Threads on a
busy machine").

ggml's CPU backend splits every node of a graph over its threads and has them meet at a barrier after each node
(hundreds a pass). When another program holds a core, the thread there is descheduled and every node waits for it,
and a thread that spins while it waits burns the time slice its partner needs: on a 2-core machine with two busy
processes, two spinning threads answered at 0.001x to 0.1x of their idle speed. Two settings decide it:

* threads: llama.cpp's own rule is the math cores (physical cores, hyperthreads left out); clover-gguf takes them
  up to MAX_DEFAULT_THREADS, and for a model whose weights per layer are under SMALL_LAYER_BYTES its one-token passes
  (llama.cpp's n_threads; larger passes take n_threads_batch) run on one thread: their nodes are a few microseconds
  of work, so splitting them costs more than it saves (the bundled model, 1.2 MiB a layer, llama-bench idle: tg
  0.086 ms a token on one thread, 0.116 on two; pp32 1.40 ms on one, 0.83 on two). The widths decide, not the name.
* poll, 0-100 (llama.cpp's `--poll`): how long a waiting thread spins before it sleeps. ggml's own threadpool reads
  it (`ggml_threadpool_params.poll`; the context attaches one with `llama_attach_threadpool`). A build with OpenMP
  (the usual Linux build; llama_print_system_info says `OPENMP = 1`) waits in libgomp instead, which ignores that
  field and spins GOMP_SPINCOUNT times: this module sets GOMP_SPINCOUNT = poll x SPINS_PER_POLL before the library
  loads (poll 50 is then libgomp's own default, 300,000 spins), so --poll means the same on both. The default,
  POLL_DEFAULT = 50, is llama.cpp's: on an OpenMP build the environment is left alone and libgomp waits its own way
  (its default spin count, fewer when it has more threads than CPUs), exactly as llama.cpp's tools do. A spinning
  thread answers a barrier at once, which an idle machine needs (a sleeping one cost the 35B slice 0.71x of
  llama-bench's AR speed and the bundled model on two threads 21x); on a busy machine the stall guard below
  (StallGuard) drops the context to one thread while passes stall. Measured with bench/contention.py (the table in
  docs/runtime.md).

An explicit --poll wins over the environment; without it, OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment are
the user's and are kept. libgomp reads them once per process, when it loads: a later runtime in the same process with
another --poll gets the first one's waiting (`Threading.describe` says so).
"""

from __future__ import annotations

import ctypes
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clover_gguf.offload import MAX_THREADS, check_poll

POLL_DEFAULT = 50  # spin a while, as llama.cpp (ggml's default poll, libgomp's default spin count)
SPINS_PER_POLL = 6000  # GOMP_SPINCOUNT per poll level: 50 -> 300,000, libgomp's default
LIBGOMP_POLL = 50  # the poll level whose spin count is libgomp's own default: at it the environment is left alone
SMALL_LAYER_BYTES = 8 * 2**20  # weights per layer under this run on one thread (bundled 1.2 MiB, slice35b 53 MiB)
MAX_DEFAULT_THREADS = 8  # the default's cap (more threads than this only help a CPU with the bandwidth for them)
GOMP_ENV = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
# why, as fit --measure and doctor say it: a sleeping thread frees its core for the thread the others wait for
DEFAULT_WHY = ("default: a waiting thread sleeps at once, leaving its core to the thread it waits for"
               if POLL_DEFAULT == 0 else "default: a waiting thread spins a while, as llama.cpp's; threads drop to "
               "one while passes stall")

# how libgomp was told to wait when it loaded in this process: (poll or None, where it came from); None: not loaded
_loaded: tuple[int | None, str] | None = None


def math_cores() -> int:
    """Physical cores this process may run on: the CPUs of its affinity mask, hyperthread siblings counted once (as
    llama.cpp's cpu_get_num_math counts them on Linux; elsewhere, or when the topology cannot be read, os.cpu_count)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip())
        except OSError:
            return max(1, len(cpus))
    return max(1, len(cores))


def spin_count(poll: int) -> int:
    return int(poll) * SPINS_PER_POLL


def prepare_wait(poll: int | None) -> None:
    """Before libgomp loads (clover_gguf.llama_context.load_binding, once per process): set GOMP_SPINCOUNT from an
    explicit poll, else from POLL_DEFAULT unless the environment already says how to wait."""
    global _loaded
    if _loaded is not None:
        return
    check_poll(poll)
    if poll is not None:
        os.environ["GOMP_SPINCOUNT"] = str(spin_count(poll))
        _loaded = (poll, "--poll")
    elif any(k in os.environ for k in GOMP_ENV):
        _loaded = (None, "the environment's " + ", ".join(f"{k}={os.environ[k]}" for k in GOMP_ENV
                                                          if k in os.environ))
    else:  # libgomp's own waiting is LIBGOMP_POLL's: left to it, as llama.cpp's tools leave it
        if POLL_DEFAULT != LIBGOMP_POLL:
            os.environ["GOMP_SPINCOUNT"] = str(spin_count(POLL_DEFAULT))
        _loaded = (POLL_DEFAULT, DEFAULT_WHY)


def wait_in_effect() -> tuple[int | None, str] | None:
    """(poll, where it came from) of libgomp's waiting in this process; None before the library loaded."""
    return _loaded


@dataclass(frozen=True)
class Threading:
    """The threads and the waiting a context computes with, and why (fit --measure and doctor print it)."""

    n_threads: int
    n_threads_batch: int
    poll: int | None  # None: as the environment's OMP_WAIT_POLICY / GOMP_SPINCOUNT say (OpenMP)
    why_threads: str
    why_poll: str
    openmp: bool = False

    def describe(self) -> str:
        n = f"{self.n_threads} thread{'s' * (self.n_threads > 1)}"
        if self.n_threads != self.n_threads_batch:
            n += f" for one-token passes, {self.n_threads_batch} for larger ones"
        poll = "as the environment says" if self.poll is None else self.poll
        return f"{n} ({self.why_threads}); poll {poll} ({self.why_poll})"

    def to_json(self) -> dict:
        return {"n_threads": self.n_threads, "n_threads_batch": self.n_threads_batch, "poll": self.poll,
                "why_threads": self.why_threads, "why_poll": self.why_poll, "openmp": self.openmp}


def default_threads(model_bytes: int, n_layer: int, cores: int | None = None) -> tuple[int, int, str]:
    """-> (n_threads, n_threads_batch, why) for a model of `model_bytes` of weights in `n_layer` layers on this machine
    (see the module docstring): one-token passes of a model of small layers on one thread, every other pass on the
    math cores (up to MAX_DEFAULT_THREADS)."""
    cores = math_cores() if cores is None else cores
    per_layer = model_bytes / max(1, n_layer)
    n = max(1, min(MAX_DEFAULT_THREADS, cores))
    capped = f", at most {MAX_DEFAULT_THREADS}" if cores > MAX_DEFAULT_THREADS else ""
    cores_text = f"this machine's {cores} math core{'s' * (cores > 1)}{capped}"
    if per_layer < SMALL_LAYER_BYTES:
        return 1, n, (f"default: {per_layer / 2**20:.1f} MiB of weights per layer, under {SMALL_LAYER_BYTES >> 20} "
                      f"MiB: a one-token pass is too little work to split, larger ones take {cores_text}")
    return n, n, f"default: {cores_text}"


def _gomp_text() -> str:
    spins = os.environ.get("GOMP_SPINCOUNT")
    return "OpenMP build: libgomp waits, " + (f"GOMP_SPINCOUNT={spins}" if spins is not None else
                                              "its own default (300,000 spins, as llama.cpp's tools)")


def summary(openmp: bool | None) -> dict:
    """This machine's defaults, for `doctor` (the model decides between the two counts: fit --measure says which):
    {"math_cores", "threads", "poll", "openmp"} with "threads" and "poll" as sentences."""
    cores = math_cores()
    big, _, _ = default_threads(SMALL_LAYER_BYTES, 1, cores)
    level, source = _loaded or (POLL_DEFAULT, DEFAULT_WHY)
    how = (_gomp_text() if openmp else
           "ggml's threadpool" if openmp is not None else "the library was not loaded")
    return {"math_cores": cores, "openmp": openmp,
            "threads": f"{big} (this machine's {cores} math core{'s' * (cores > 1)}, at most {MAX_DEFAULT_THREADS}); "
                       f"1 for the one-token passes of a model of small layers (under {SMALL_LAYER_BYTES >> 20} MiB "
                       "of weights each); --threads sets both",
            "poll": f"{'as the environment says' if level is None else level} ({source}; {how}); --poll sets it"}


def choose(model_bytes: int, n_layer: int, n_threads: int | None = None, n_threads_batch: int | None = None,
           poll: int | None = None, openmp: bool = False) -> Threading:
    """The threads (given, else default_threads) and the poll level for one context. With OpenMP the waiting in
    effect is the one libgomp loaded with (prepare_wait), whatever this context asks for; poll None there: the
    environment's OMP_WAIT_POLICY / GOMP_SPINCOUNT."""
    check_poll(poll)
    if n_threads:
        threads, batch, why = n_threads, n_threads_batch or n_threads, "--threads"
    else:
        threads, batch, why = default_threads(model_bytes, n_layer)
        batch = n_threads_batch or batch
    if openmp:
        level, source = _loaded or (None, "libgomp not loaded by clover-gguf")
        if poll is not None and level != poll:
            source = f"--poll {poll} asked, but libgomp reads its waiting once per process: {source}"
        why_poll = f"{source}; {_gomp_text()}"
    else:
        level = POLL_DEFAULT if poll is None else poll
        why_poll = ("--poll" if poll is not None else DEFAULT_WHY) + "; ggml's threadpool"
    return Threading(threads, batch, level, why, why_poll, openmp)


# ---- ggml's threadpool, through ctypes on the loaded library (L: the llama_cpp binding) -----------------------
class _ThreadpoolParams(ctypes.Structure):
    """struct ggml_threadpool_params (ggml.h of the pinned tree; the cpumask is GGML_MAX_N_THREADS wide)."""

    _fields_ = [("cpumask", ctypes.c_bool * MAX_THREADS), ("n_threads", ctypes.c_int), ("prio", ctypes.c_int),
                ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool), ("paused", ctypes.c_bool)]


def _threadpool_api(L: Any) -> Any:
    """ggml's threadpool calls (ggml-cpu.h, ggml.h) and llama_attach_threadpool, which the binding does not declare."""
    lib = L.llama_cpp._lib
    lib.ggml_threadpool_params_default.argtypes, lib.ggml_threadpool_params_default.restype = [ctypes.c_int], \
        _ThreadpoolParams
    lib.ggml_threadpool_new.argtypes = [ctypes.POINTER(_ThreadpoolParams)]
    lib.ggml_threadpool_new.restype = ctypes.c_void_p
    lib.ggml_threadpool_free.argtypes, lib.ggml_threadpool_free.restype = [ctypes.c_void_p], None
    lib.llama_attach_threadpool.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.llama_attach_threadpool.restype = None
    return lib


def attach_threadpools(L: Any, ctx: Any, threading: Threading) -> list[int]:
    """ggml threadpools of the context's thread counts, polling at its level, attached to the context (one for both
    when the counts agree). Without them ggml makes a threadpool for every graph with its default poll (50); an
    OpenMP build takes its threads from libgomp either way, and its waiting from GOMP_SPINCOUNT (threads.py)."""
    lib = _threadpool_api(L)
    pools = []
    for n in dict.fromkeys((threading.n_threads, threading.n_threads_batch)):
        params = lib.ggml_threadpool_params_default(n)
        if threading.poll is not None:
            params.poll = threading.poll
        pool = lib.ggml_threadpool_new(ctypes.byref(params))
        if not pool:
            raise RuntimeError(f"ggml could not make a threadpool of {n} threads")
        pools.append(pool)
    lib.llama_attach_threadpool(ctx, pools[0], pools[-1])
    return pools


_OPENMP: bool | None = None


def has_openmp(L: Any) -> bool:
    """Whether the loaded ggml CPU backend was built with OpenMP (llama_print_system_info: `OPENMP = 1`)."""
    global _OPENMP
    if _OPENMP is None:
        _OPENMP = b"OPENMP = 1" in (L.llama_print_system_info() or b"")
    return _OPENMP


# ---- the stall guard: threads dropped to one while passes stall, probed back now and then --------------------------
STALL_FACTOR = 2.5  # a pass slower than this many times the fastest of its kind stalled (idle spread: under 1.5x)
STALL_WINDOW, STALL_COUNT = 8, 3  # this many stalled passes among the last STALL_WINDOW judged ones: threads drop
PROBE_S = 1.0  # seconds of passes on one thread before the full count is tried again; doubled after a failed probe,
PROBE_MAX_S = 64.0  # up to this
PROBE_JUDGE = 4  # a probe's passes (after its first, which wakes the threads) weighed against one thread's
PROBE_PASSES = 16  # judged passes a probe must hold without a drop to count as held (the next wait is PROBE_S again)
RECENT_ONE = 8  # one thread's last passes of a kind kept: their median is what a probe's pass is weighed against


def pass_kind(n_tokens: int, n_out: int, last_pos: int) -> tuple[int, int, int]:
    """A pass's kind for the guard: its rows, its output rows and its position's power of two (a pass further into
    the context reads more of the KV cache: within a power of two its cost grows by less than the stall factor)."""
    return int(n_tokens), int(n_out), int(last_pos).bit_length()


class StallGuard:
    """Acts on contention the runtime measures itself (docs/runtime.md, "Threads on a busy machine"). Spinning threads
    (the default, as llama.cpp's) are fastest on an idle machine, but when another program holds a core a thread there
    is descheduled and its partners spin at every barrier of the pass. So every pass's llama_decode time is compared
    with the fastest pass of its kind at the same thread count (a kind that runs on one thread at the full counts
    too, such as a small model's one-token passes, is not judged): STALL_COUNT stalled passes (over STALL_FACTOR x) in
    the last STALL_WINDOW drop the context to one thread (`set_threads(1, 1)`: one thread has no barrier to wait at,
    and spinning then costs nothing). After PROBE_S seconds of passes on one thread the full counts come back (a
    probe): its first pass wakes the other threads and is not judged; if its next PROBE_JUDGE passes took longer
    together than one thread's recent passes of the same kinds (the median of each kind's last RECENT_ONE), or it
    stalls as above, the threads drop again and the wait doubles (up to PROBE_MAX_S); a probe that holds
    PROBE_PASSES judged passes resets it. The guard reads no clock: `record` takes each pass's measured seconds, so
    it decides the same on the same pass times (tests/test_stall_guard.py drives it with made-up ones)."""

    def __init__(self, n_threads: int, n_threads_batch: int, set_threads: Any, on: bool = True):
        self.full = (int(n_threads), int(n_threads_batch))
        self.set_threads = set_threads  # (n_threads, n_threads_batch) -> None: llama_set_n_threads on the context
        self.on = on  # Offload.stall_guard
        self.active = on and max(self.full) > 1  # nothing to drop to on one thread
        self.dropped = False
        self.fastest: dict[tuple, float] = {}  # kind -> the fastest pass's seconds at the full counts
        self.one: dict[tuple, list[float]] = {}  # kind -> one thread's last RECENT_ONE passes' seconds
        self.recent: list[bool] = []  # stalled or not, the last STALL_WINDOW judged passes at the full counts
        self.wait_s = PROBE_S  # seconds on one thread before the next probe
        self.waited_s = 0.0
        self.probing = 0  # passes since a probe restored the full counts (0: not probing)
        self.weighed = [0.0, 0.0]  # a probe's judged passes: their seconds, one thread's for the same kinds
        self.passes = 0
        self.stalled = 0  # stalled passes, all told
        self.drops = 0
        self.probes = 0
        self.events: list[str] = []  # what the guard did, in order ("threads 2->1 after 3 stalled passes of 8")

    def threads(self) -> tuple[int, int]:
        """(n_threads, n_threads_batch) in effect now."""
        return (1, 1) if self.dropped else self.full

    def record(self, kind: tuple, seconds: float) -> None:
        """One pass of `kind` (pass_kind) took `seconds` of llama_decode: judge it, and drop or restore the threads."""
        if not self.active:
            return
        self.passes += 1
        if self.dropped:
            self.one[kind] = (self.one.get(kind, []) + [seconds])[-RECENT_ONE:]
            self.waited_s += seconds
            if self.waited_s >= self.wait_s:
                self._restore()
            return
        if (self.full[0] if kind[0] == 1 else self.full[1]) == 1:  # on one thread either way: dropping cannot help
            return
        if self.probing:
            self.probing += 1
            if self.probing == 2:  # the probe's first pass woke the other threads: not judged, not a bar
                return
        best = self.fastest.get(kind)
        self.fastest[kind] = seconds if best is None else min(best, seconds)
        if best is None:  # the first of its kind sets the bar, unjudged
            return
        stalled = seconds > STALL_FACTOR * best
        self.stalled += stalled
        self.recent = (self.recent + [stalled])[-STALL_WINDOW:]
        if sum(self.recent) >= STALL_COUNT:
            return self._drop(f"after {sum(self.recent)} stalled passes of the last {STALL_WINDOW}")
        if not self.probing:
            return
        judged = self.probing - 2
        if judged <= PROBE_JUDGE:
            ones = self.one.get(kind)
            self.weighed[0] += seconds
            self.weighed[1] += statistics.median(ones) if ones else seconds
            if judged == PROBE_JUDGE and self.weighed[0] > self.weighed[1]:
                t, o = self.weighed
                return self._drop(f"after a probe: {PROBE_JUDGE} passes took {1e3 * t:.1f} ms, one thread "
                                  f"{1e3 * o:.1f} ms")
        elif judged > PROBE_PASSES:  # the probe held: the machine is free again
            self.probing, self.wait_s = 0, PROBE_S
            self.events.append(f"threads {self._full_text()} held after a probe")

    def _full_text(self) -> str:
        a, b = self.full
        return str(a) if a == b else f"{a}/{b}"

    def _drop(self, why: str) -> None:
        if self.probing:  # the probe lost: wait longer before the next
            self.wait_s = min(PROBE_MAX_S, self.wait_s * 2)
        self.dropped, self.recent, self.probing, self.waited_s = True, [], 0, 0.0
        self.drops += 1
        self.set_threads(1, 1)
        self.events.append(f"threads {self._full_text()}->1 {why}")

    def _restore(self) -> None:
        self.dropped, self.recent, self.probing, self.weighed = False, [], 1, [0.0, 0.0]
        self.probes += 1
        self.set_threads(*self.full)
        self.events.append(f"threads 1->{self._full_text()} (probe after {self.waited_s:.1f} s on one thread)")

    def since(self, mark: int) -> str | None:
        """What the guard did after its first `mark` events (a run's stats: mark = len(events) at its start)."""
        new = self.events[mark:]
        if not new:
            return None
        if len(new) > 4:  # a long run under load: the first and the last two, and how many between
            new = [new[0], f"{len(new) - 3} more", *new[-2:]]
        return "; ".join(new)

    def describe(self) -> str:
        """The guard's state in one line (fit --measure, doctor's Threading.describe, /metrics' help)."""
        if not self.active:
            return "stall guard off" + ("" if not self.on else " (one thread: no barrier to stall at)")
        now = "on one thread (dropped)" if self.dropped else f"on {self._full_text()} threads"
        return (f"stall guard: {now}; {self.stalled} stalled of {self.passes} passes, {self.drops} drop"
                f"{'s' * (self.drops != 1)}, {self.probes} probe{'s' * (self.probes != 1)}")
