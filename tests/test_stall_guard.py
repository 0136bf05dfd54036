"""The stall guard (clover_gguf.threads.StallGuard, issue 67) on made-up pass times: no clock is read, so what it
decides depends only on the seconds it is given. Stalls are detected against the fastest pass of the same kind,
repeated stalls drop the threads to one, a probe brings them back after enough seconds on one thread, a probe that
stalls again waits twice as long, and one that holds resets the wait."""

from __future__ import annotations

from clover_gguf.threads import (PROBE_JUDGE, PROBE_MAX_S, PROBE_PASSES, PROBE_S, STALL_COUNT, STALL_FACTOR,
                                 STALL_WINDOW, StallGuard, pass_kind)

AR, BLOCK = pass_kind(1, 1, 100), pass_kind(32, 32, 100)


def _guard(n=2, nb=2):
    calls = []
    return StallGuard(n, nb, lambda a, b: calls.append((a, b))), calls


def test_steady_passes_never_drop():
    g, calls = _guard()
    for i in range(500):  # an idle machine's spread: within 1.5x of the fastest, both kinds interleaved
        g.record(AR, 1e-3 * (1 + 0.5 * (i % 3) / 2))
        g.record(BLOCK, 8e-3 * (1 + 0.4 * (i % 5) / 4))
    assert calls == [] and g.drops == 0 and g.stalled == 0 and g.threads() == (2, 2)


def test_repeated_stalls_drop_to_one_thread_and_say_so():
    g, calls = _guard(4, 8)
    g.record(AR, 1e-3)
    for _ in range(STALL_COUNT - 1):
        g.record(AR, 1e-3 * (STALL_FACTOR + 0.5))
        g.record(AR, 1e-3)
    assert calls == []  # one short of STALL_COUNT
    g.record(AR, 1e-3 * (STALL_FACTOR + 0.5))
    assert calls == [(1, 1)] and g.threads() == (1, 1) and g.drops == 1
    assert g.events == [f"threads 4/8->1 after {STALL_COUNT} stalled passes of the last {STALL_WINDOW}"]
    assert "on one thread (dropped)" in g.describe()


def test_stalls_outside_the_window_do_not_add_up():
    g, calls = _guard()
    g.record(AR, 1e-3)
    for _ in range(40):  # one stall every STALL_WINDOW passes: never STALL_COUNT in a window
        g.record(AR, 10e-3)
        for _ in range(STALL_WINDOW - 1):
            g.record(AR, 1e-3)
    assert calls == [] and g.stalled == 40


def test_a_slow_pass_of_another_kind_is_not_a_stall():
    """A block pass is slower than an AR step, and a pass deep in the context slower than one near its start: each is
    judged against its own kind."""
    g, calls = _guard()
    g.record(AR, 1e-3)
    for pos in (100, 300, 1000, 5000, 20000):
        g.record(BLOCK, 20e-3)
        g.record(pass_kind(1, 1, pos), 1e-3 * pos / 100)  # first of its position's power of two: sets its bar
    assert calls == [] and g.stalled == 0


def test_passes_on_one_thread_either_way_are_not_judged():
    """A small model's one-token passes run on one thread at the full counts too (1 / 2): dropping cannot help them,
    so however they stall they neither drop the threads nor weigh in a probe; its batch passes do."""
    g, calls = _guard(1, 2)
    g.record(AR, 1e-3)
    for _ in range(20):
        g.record(AR, 1.0)
    assert calls == [] and g.stalled == 0
    g.record(BLOCK, 8e-3)
    for _ in range(STALL_COUNT):
        g.record(BLOCK, 1.0)
    assert calls == [(1, 1)] and g.events[-1] == f"threads 1/2->1 after {STALL_COUNT} stalled passes of the last 8"
    while g.dropped:
        g.record(BLOCK, 0.1)
    g.record(BLOCK, 1.0)  # the probe's first pass
    for _ in range(PROBE_JUDGE):  # one-token passes slower than one thread's: not weighed
        g.record(AR, 5.0)
    for _ in range(PROBE_JUDGE):
        g.record(BLOCK, 0.015)  # faster than one thread's 0.1, under STALL_FACTOR x the fastest
    for _ in range(PROBE_PASSES):
        g.record(BLOCK, 0.015)
    assert not g.dropped and g.events[-1] == "threads 1/2 held after a probe"


def _drop(g):
    g.record(AR, 1e-3)
    for _ in range(STALL_COUNT):
        g.record(AR, 1e-2)
    assert g.dropped


def _probe(g, one_s=2e-3):
    """One thread's passes of `one_s` until the probe restores the full counts; its first pass (not judged) too."""
    while g.dropped:
        g.record(AR, one_s)
    g.record(AR, 1.0)  # waking the other threads: however slow, not judged


