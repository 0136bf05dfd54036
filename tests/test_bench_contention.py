"""bench/contention.py's per-answer reading of the busy-machine bar: each loaded answer against the idle median of
its own prompt (issue 50; docs/runtime.md, "Threads on a busy machine")."""

from __future__ import annotations

import argparse

from bench_scripts import load_bench

contention = load_bench("contention.py")


def run(prompt: str, tokens: int, seconds: float) -> dict:
    return {"kind": "block", "prompt": prompt, "tokens": tokens, "seconds": seconds, "text": ""}


def test_worst_loaded_answer_is_read_against_its_own_prompts_idle_median():
    # idle: a short answer at 1,000 tok/s, a long one at 3,000 (their prompt passes weigh differently)
    idle = [run("short", 10, 0.010), run("short", 10, 0.010), run("long", 30, 0.010), run("long", 30, 0.012)]
    # loaded: the short answer at 500 tok/s (0.5 of its own idle), the long one at 2,000 (2000 / 2727.3 = 0.733)
    loaded = [run("short", 10, 0.020), run("long", 30, 0.015)]
    results = {("after", 0, "block"): idle, ("after", 2, "block"): loaded}
    a = argparse.Namespace(busy=[0, 2])
    assert abs(contention.worst_against_own_prompt(results, "after", "block", a) - 0.5) < 1e-9
    # the all-prompts column counts the short prompt's own spread: 500 against the median of 1000, 1000, 2500, 3000
    row = contention.report("a", None, [type("S", (), {"name": "after", "desc": "1 thread; poll 0"})()], results,
                            ["block"], 2, argparse.Namespace(busy=[0, 2], runs=2))["rows"][0]
    assert abs(row["worst_loaded_x_idle_median"] - 500 / 1750) < 1e-9
    assert abs(row["worst_loaded_x_prompt_idle_median"] - 0.5) < 1e-9


def test_a_prompt_never_answered_idle_is_left_out():
    results = {("after", 0, "block"): [run("a", 10, 0.01)], ("after", 1, "block"): [run("b", 10, 0.5)]}
    assert contention.worst_against_own_prompt(results, "after", "block", argparse.Namespace(busy=[0, 1])) is None
