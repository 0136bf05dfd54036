"""Each generation control against a plain, loop-by-loop numpy reading of the model card."""

from __future__ import annotations

import numpy as np
import pytest

from clover_gguf.controls import Controls, make_processors, make_sampler, process

V, EOS, ENDTEXT, THINK, THINK_END = 50, 40, 41, 42, 43


def card(generated, logits, c: Controls, thinking_at_start=False):
    """The card's definitions, written out one token at a time."""
    out = [float(x) for x in logits]
    seen = {}
    for t in generated:
        seen[t] = seen.get(t, 0) + 1
    for t, n in seen.items():
        x = out[t]
        x = x / c.repetition_penalty if x > 0 else x * c.repetition_penalty
        x = x - c.frequency_penalty * n
        x = x - c.presence_penalty
        out[t] = x
    n = len(generated)
    if n >= c.length_penalty_start:
        w = min(1.0, (n - c.length_penalty_start) / c.length_penalty_ramp)
        out[EOS] += c.length_penalty * w
        out[ENDTEXT] += c.length_penalty * w
    inside, since = thinking_at_start, 0
    for t in generated:
        if t == THINK:
            inside, since = True, 0
        elif t == THINK_END:
            inside = False
        elif inside:
            since += 1
    if inside:
        # tokens inside the span: every token after the opening one (the opener itself excluded)
        span = since
        if span >= c.think_end_bias_start:
            out[THINK_END] += c.think_end_bias * min(1.0, (span - c.think_end_bias_start) / c.think_end_bias_ramp)
    return np.array(out, dtype=np.float32)


def _procs(c, thinking_at_start=False):
    return make_processors(c, [EOS, ENDTEXT], THINK, THINK_END, thinking_at_start)


def apply(procs, generated, logits):
    """The processors on one row: a batch of one."""
    return process(procs, [generated], logits[None])[0]


@pytest.mark.parametrize("which", ["repetition", "frequency", "presence", "all_defaults"])
def test_penalties_match_the_card(which):
    rng = np.random.default_rng(1)
    logits = rng.normal(size=V).astype(np.float32) * 3
    generated = rng.integers(0, 30, size=25).tolist()
    c = {"repetition": Controls(presence_penalty=0, frequency_penalty=0, repetition_penalty=1.3, length_penalty=0,
                                think_end_bias=0),
         "frequency": Controls(presence_penalty=0, frequency_penalty=0.7, repetition_penalty=1.0, length_penalty=0,
                               think_end_bias=0),
         "presence": Controls(presence_penalty=0.9, frequency_penalty=0, repetition_penalty=1.0, length_penalty=0,
                              think_end_bias=0),
         "all_defaults": Controls()}[which]
    got = apply(_procs(c), generated, logits)
    want = card(generated, logits, c)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert not np.allclose(got, logits)  # the control did something
    untouched = [t for t in range(V) if t not in generated and t not in (EOS, ENDTEXT, THINK_END)]
    np.testing.assert_array_equal(got[untouched], logits[untouched])


def test_prompt_tokens_are_not_penalised():
    logits = np.ones(V, dtype=np.float32)
    got = apply(_procs(Controls()), [], logits)
    np.testing.assert_array_equal(got, logits)


@pytest.mark.parametrize("n", [0, 15, 16, 20, 24, 40])
def test_length_penalty_ramps(n):
    c = Controls(presence_penalty=0, frequency_penalty=0, repetition_penalty=1.0, length_penalty=10.0,
                 length_penalty_start=16, length_penalty_ramp=8, think_end_bias=0)
    logits = np.zeros(V, dtype=np.float32)
    generated = [1] * n
    got = apply(_procs(c), generated, logits)
    np.testing.assert_allclose(got, card(generated, logits, c), atol=1e-6)
    assert got[EOS] == pytest.approx(10.0 * min(1.0, max(0, n - 16) / 8))


