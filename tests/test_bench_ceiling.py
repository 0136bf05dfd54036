"""bench/ceiling.py's arithmetic (issue 67 item 2): llama-bench's records read as pass costs at the right thread
counts, and a mode's fraction of the ceiling, its host time per pass and its rates, against sums done by hand."""

from __future__ import annotations

import pytest

from bench_scripts import load_bench

ceiling = load_bench("ceiling.py")

# llama-bench -t 1,2: a tg of 64 tokens and pp 4 / pp 32 at each count (avg_ns: the test's whole time)
RECORDS = [{"n_threads": 1, "n_prompt": 0, "n_gen": 64, "avg_ns": 6.4e6},   # 0.1 ms a token on one thread
           {"n_threads": 2, "n_prompt": 0, "n_gen": 64, "avg_ns": 12.8e6},
           {"n_threads": 1, "n_prompt": 4, "n_gen": 0, "avg_ns": 0.9e6},
           {"n_threads": 2, "n_prompt": 4, "n_gen": 0, "avg_ns": 0.5e6},   # pp4 0.5 ms on two
           {"n_threads": 1, "n_prompt": 32, "n_gen": 0, "avg_ns": 1.4e6},
           {"n_threads": 2, "n_prompt": 32, "n_gen": 0, "avg_ns": 0.8e6}]  # pp32 0.8 ms on two


def test_one_token_passes_cost_a_tg_token_at_n_threads_and_larger_ones_a_pp_at_n_threads_batch():
    costs = ceiling.costs_of(RECORDS, (1, 2))
    assert costs == pytest.approx({"tg": 1e-4, 4: 5e-4, 32: 8e-4})
    assert ceiling.costs_of(RECORDS, (2, 2))["tg"] == pytest.approx(2e-4)
    assert ceiling.cost(costs, 1) == pytest.approx(1e-4) and ceiling.cost(costs, 32) == pytest.approx(8e-4)


def test_a_modes_fraction_of_its_ceiling():
    costs = ceiling.costs_of(RECORDS, (1, 2))
    # diffusion-like: two answers, 3 passes of 32 rows and one of 4 (ceiling 3 x 0.8 + 0.5 = 2.9 ms), 20 tokens in
    # 4 ms, 3.2 of them in llama_decode
    answers = [{"rows": [32, 32], "seconds": 2e-3, "tokens": 12, "decode_seconds": 1.6e-3, "thread_drops": 0},
               {"rows": [32, 4], "seconds": 2e-3, "tokens": 8, "decode_seconds": 1.6e-3, "thread_drops": 1}]
    r = ceiling.round_of(costs, answers)
    assert r["ceiling"] == pytest.approx(2.9e-3) and r["passes"] == 4 and r["thread_drops"] == 1
    # a second round twice as slow: the median of the two fractions (0.725 and 0.3625)
    slow = dict(r, seconds=8e-3, decode_seconds=6.4e-3)
    m = ceiling.summarize({"diffusion": [r, slow]})["diffusion"]
    assert m["fraction"] == pytest.approx((2.9 / 4 + 2.9 / 8) / 2)
    assert m["tok_s"] == pytest.approx((20 / 4e-3 + 20 / 8e-3) / 2)
    assert m["ceiling_tok_s"] == pytest.approx(20 / 2.9e-3)
    assert m["host_ms_per_pass"] == pytest.approx((0.8 / 4 + 1.6 / 4) / 2)  # (4 - 3.2) ms and (8 - 6.4) ms over 4
    assert m["decode_x_ceiling"] == pytest.approx((3.2 / 2.9 + 6.4 / 2.9) / 2)
