"""CPU threads and their waiting (clover_gguf.threads, issue 50): the default thread rule from the model's widths,
the poll level reaching libgomp before it loads, ggml's threadpool parameters as the library lays them out, and the
same greedy text whatever the setting."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

from clover_gguf.errors import UserError
from clover_gguf.offload import Offload
from clover_gguf.threads import (MAX_DEFAULT_THREADS, SMALL_LAYER_BYTES, SPINS_PER_POLL, choose, default_threads,
                                 math_cores)

MiB = 2**20


@pytest.mark.parametrize("per_layer,layers,cores,want", [
    (1.2 * MiB, 4, 2, (1, 2)),  # the bundled model: one thread for one-token passes, the cores for larger ones
    (SMALL_LAYER_BYTES - 1, 40, 16, (1, MAX_DEFAULT_THREADS)),
    (1.2 * MiB, 4, 1, (1, 1)),
    (53 * MiB, 4, 2, (2, 2)),  # the slice35b: every math core
    (540 * MiB, 40, 1, (1, 1)),  # the 35B on one core
    (540 * MiB, 40, 32, (MAX_DEFAULT_THREADS, MAX_DEFAULT_THREADS)),  # at most 8
])
def test_default_threads_follow_the_widths_and_the_cores(per_layer, layers, cores, want):
    n, nb, why = default_threads(int(per_layer * layers), layers, cores=cores)
    assert (n, nb) == want, why
    assert why.startswith("default: ")


def test_math_cores_count_this_machine():
    n = math_cores()
    assert 1 <= n <= (os.cpu_count() or 1)


def test_given_threads_and_poll_win_and_say_so():
    t = choose(10 * 2**30, 40, n_threads=3, poll=20)
    assert (t.n_threads, t.n_threads_batch, t.poll) == (3, 3, 20)
    assert t.describe().startswith("3 threads (--threads); poll 20 (--poll")


@pytest.mark.parametrize("bad", [-1, 101])
def test_poll_outside_0_to_100_is_one_line(bad):
    with pytest.raises(UserError, match=r"--poll must be 0\.\.100"):
        Offload(poll=bad)


def _fresh(code: str, env: dict[str, str]) -> dict:
    """Run `code` in a new interpreter (libgomp reads its waiting once per process) -> its JSON line."""
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**base, **env}, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


WAIT = """
import json, os
from clover_gguf.llama_context import load_binding
from clover_gguf.threads import wait_in_effect
load_binding({poll})
load_binding(99)  # a second call changes nothing: libgomp has loaded
print(json.dumps({{"env": os.environ.get("GOMP_SPINCOUNT"), "policy": os.environ.get("OMP_WAIT_POLICY"),
                  "effect": wait_in_effect()}}))
"""


@pytest.mark.parametrize("poll,env,want_env,want_effect", [
    (None, {}, None, [50, "default"]),  # the default: llama.cpp's, libgomp's own waiting (the environment untouched)
    (50, {}, str(50 * SPINS_PER_POLL), [50, "--poll"]),  # libgomp's own default spin count
    (None, {"OMP_WAIT_POLICY": "active"}, None, [None, "the environment's OMP_WAIT_POLICY=active"]),
    (7, {"GOMP_SPINCOUNT": "123"}, str(7 * SPINS_PER_POLL), [7, "--poll"]),  # an explicit --poll wins
])
def test_the_poll_level_is_set_before_libgomp_loads(poll, env, want_env, want_effect):
    got = _fresh(WAIT.format(poll=poll), env)
    assert got["env"] == want_env
    assert got["effect"][0] == want_effect[0] and got["effect"][1].startswith(want_effect[1])


def test_the_threadpool_parameters_are_laid_out_as_the_library_has_them():
    """ggml_threadpool_params as ggml fills it (ggml_threadpool_params_default) and as we read it: a wrong field size
    or order reads other bytes than these."""
    from clover_gguf.llama_context import load_binding
    from clover_gguf.threads import _threadpool_api

    lib = _threadpool_api(load_binding())
    p = lib.ggml_threadpool_params_default(7)
    assert (p.n_threads, p.prio, p.poll, p.strict_cpu, p.paused) == (7, 0, 50, False, False)
    assert not any(p.cpumask)
    lib.ggml_threadpool_params_init.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.ggml_threadpool_params_init(ctypes.byref(p), 3)
    assert (p.n_threads, p.poll) == (3, 50)


def test_greedy_text_is_the_same_whatever_the_threads(bundled_gguf):
    """The default (one thread for the bundled model's one-token passes, chosen from its widths) against two threads: the same tokens in
    every mode (the CPU backend splits a matrix product's rows between threads, each row's sum in one order; the
    poll level only changes how threads wait)."""
    from clover_gguf.runtime import CloverRuntime

    texts = []
    for kw in ({}, {"n_threads": 2, "n_threads_batch": 2}):
        rt = CloverRuntime(bundled_gguf, n_ctx=1024, **kw)
        try:
            t = rt.ctx.threading
            assert (t.n_threads, t.n_threads_batch) == ((2, 2) if kw else (1, min(MAX_DEFAULT_THREADS, math_cores())))
            assert kw or "(default: 1.2 MiB of weights per layer" in t.describe(), t.describe()
            texts.append([rt.generate(p, mode=m, max_new_tokens=40, think=False).raw
                          for p in ("What is 2 + 3?", "Reverse the word apple.") for m in ("ar", "diffusion", "auto")])
        finally:
            rt.close()
    assert texts[0] == texts[1]


@pytest.mark.parametrize("env,poll", [({}, "50 (default: a waiting thread spins a while, as llama.cpp's; threads "
                                           "drop to one while passes stall; OpenMP build: libgomp waits, its own "
                                           "default"),
                                      ({"OMP_WAIT_POLICY": "passive"},
                                       "as the environment says (the environment's OMP_WAIT_POLICY=passive")])
def test_doctor_says_the_defaults_and_where_the_waiting_comes_from(env, poll):
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    p = subprocess.run([sys.executable, "-m", "clover_gguf", "doctor", "--json"], capture_output=True, text=True,
                       env={**base, **env}, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    t = json.loads(p.stdout)["threads"]
    from clover_gguf.llama_context import load_binding
    from clover_gguf.threads import has_openmp

    assert t["math_cores"] == math_cores() and t["openmp"] == has_openmp(load_binding())  # llama_print_system_info
    assert t["threads"].startswith(f"{min(MAX_DEFAULT_THREADS, math_cores())} (this machine's ")
    assert "1 for the one-token passes of a model of small layers (under 8 MiB of weights each)" in t["threads"]
    assert t["poll"].startswith(poll), t["poll"]
