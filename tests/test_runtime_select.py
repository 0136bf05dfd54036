"""Selection in llama.cpp's graph (libclover_sampler, runtime selection "graph") against selection in numpy on the rows'
logits copied out (selection "numpy", the path before it): the same tokens, confidences, accept / reject decisions
and passes in every mode with the card's controls on; sampled decoding draws from the numpy sampler's distribution."""

from __future__ import annotations

import numpy as np
import pytest

from clover_gguf.controls import Controls, Histories, Sampling, Selector, make_processors, process
from clover_gguf.decoding import generate_all
from clover_gguf.runtime import CloverRuntime

# the card's controls made to bite within a short answer: penalties that change choices, the length penalty and the
# think-end bias ramping after a few tokens (the bundled model's answers start with a thinking span)
BITING = Controls(presence_penalty=5.0, frequency_penalty=1.0, repetition_penalty=2.0, length_penalty=8.0,
                  length_penalty_start=4, length_penalty_ramp=4, think_end_bias=8.0, think_end_bias_start=2,
                  think_end_bias_ramp=2)
PROMPTS = ["What is 34 + 58?", "Count from 12 to 17.", "Reverse: c l o v e r", "What is 7 + 8?",
           "Count from 33 to 37."]


@pytest.fixture(scope="module")
def runtimes(bundled_gguf):
    rts = {s: CloverRuntime(bundled_gguf, n_ctx=512, n_threads=2, selection=s) for s in ("graph", "numpy")}
    yield rts
    for rt in rts.values():
        rt.close()


def _run(rt, prompt, controls, **kw):
    ids = rt.prompt_ids(prompt)
    procs = make_processors(controls, rt.eos_ids, rt.think_id, rt.think_end_id, rt.thinking_at_start(ids))
    rt.backend.keep_backup = kw.get("mode") == "draft-self"
    calls = []
    for name in ("prefill", "commit", "block_logits", "prefill_rows", "commit_rows", "block_rows"):
        fn = getattr(rt.backend, name)
        setattr(rt.backend, name, lambda *a, _n=name, _f=fn, **k: (calls.append((_n.split("_")[0], list(a[0]))),
                                                                   _f(*a, **k))[1])
    try:
        toks, stats = generate_all(rt.backend, ids, max_new_tokens=64, logits_processors=procs, **kw)
    finally:
        for name in ("prefill", "commit", "block_logits", "prefill_rows", "commit_rows", "block_rows"):
            delattr(rt.backend, name)
    return toks, stats, calls


@pytest.mark.parametrize("controls", ["card", "biting"])
@pytest.mark.parametrize("mode, accept, end_rule", [
    ("ar", "exact", "prefix"), ("diffusion", "exact", "prefix"), ("diffusion", "exact", "tail"),
    ("draft-self", "exact", "prefix"), ("draft-self", "threshold", "plain")])
def test_graph_selection_decodes_as_numpy_selection(runtimes, controls, mode, accept, end_rule):
    c = Controls() if controls == "card" else BITING
    changed = 0
    for prompt in PROMPTS:
        kw = dict(mode=mode, accept=accept, end_rule=end_rule, threshold=0.9)
        want = _run(runtimes["numpy"], prompt, c, **kw)
        got = _run(runtimes["graph"], prompt, c, **kw)
        assert got[0] == want[0], prompt
        assert got[1] == want[1], prompt
        assert got[2] == want[2], prompt  # the same passes over the same tokens
        assert {k for k, _ in got[2]} <= {"prefill", "commit", "block"}
        changed += _run(runtimes["numpy"], prompt, Controls().off(), **kw)[0] != want[0]
    if controls == "biting" and mode == "ar":
        assert changed >= 3  # the controls decided tokens here (a block pass of this model resolves its answer at
        # once, before any history exists: tests/test_selection.py covers histories inside blocks)