def test_the_probe_comes_after_enough_seconds_on_one_thread():
    g, calls = _guard()
    _drop(g)
    for _ in range(int(PROBE_S / 2e-3) - 1):  # one thread: 2 ms a pass
        g.record(AR, 2e-3)
    assert g.dropped  # just under PROBE_S seconds
    g.record(AR, 2e-3 * 1.01)
    assert not g.dropped and calls == [(1, 1), (2, 2)] and g.probes == 1
    assert g.events[-1].startswith("threads 1->2 (probe after 1.0 s")


def test_a_probe_slower_than_one_thread_drops_again_and_waits_twice_as_long():
    """Not stalled against the full counts' fastest (1 ms; 2.4 ms is under STALL_FACTOR x), but slower than one
    thread's recent passes (2 ms): the probe lost."""
    g, calls = _guard()
    _drop(g)
    _probe(g)
    for _ in range(PROBE_JUDGE - 1):
        g.record(AR, 2.4e-3)
    assert not g.dropped
    g.record(AR, 2.4e-3)
    assert g.dropped and g.wait_s == 2 * PROBE_S and calls == [(1, 1), (2, 2), (1, 1)]
    assert g.events[-1] == f"threads 2->1 after a probe: {PROBE_JUDGE} passes took 9.6 ms, one thread 8.0 ms"


def test_failed_probes_back_off_up_to_the_cap():
    g, _ = _guard()
    _drop(g)
    waits = []
    for _ in range(10):  # every probe stalls: each doubles the wait, up to PROBE_MAX_S
        spent = 0.0
        while g.dropped:
            g.record(AR, 0.125)
            spent += 0.125
        waits.append(spent)
        g.record(AR, 1.0)  # the probe's first pass
        for _ in range(STALL_COUNT):
            g.record(AR, 1e-2)
        assert g.dropped
    assert waits[:4] == [PROBE_S, 2 * PROBE_S, 4 * PROBE_S, 8 * PROBE_S] and max(waits) == PROBE_MAX_S
    assert g.wait_s == PROBE_MAX_S


def test_a_probe_that_holds_keeps_the_threads_and_resets_the_wait():
    """Faster than one thread though slower than the full counts' best: the machine is freer again."""
    g, calls = _guard()
    _drop(g)
    g.wait_s = 8.0  # after earlier failed probes
    _probe(g, one_s=4e-3)
    for _ in range(PROBE_PASSES + 1):
        g.record(AR, 2e-3)
    assert not g.dropped and g.wait_s == PROBE_S and g.events[-1] == "threads 2 held after a probe"
    assert calls == [(1, 1), (2, 2)]


def test_one_thread_has_nothing_to_drop():
    g, calls = _guard(1, 1)
    for _ in range(50):
        g.record(AR, 1e-3)
        g.record(AR, 1.0)
    assert calls == [] and g.passes == 0 and g.describe().startswith("stall guard off")


def test_since_names_what_a_run_saw():
    g, _ = _guard()
    mark = len(g.events)
    assert g.since(mark) is None
    for _ in range(6):
        _drop(g)
        while g.dropped:
            g.record(AR, 1.0)
    text = g.since(mark)
    assert text.startswith("threads 2->1 after 3 stalled passes") and " more; " in text


def test_a_context_drops_to_one_thread_and_the_stats_say_so(bundled_gguf):
    """The guard on a real context, its passes' times made up (1 ms, 10 ms after the 12th: stalls; the real ones
    would make the test the machine's): llama.cpp's thread counts drop to one (llama_n_threads), the answer's stats
    name it, and the greedy text is the one a context that never dropped writes."""
    from clover_gguf.offload import Offload
    from clover_gguf.runtime import CloverRuntime

    kw = dict(mode="ar", max_new_tokens=40, think=False, ignore_eos=True)
    with CloverRuntime(bundled_gguf, n_ctx=512, n_threads=2, offload=Offload(stall_guard=False)) as rt:
        plain = rt.generate("Count from 3 to 9.", **kw)
        assert rt.ctx.guard.describe() == "stall guard off" and plain.stats.thread_guard is None
    with CloverRuntime(bundled_gguf, n_ctx=512, n_threads=2) as rt:
        g, L, c = rt.ctx.guard, rt.ctx.L, rt.ctx.ctx
        real, seen = g.record, []

        def slowed(kind, seconds):
            seen.append(kind)
            real(kind, 1e-3 * (10 if len(seen) > 12 else 1))

        g.record = slowed
        assert (L.llama_n_threads(c), L.llama_n_threads_batch(c)) == (2, 2)
        a = rt.generate("Count from 3 to 9.", **kw)
        assert (L.llama_n_threads(c), L.llama_n_threads_batch(c)) == (1, 1) and g.threads() == (1, 1)
        assert a.stats.thread_drops == 1 and a.stats.thread_guard.startswith("threads 2->1 after 3 stalled passes")
        assert a.stats.thread_guard in a.stats.summary() and a.stats.to_json()["thread_drops"] == 1
        assert seen[0][0] > 1 and all(k[:2] == (1, 1) for k in seen[1:])  # the prompt's pass, then AR steps
        assert a.raw == plain.raw
