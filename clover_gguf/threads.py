"""CPU threads: how many llama.cpp computes a pass with, and how its threads wait (docs/runtime.md, "Threads on a
busy machine").

ggml's CPU backend splits every node of a graph over its threads and has them meet at a barrier after each node
(hundreds a pass). When another program holds a core, the thread there is descheduled and every node waits for it,
and a thread that spins while it waits burns the time slice its partner needs: on a 2-core machine with two busy
processes, two spinning threads answered at 0.001x to 0.1x of their idle speed. Two settings decide it:

* threads: llama.cpp's own rule is the math cores (physical cores, hyperthreads left out); clover-gguf takes them
  up to MAX_DEFAULT_THREADS, and one thread for a model whose weights per layer are under SMALL_LAYER_BYTES: its
  nodes are a few microseconds of work, as long as a sleeping thread takes to wake at a barrier, so one thread is as
  fast (the bundled model, 1.2 MiB a layer: an AR step 0.33 ms on one thread, 0.83 on two that sleep at barriers,
  0.31-0.35 on two that spin) and has no barrier to stall at. The widths decide, not the name.
* poll, 0-100 (llama.cpp's `--poll`): how long a waiting thread spins before it sleeps. ggml's own threadpool reads
  it (`ggml_threadpool_params.poll`; the context attaches one with `llama_attach_threadpool`). A build with OpenMP
  (the usual Linux build; llama_print_system_info says `OPENMP = 1`) waits in libgomp instead, which ignores that
  field and spins GOMP_SPINCOUNT times: this module sets GOMP_SPINCOUNT = poll x SPINS_PER_POLL before the library
  loads (poll 50 is then libgomp's own default, 300,000 spins), so --poll means the same on both. The default,
  POLL_DEFAULT = 0, sleeps at once: a sleeping thread frees its core, which the kernel then gives to the thread
  everyone waits for. Measured with bench/contention.py (the table in docs/runtime.md).

An explicit --poll wins over the environment; without it, OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment are
the user's and are kept. libgomp reads them once per process, when it loads: a later runtime in the same process with
another --poll gets the first one's waiting (`Threading.describe` says so).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clover_gguf.offload import MAX_THREADS, check_poll

POLL_DEFAULT = 0  # sleep at once (bench/contention.py: the only setting that never stalled under load)
SPINS_PER_POLL = 6000  # GOMP_SPINCOUNT per poll level: 50 -> 300,000, libgomp's default
SMALL_LAYER_BYTES = 8 * 2**20  # weights per layer under this run on one thread (bundled 1.2 MiB, slice35b 53 MiB)
MAX_DEFAULT_THREADS = 8  # the default's cap (more threads than this only help a CPU with the bandwidth for them)
GOMP_ENV = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
# why, as fit --measure and doctor say it: a sleeping thread frees its core for the thread the others wait for
DEFAULT_WHY = ("default: a waiting thread sleeps at once, leaving its core to the thread it waits for"
               if POLL_DEFAULT == 0 else "default: a waiting thread spins a while")

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
    else:
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
        n = (f"{self.n_threads} thread{'s' * (self.n_threads > 1)}" if self.n_threads == self.n_threads_batch else
             f"{self.n_threads} thread(s) for one-token passes, {self.n_threads_batch} for larger ones")
        poll = "as the environment says" if self.poll is None else self.poll
        return f"{n} ({self.why_threads}); poll {poll} ({self.why_poll})"

    def to_json(self) -> dict:
        return {"n_threads": self.n_threads, "n_threads_batch": self.n_threads_batch, "poll": self.poll,
                "why_threads": self.why_threads, "why_poll": self.why_poll, "openmp": self.openmp}


def default_threads(model_bytes: int, n_layer: int, cores: int | None = None) -> tuple[int, str]:
    """-> (threads, why) for a model of `model_bytes` of weights in `n_layer` layers on this machine (see the module
    docstring)."""
    cores = math_cores() if cores is None else cores
    per_layer = model_bytes / max(1, n_layer)
    if per_layer < SMALL_LAYER_BYTES:
        return 1, (f"default: {per_layer / 2**20:.1f} MiB of weights per layer, under {SMALL_LAYER_BYTES >> 20} MiB: "
                   "too little work per node to split")
    n = max(1, min(MAX_DEFAULT_THREADS, cores))
    capped = f", at most {MAX_DEFAULT_THREADS}" if cores > MAX_DEFAULT_THREADS else ""
    return n, f"default: this machine's {cores} math core{'s' * (cores > 1)}{capped}"


def summary(openmp: bool | None) -> dict:
    """This machine's defaults, for `doctor` (the model decides between the two counts: fit --measure says which):
    {"math_cores", "threads", "poll", "openmp"} with "threads" and "poll" as sentences."""
    cores = math_cores()
    big, _ = default_threads(SMALL_LAYER_BYTES, 1, cores)
    level, source = _loaded or (POLL_DEFAULT, DEFAULT_WHY)
    how = ("OpenMP build: libgomp waits, GOMP_SPINCOUNT=" + os.environ.get("GOMP_SPINCOUNT", "unset") if openmp else
           "ggml's threadpool" if openmp is not None else "the library was not loaded")
    return {"math_cores": cores, "openmp": openmp,
            "threads": f"1 for a model of small layers (under {SMALL_LAYER_BYTES >> 20} MiB of weights each), else "
                       f"{big} (this machine's {cores} math core{'s' * (cores > 1)}, at most {MAX_DEFAULT_THREADS}); "
                       "--threads sets it",
            "poll": f"{'as the environment says' if level is None else level} ({source}; {how}); --poll sets it"}


def choose(model_bytes: int, n_layer: int, n_threads: int | None = None, n_threads_batch: int | None = None,
           poll: int | None = None, openmp: bool = False) -> Threading:
    """The threads (given, else default_threads) and the poll level for one context. With OpenMP the waiting in
    effect is the one libgomp loaded with (prepare_wait), whatever this context asks for; poll None there: the
    environment's OMP_WAIT_POLICY / GOMP_SPINCOUNT."""
    check_poll(poll)
    if n_threads:
        threads, why = n_threads, "--threads"
    else:
        threads, why = default_threads(model_bytes, n_layer)
    if openmp:
        level, source = _loaded or (None, "libgomp not loaded by clover-gguf")
        if poll is not None and level != poll:
            source = f"--poll {poll} asked, but libgomp reads its waiting once per process: {source}"
        why_poll = f"{source}; OpenMP build: libgomp waits, GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', 'unset')}"
    else:
        level = POLL_DEFAULT if poll is None else poll
        why_poll = ("--poll" if poll is not None else DEFAULT_WHY) + "; ggml's threadpool"
    return Threading(threads, n_threads_batch or threads, level, why, why_poll, openmp)


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