def _states(rt, n: int = 4):
    """(prompt + answer so far, answer so far, a block with some positions resolved) from the bundled model."""
    rng = np.random.default_rng(0)
    out = []
    for prompt in PROMPTS[:n]:
        ids = rt.prompt_ids(prompt)
        answer = rt.ctx.tokenize("<think>\nplan plan 34 + 58", special=True)[:int(rng.integers(3, 9))]
        block = [rt.mask_token_id] * 8
        for i in rng.choice(8, size=3, replace=False):
            block[i] = int(rng.choice(answer))
        out.append((ids, answer, block))
    return out


def test_a_graph_choice_equals_the_numpy_one(runtimes):
    """Pass by pass on the same states: tokens equal, confidences and asked probabilities to float32 precision."""
    rt = runtimes["graph"]
    b = rt.backend
    for ids, answer, block in _states(rt):
        procs = make_processors(BITING, rt.eos_ids, rt.think_id, rt.think_end_id, rt.thinking_at_start(ids))
        masked = [i for i, t in enumerate(block) if t == rt.mask_token_id]
        tail = [t for t in block if t != rt.mask_token_id]
        lens = [sum(1 for j in range(i) if block[j] != rt.mask_token_id) for i in masked]
        h = Histories(answer, tail, lens)
        b.reset()
        b.prefill(ids + answer)
        dense = Selector(procs, None, rt.eos_ids).choose(h, b.block_logits(block)[masked])
        sel = Selector(procs, None, rt.eos_ids)
        g = sel.gather(h, want=[block[i] for i in range(8) if block[i] != rt.mask_token_id])
        got = sel.choose(h, b.block_rows(block, masked, g), g)
        np.testing.assert_array_equal(got.tokens, dense.tokens)
        np.testing.assert_allclose(got.conf, dense.conf, rtol=1e-5)
        for m in range(len(masked)):
            for t in tail + sorted(rt.eos_ids):
                assert got.prob(m, t) == pytest.approx(dense.prob(m, t), rel=1e-4, abs=1e-9)
            assert got.best_of(m, sorted(rt.eos_ids)) == dense.best_of(m, sorted(rt.eos_ids))


def test_rows_for_tokens_only_hold_what_rows_with_probabilities_hold(runtimes):
    """A pass that asks for tokens only (an AR step: Gather.probs False) gets the same logits at the ids and the same
    chunk maxima as one that also asks for probabilities, and the same tokens as the numpy path."""
    rt = runtimes["graph"]
    b = rt.backend
    ids, answer, block = _states(rt, 1)[0]
    masked = [i for i, t in enumerate(block) if t == rt.mask_token_id]
    h = Histories(answer, [t for t in block if t != rt.mask_token_id],
                  [sum(1 for j in range(i) if block[j] != rt.mask_token_id) for i in masked])
    procs = make_processors(BITING, rt.eos_ids, rt.think_id, rt.think_end_id, False)
    b.reset()
    b.prefill(ids + answer)
    dense = Selector(procs, None, rt.eos_ids).choose(h, b.block_logits(block)[masked])
    rows, choices = {}, {}
    for probs in (True, False):
        sel = Selector(procs, None, rt.eos_ids)
        g = sel.gather(h, probs=probs)
        rows[probs] = b.block_rows(block, masked, g)
        choices[probs] = sel.choose(h, rows[probs], g)
    for field in ("at_ids", "rest_ids", "rest_logits", "tokens", "token_logits"):
        np.testing.assert_array_equal(getattr(rows[False], field), getattr(rows[True], field))
    assert rows[False].rest_probs is None and rows[True].rest_probs.shape == rows[True].rest_logits.shape
    assert rows[True].rest_ids.shape[1] * (rows[True].rest_ids[0, 1] - rows[True].rest_ids[0, 0] if
                                           rows[True].rest_ids.shape[1] > 1 else 1) <= rt.ctx.n_vocab
    np.testing.assert_array_equal(choices[False].tokens, dense.tokens)
    assert np.isnan(choices[False].conf).all()
    with pytest.raises(ValueError, match="tokens only"):
        choices[False].prob(0, rt.mask_token_id)


SAMPLINGS = [dict(temp=1.0, top_k=6), dict(temp=2.0, top_k=12, top_p=0.6), dict(temp=3.0, top_p=0.5)]