@pytest.mark.parametrize("generated,at_start", [
    ([THINK] + [1] * 30, False), ([THINK] + [1] * 5, False), ([THINK] + [1] * 30 + [THINK_END] + [2] * 3, False),
    ([1] * 22, True), ([1] * 22, False),
])
def test_think_end_bias(generated, at_start):
    c = Controls(presence_penalty=0, frequency_penalty=0, repetition_penalty=1.0, length_penalty=0,
                 think_end_bias=10.0, think_end_bias_start=8, think_end_bias_ramp=16)
    logits = np.zeros(V, dtype=np.float32)
    got = apply(_procs(c, at_start), generated, logits)
    np.testing.assert_allclose(got, card(generated, logits, c, at_start), atol=1e-6)


def test_controls_from_gguf_meta_and_overrides():
    meta = {"clover_moe.generation.presence_penalty": "0.5", "clover_moe.generation.length_penalty_start": "100"}.get
    c = Controls.from_meta(meta, repetition_penalty=1.2)
    assert c.presence_penalty == 0.5 and c.length_penalty_start == 100 and c.repetition_penalty == 1.2
    assert c.frequency_penalty == 0.0


def test_samplers():
    logits = np.array([[0.0, 3.0, 3.0, 1.0]], dtype=np.float32)
    assert make_sampler(0.0)(logits).tolist() == [1]  # greedy, lowest index on ties
    distinct = np.array([[0.0, 3.0, 2.9, 1.0]], dtype=np.float32)
    assert {int(make_sampler(1.0, top_k=1, seed=s)(distinct)[0]) for s in range(10)} == {1}
    assert {int(make_sampler(5.0, top_k=2, seed=s)(distinct)[0]) for s in range(40)} == {1, 2}
    a = make_sampler(0.8, seed=7)
    b = make_sampler(0.8, seed=7)
    assert [a(logits).tolist() for _ in range(20)] == [b(logits).tolist() for _ in range(20)]  # seeded
    top_p_draws = {int(make_sampler(1.0, top_p=0.5, seed=s)(np.array([[5.0, 0.0, 0.0, 0.0]]))[0]) for s in range(20)}
    assert top_p_draws == {0}


def test_a_batch_samples_as_its_rows_one_by_one():
    """T rows at once draw what T one-row calls draw from the same generator, for every filter."""
    rng = np.random.default_rng(5)
    rows = rng.normal(size=(9, V)) * 2
    for kw in ({}, {"top_k": 5}, {"top_p": 0.6}, {"top_k": 7, "top_p": 0.8}):
        batch = make_sampler(0.9, seed=11, **kw)(rows)
        one = make_sampler(0.9, seed=11, **kw)
        assert batch.tolist() == [int(one(r[None])[0]) for r in rows]
        assert len(set(batch.tolist())) > 1  # it did sample


def test_the_batched_form_equals_row_by_row():
    """decoding applies a processor to a whole block at once: bit for bit what it gives each row alone."""
    from clover_gguf.controls import thinking_spans

    def span_loop(generated, at_start):  # token by token: where the open <think> span began, if one is open
        open_at = 0 if at_start else None
        for i, t in enumerate(generated):
            if t == THINK:
                open_at = i + 1
            elif t == THINK_END:
                open_at = None
        return None if open_at is None else len(generated) - open_at

    rng = np.random.default_rng(3)
    c = Controls(length_penalty_start=6, length_penalty_ramp=5, think_end_bias_start=3, think_end_bias_ramp=4)
    toks = [0, 1, 2, 5, EOS, THINK, THINK_END]
    histories = [rng.choice(toks, size=n).tolist() for n in rng.integers(0, 14, size=40)] + [[], [THINK], [THINK_END]]
    logits = rng.normal(size=(len(histories), V)).astype(np.float32) * 3
    for at_start in (False, True):
        procs = make_processors(c, [EOS, ENDTEXT], THINK, THINK_END, at_start)
        assert len(procs) == 3
        for p in procs:
            got = p(histories, logits)
            want = np.stack([p([h], row[None])[0] for h, row in zip(histories, logits)])
            np.testing.assert_array_equal(got, want)
        assert thinking_spans(histories, THINK, THINK_END, at_start) == [span_loop(h, at_start) for h in histories]
        # and the whole chain against the card, row by row
        for h, row in zip(histories, logits):
            np.testing.assert_allclose(apply(procs, h, row), card(h, row, c, at_start), rtol=1e-6, atol=1e-6)