@pytest.mark.parametrize("kw", SAMPLINGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_sampling_in_the_graph_keeps_the_numpy_distribution(tiny_random_gguf, kw):
    """A fixed seed, 400 block passes over 6 masked positions of a random model (broad distributions): each
    position's draws against numpy's Sampling.probs of the same processed logits, by a chi-square bound; the reported
    probabilities equal numpy's."""
    n_pass = 400
    with CloverRuntime(tiny_random_gguf, n_ctx=256, n_threads=2) as rt:
        b = rt.backend
        ids = rt.ctx.tokenize("Count from 3 to 9.", special=True)
        answer = ids[2:6]
        procs = make_processors(BITING, rt.eos_ids, rt.think_id, rt.think_end_id, False)
        block = [rt.mask_token_id] * 6
        masked = list(range(6))
        h = Histories(answer, [], [0] * 6)
        b.reset()
        b.prefill(ids + answer)
        processed = process(procs, h, b.block_logits(block))
        p = Sampling(seed=0, **kw).probs(processed)
        sel = Selector(procs, Sampling(seed=1234, **kw), rt.eos_ids)
        counts = np.zeros_like(p)
        for _ in range(n_pass):
            g = sel.gather(h)
            choice = sel.choose(h, b.block_rows(block, masked, g), g)
            counts[np.arange(6), choice.tokens] += 1
        conf = np.exp(processed - processed.max(-1, keepdims=True))
        conf /= conf.sum(-1, keepdims=True)
        np.testing.assert_allclose(choice.conf, conf[np.arange(6), choice.tokens], rtol=1e-5)
    assert counts[p == 0].sum() == 0  # nothing outside top-k / top-p
    support = p > 0
    assert support.sum(-1).min() >= 3  # broad enough to test something
    expected = n_pass * p[support]
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum() - len(p))
    assert chi2 <= df + 5 * np.sqrt(2 * df), (chi2, df)  # about 4.6 sigma of chi-square(df)


@pytest.fixture(scope="module")
def tiny_random_gguf(make_checkpoint, tmp_path_factory):
    from clover_gguf.convert import convert

    out = tmp_path_factory.mktemp("select") / "random.gguf"
    convert(make_checkpoint(seed=1), out, outtype="f32", quiet=True)
    return out


def test_an_ar_answer_attaches_its_sampler_once_and_reuses_every_steps_graph(bundled_gguf, monkeypatch):
    """An AR answer's one-row gathers take the width the whole answer can need at its first pass (decoding._Passes):
    with the penalties each token it writes can add its id to the gather, and a gather that outgrew its width took a
    new sampler mid-answer, which llama.cpp attaches by re-reserving its compute buffers and building the graph anew
    (on the 35B-wide slice 30-40 ms each, twice in a 128-token answer: 4% of its time; issue 67). A sampled answer
    on a fresh runtime, whose tokens outgrow the first width (32 ids): one attach, before the prompt, and every step
    after the first reuses llama.cpp's graph (llama_perf_context's n_reused)."""
    from clover_gguf.controls import GATHER_WIDTHS
    from clover_gguf.llama_context import load_binding

    L = load_binding()
    attached: list[int] = []
    set_sampler = L.llama_set_sampler
    monkeypatch.setattr(L, "llama_set_sampler", lambda *a: (attached.append(a[1]), set_sampler(*a))[1])
    with CloverRuntime(bundled_gguf, n_ctx=512, n_threads=1) as rt:
        ids = rt.prompt_ids("Write a short story about a cat.", think=False)
        before = L.llama_perf_context(rt.ctx.ctx)
        tokens = [t for piece in rt.stream_pieces(ids, mode="ar", max_new_tokens=200, ignore_eos=True, temp=1.5,
                                                  seed=3) for t in piece.tokens]
        after = L.llama_perf_context(rt.ctx.ctx)
    assert len(tokens) == 200 and len(set(tokens)) > GATHER_WIDTHS[0]  # the ids outgrew the first width
    assert attached == [0]
    steps = after.n_eval - before.n_eval  # one-token decodes: the answer's steps after the prompt's pass
    assert steps == len(tokens) - 2 and after.n_reused - before.n_reused == steps
