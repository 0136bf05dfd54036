"""libclover_sampler (clover_gguf/csrc), the selection sampler outside the llama.cpp tree, against computations in
numpy on the raw rows llama.cpp returns without it; and llama.cpp's own samplers untouched beside it: in one decode,
a sequence sampling with upstream's penalties in the graph, one reading its raw logits and one with our sampler."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from clover_gguf.controls import Gather
from clover_gguf.llama_context import LlamaContext, sampler_library

V_BIG = 248_320  # the 35B's vocabulary: 256 chunks of 970 (a gather of 32 ids takes the path of a few chunks)


@pytest.fixture(scope="module")
def big_gguf(make_checkpoint, tmp_path_factory):
    from clover_gguf.convert import convert

    out = tmp_path_factory.mktemp("sampler") / "big-vocab.gguf"
    convert(make_checkpoint(seed=3, vocab_size=V_BIG), out, outtype="f32", quiet=True)
    return out


@pytest.fixture(scope="module")
def small_gguf(make_checkpoint, tmp_path_factory):
    from clover_gguf.convert import convert

    out = tmp_path_factory.mktemp("sampler") / "small.gguf"
    convert(make_checkpoint(seed=1), out, outtype="f32", quiet=True)
    return out


def _chunk(v: int) -> int:
    return next((c for c in range(min(1024, v), 63, -1) if v % c == 0), v)


def _expected_greedy(raw: np.ndarray, ids: np.ndarray):
    """numpy: per row, each chunk's largest logit and its id with the ids left out, and its probability in the
    chunk (float64)."""
    v = raw.shape[1]
    c = _chunk(v)
    x = raw.astype(np.float64).copy()
    x[:, ids] = -np.inf
    xc = x.reshape(len(x), v // c, c)
    loc = xc.argmax(-1)
    best = np.take_along_axis(xc, loc[..., None], -1)[..., 0]
    with np.errstate(invalid="ignore"):
        p = 1.0 / np.exp(xc - best[..., None]).sum(-1)
    return loc + np.arange(v // c) * c, best, p


def _corrected(raw: np.ndarray, ids: np.ndarray, coef: np.ndarray | None) -> np.ndarray:
    """numpy, float32: each row with x -> x * (x > 0 ? c0 : c1) + c2 at the ids."""
    z = raw.astype(np.float32).copy()
    if coef is not None:
        x = z[:, ids]
        z[:, ids] = x * np.where(x > 0, coef[0], coef[1]) + coef[2]
    return z


def _check_greedy(rows, raw, ids, width, probs, coef=None):
    want_ids, want_best, want_p = _expected_greedy(raw, ids)
    z = _corrected(raw, ids, coef)
    np.testing.assert_array_equal(rows.at_ids[:, :len(ids)], z[:, ids])
    np.testing.assert_array_equal(rows.at_ids[:, len(ids):width], np.repeat(z[:, ids[:1]], width - len(ids), 1))
    np.testing.assert_array_equal(rows.rest_logits, want_best.astype(np.float32))
    np.testing.assert_array_equal(rows.rest_ids, want_ids)  # no ties in random float32 logits
    if probs:
        np.testing.assert_allclose(rows.rest_probs, want_p, rtol=2e-5)
    else:
        assert rows.rest_probs is None
    # the choice: the corrected row's largest logit (np.argmax: the lowest id among equal ones)
    np.testing.assert_array_equal(rows.tokens, z.argmax(-1))
    np.testing.assert_array_equal(rows.token_logits, z.max(-1))


def _coef(rng, n_rows: int, n_ids: int, never: int = 1) -> np.ndarray:
    """Coefficients that decide: penalties on most ids, a large boost on id 0 of odd rows (so the choice is a gathered
    id in some rows and the rest's in others), -inf on id `never`."""
    coef = np.stack([rng.uniform(0.2, 0.9, (n_rows, n_ids)), rng.uniform(1.1, 3.0, (n_rows, n_ids)),
                     rng.uniform(-3, 1, (n_rows, n_ids))]).astype(np.float32)
    coef[2, 1::2, 0] = 40.0
    coef[2, :, never] = -np.inf
    return coef


@pytest.mark.parametrize("n_ids, width", [(5, 32), (32, 32), (300, 512)])  # a few chunks; all of them
def test_greedy_rows_equal_numpy_on_the_raw_rows(big_gguf, n_ids, width):
    """A block pass (32 rows) and an AR step (1 row) at V = 248,320: the logits at the ids corrected by the
    coefficients (none, and ones that decide) and the chunk maxima with the ids left out, exactly; the chunk
    probabilities to float32 precision; the choice equal to numpy's argmax of the corrected row."""
    rng = np.random.default_rng(n_ids)
    with LlamaContext(big_gguf, n_ctx=256, n_threads=2) as ctx:
        prompt = [int(t) for t in rng.integers(0, 1000, 12)]
        ctx.decode(prompt, 0, logits=False)
        block = [int(t) for t in rng.integers(0, V_BIG, 32)]
        raw = ctx.block(block, len(prompt))
        # ids clustered in a few chunks and spread ones; one id in the chunk of each row's largest logit
        pool = [int(raw[0].argmax()), *rng.integers(0, 2000, n_ids // 2), *rng.integers(0, V_BIG, n_ids)]
        ids = np.array(list(dict.fromkeys(int(t) for t in pool))[:n_ids], dtype=np.int32)
        assert len(ids) == n_ids
        coef = _coef(rng, 32, n_ids)
        decided = 0
        for probs in (True, False):
            for cf in (None, coef):
                g = Gather(ids=ids, n_rows=32, width=width, probs=probs, coef=cf)
                rows = ctx.block(block, len(prompt), gather=g)
                _check_greedy(rows, raw, ids, width, probs, cf)
                decided += cf is not None and bool(np.isin(rows.tokens, ids).any() and
                                                   not np.isin(rows.tokens, ids).all())
        assert decided == 2  # with the coefficients some rows chose a gathered id, others the rest's
        # an AR step: one row, raw and then selected, each after the same prompt
        step = ctx.decode([block[0]], len(prompt))
        ctx.clear()
        ctx.decode(prompt, 0, logits=False)
        rows = ctx.decode([block[0]], len(prompt), gather=Gather(ids=ids, n_rows=1, width=width, probs=True,
                                                                 coef=coef[:, 1:2]))
        _check_greedy(rows, step, ids, width, True, coef[:, 1:2])
        assert rows.tokens[0] == ids[0]  # the boost decided


def test_greedy_ties_go_to_the_lowest_id_whichever_side_it_is_on(big_gguf):
    """Exact ties made with the coefficients (c0 = c1 = 0: the corrected logit is c2 itself): between two gathered
    ids (the higher listed first), and between a gathered id and the largest logit of the rest, one lower, one
    higher than it. The choice is the lowest id in each row, and its logit the tied value."""
    rng = np.random.default_rng(11)
    with LlamaContext(big_gguf, n_ctx=256, n_threads=2) as ctx:
        prompt = [int(t) for t in rng.integers(0, 1000, 12)]
        ctx.decode(prompt, 0, logits=False)
        block = [int(t) for t in rng.integers(0, V_BIG, 3)]
        raw = ctx.block(block, len(prompt))
        top = raw.argmax(-1)
        assert 1000 < top.min() and top.max() < V_BIG - 1000
        ids = np.array([top[0] + 7, top[0] + 3, top[1] - 5, top[2] + 5], dtype=np.int32)
        coef = np.zeros((3, 3, 4), dtype=np.float32)
        coef[2] = -np.inf
        coef[2, 0, :2] = 100.0  # row 0: two gathered ids tie above the rest
        coef[2, 1, 2] = raw[1, top[1]]  # row 1: a gathered id below the rest's best ties with it
        coef[2, 2, 3] = raw[2, top[2]]  # row 2: one above it
        rows = ctx.block(block, len(prompt), gather=Gather(ids=ids, n_rows=3, width=32, probs=True, coef=coef))
    assert rows.tokens.tolist() == [top[0] + 3, top[1] - 5, top[2]]
    np.testing.assert_array_equal(rows.token_logits, [100.0, raw[1, top[1]], raw[2, top[2]]])


@pytest.mark.parametrize("probs", [True, False])  # the masked softmax, or the masked logits ranked directly
def test_a_chunk_made_of_ids_only_is_dead_and_the_others_exact(big_gguf, probs):
    """Ids that cover a whole chunk (and parts of others): that chunk's maximum is -inf (nothing of it is left
    outside the ids), every other chunk's as numpy finds it."""
    c = _chunk(V_BIG)
    rng = np.random.default_rng(5)
    dead = 7
    ids = np.array([*range(dead * c, (dead + 1) * c), *rng.integers(0, dead * c, 40)], dtype=np.int32)
    ids = np.array(list(dict.fromkeys(ids.tolist())), dtype=np.int32)
    rng.shuffle(ids)  # the chunk's ids not in order among the others
    with LlamaContext(big_gguf, n_ctx=256, n_threads=2) as ctx:
        prompt = [int(t) for t in rng.integers(0, 1000, 12)]
        ctx.decode(prompt, 0, logits=False)
        block = [int(t) for t in rng.integers(0, V_BIG, 8)]
        raw = ctx.block(block, len(prompt))
        rows = ctx.block(block, len(prompt), gather=Gather(ids=ids, n_rows=8, width=1024, probs=probs))
    want_ids, want_best, _ = _expected_greedy(raw, ids)
    live = np.arange(V_BIG // c) != dead
    assert np.all(rows.rest_logits[:, dead] == -np.inf)
    np.testing.assert_array_equal(rows.rest_logits[:, live], want_best[:, live].astype(np.float32))
    np.testing.assert_array_equal(rows.rest_ids[:, live], want_ids[:, live])
    np.testing.assert_array_equal(rows.at_ids[:, :len(ids)], raw[:, ids])


def test_sampled_rows_report_numpy_probabilities(big_gguf):
    """temp > 0: the probabilities at the ids and of the drawn token are those of numpy's softmax of the corrected
    row (x -> x * (x > 0 ? c0 : c1) + c2 at the ids); with top_k 1 the draw is the corrected row's most likely
    token."""
    rng = np.random.default_rng(7)
    with LlamaContext(big_gguf, n_ctx=256, n_threads=2) as ctx:
        prompt = [int(t) for t in rng.integers(0, 1000, 10)]
        ctx.decode(prompt, 0, logits=False)
        block = [int(t) for t in rng.integers(0, V_BIG, 8)]
        raw = ctx.block(block, len(prompt)).astype(np.float64)
        ids = np.array([int(raw[0].argmax()), 5, 17, 40_000, 248_319], dtype=np.int32)
        coef = np.stack([rng.uniform(0.2, 0.9, (8, 5)), rng.uniform(1.1, 3.0, (8, 5)),
                         rng.uniform(-3, 1, (8, 5))]).astype(np.float32)
        coef[2, :, 1] = -np.inf  # never
        z = raw.copy()
        x = z[:, ids]
        z[:, ids] = x * np.where(x > 0, coef[0], coef[1]) + coef[2]
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        u = np.zeros(8, dtype=np.float32)
        g = Gather(ids=ids, n_rows=8, width=32, temp=1.0, top_k=1, coef=coef, uniform=u)
        rows = ctx.block(block, len(prompt), gather=g)
        np.testing.assert_allclose(rows.at_ids[:, :5], p[:, ids], rtol=1e-4, atol=1e-12)
        assert (rows.at_ids[:, 1] == 0).all()
        np.testing.assert_array_equal(rows.tokens, z.argmax(-1))
        np.testing.assert_allclose(rows.token_probs, p[np.arange(8), rows.tokens], rtol=1e-4)


def test_mixed_batch_leaves_llama_samplers_and_raw_logits_as_upstream(small_gguf):
    """One llama_decode, three sequences in one ubatch: 0 samples with upstream's penalties + greedy in the graph,
    1 has no sampler, 2 has our sampler. The raw logits llama.cpp copies out (llama_get_logits: every row of the
    ubatch, as sequence 1 has no sampler) are bit for bit those of the same decode without samplers: no sampler wrote
    into llama.cpp's rows. llama_get_logits_ith gives 1 its raw row, and (upstream's rule: a row's sampled logits when
    its sampler left some) 0 numpy's penalised raw row, whose argmax is 0's token, and 2 our sampler's logits, which
    equal numpy on 2's raw row."""
    # one output row per sequence (llama.cpp's default, which its penalties sampler needs in the graph)
    with LlamaContext(small_gguf, n_ctx=256, n_seq_max=3, n_threads=2, n_outputs_max_per_seq=1) as ctx:
        L, c, v = ctx.L, ctx.ctx, ctx.n_vocab
        # prompts of one length: llama.cpp's split_equal then puts the three rows in one ubatch
        prompts = [ctx.tokenize(t) for t in ("Count from 3 to 9.", "What is 34 + 58?", "Reverse: c l o v e r")]
        k = min(len(p) for p in prompts)
        prompts = [p[:k] for p in prompts]
        parts = [(p, 0, s) for s, p in enumerate(prompts)]
        n = sum(len(p) for p in prompts)

        def run() -> list[int]:
            batch = ctx._batch_for(n)
            lasts = [int(i) - 1 for i in batch.put(parts)]
            batch.logits[:n] = 0
            batch.logits[lasts] = 1
            ctx._run(batch, n, 3)
            return lasts

        def row(ptr, n_values: int = v) -> np.ndarray:
            return np.ctypeslib.as_array(ptr, shape=(n_values,)).copy()

        lasts = run()
        raw = np.ctypeslib.as_array(L.llama_get_logits(c), shape=(3, v)).copy()
        for i, j in enumerate(lasts):
            np.testing.assert_array_equal(row(L.llama_get_logits_ith(c, j)), raw[i])
        ctx.clear()

        # sequence 0: penalties on its top token (seen 3 times) and two others, then greedy, all in the graph
        top = int(raw[0].argmax())
        history = [top, top, top, 7, 11]
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_penalties(v, 64, 3.0, 0.5, 2.0))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
        for t in history:
            L.llama_sampler_accept(chain, t)
        assert L.llama_set_sampler(c, 0, chain)
        ids = np.array([top, 3, int(raw[2].argmax())], dtype=np.int32)
        g = Gather(ids=ids, n_rows=1, width=32, probs=True)
        ctx._select_on(2, g, 1, n)
        try:
            lasts = run()
            got_raw = np.ctypeslib.as_array(L.llama_get_logits(c), shape=(3, v)).copy()
            ith = [row(L.llama_get_logits_ith(c, lasts[0])), row(L.llama_get_logits_ith(c, lasts[1])),
                   row(L.llama_get_logits_ith(c, lasts[2]), 32 + 1 + 1)]
            token0 = L.llama_get_sampled_token_ith(c, lasts[0])
            rows2 = ctx._graph_rows(lasts[2], 1, g)
        finally:
            L.llama_set_sampler(c, 0, None)
            L.llama_sampler_free(chain)
        np.testing.assert_array_equal(got_raw, raw)  # raw, for every sequence
        np.testing.assert_array_equal(ith[1], raw[1])
        pen = raw[0].astype(np.float64).copy()
        for t in set(history):
            pen[t] = (pen[t] / 3.0 if pen[t] > 0 else pen[t] * 3.0) - history.count(t) * 0.5 - 2.0
        assert int(pen.argmax()) != top  # the penalties decided
        assert token0 == int(pen.argmax())
        np.testing.assert_allclose(ith[0], pen, rtol=1e-6, atol=1e-6)
        _check_greedy(rows2, raw[2][None], ids, 32, True)
        np.testing.assert_array_equal(ith[2], np.concatenate([rows2.at_ids[0], rows2.rest_logits[0],
                                                             rows2.token_logits[:1]]))


def test_bad_inputs_are_refused_not_read(small_gguf):
    """Ids outside the vocabulary, more ids than the width, counts that do not fit, uniforms outside [0, 1], a
    sampler that is not ours: -1 (and NULL for bad settings), never a read out of bounds; through the runtime one
    ValueError."""
    with LlamaContext(small_gguf, n_ctx=128, n_threads=2) as ctx:
        lib = sampler_library(ctx.L)
        v = ctx.n_vocab
        assert not lib.clover_sampler_init(0, 32, True, 0.0, 0, 1.0)
        assert not lib.clover_sampler_init(v, 0, True, 0.0, 0, 1.0)
        assert not lib.clover_sampler_init(v, 32, True, 1.0, -1, 1.0)
        assert not lib.clover_sampler_init(v, 32, True, 1.0, 0, 0.0)
        assert not lib.clover_sampler_init(v, 32, True, float("nan"), 0, 1.0)
        s = lib.clover_sampler_init(v, 4, True, 1.0, 0, 1.0)
        assert s

        def put(ids, n_rows, coef=True, u=0.5):
            a = (ctypes.c_int32 * max(1, len(ids)))(*ids)
            cf = (ctypes.c_float * max(1, 3 * n_rows * len(ids)))() if coef else None
            uu = (ctypes.c_float * max(1, n_rows))(*([u] * n_rows))
            return lib.clover_sampler_set_inputs(s, a, len(ids), n_rows, cf, uu)

        assert put([0, 1], 2) == 0
        assert put([v], 1) == -1 and put([-1], 1) == -1
        assert put([0, 1, 2, 3, 4], 1) == -1  # more than the width
        assert put([], 1) == -1 and put([0], -1) == -1
        assert put([0], 1, coef=False) == -1  # temp > 0 needs the coefficients
        assert not lib.clover_sampler_init((1 << 24) + 1, 32, True, 0.0, 0, 1.0)  # ids beyond float32's integers
        g0 = lib.clover_sampler_init(v, 4, True, 0.0, 0, 1.0)
        assert lib.clover_sampler_set_inputs(g0, (ctypes.c_int32 * 1)(0), 1, 1, None, None) == 0  # greedy: none
        ctx.L.llama_sampler_free(g0)
        assert put([0], 1, u=1.5) == -1 and put([0], 1, u=float("nan")) == -1
        assert lib.clover_sampler_set_inputs(s, None, 0, 0, None, None) == 0  # no rows in the next decode
        greedy = ctx.L.llama_sampler_init_greedy()
        assert lib.clover_sampler_set_inputs(greedy, (ctypes.c_int32 * 1)(0), 1, 1, None, None) == -1
        ctx.L.llama_sampler_free(greedy)
        ctx.L.llama_sampler_free(s)
        assert lib.clover_sampler_chunk(248_320) == 970 and lib.clover_sampler_chunk(448) == 448
        assert lib.clover_sampler_chunk(0) == 0

        ids = ctx.tokenize("Count from 3 to 9.")
        with pytest.raises(ValueError, match="refused its inputs"):
            ctx.decode(ids, 0, logits=[False] * (len(ids) - 1) + [True],
                       gather=Gather(ids=np.array([v + 5], dtype=np.int32), n_rows=1, width=32))


def test_a_block_pass_selects_its_rows_in_one_computation_as_a_causal_pass_does(bundled_gguf):
    """The sampler computes all of a sequence's rows at once when it knows how many there are (one "run": one
    `clover_token` tensor for all rows). Block graphs are built with a clone of it (patch 0006), which must hold the
    decode's row count when the graph is built, not the count of the pass before: else every row of a 32-token block
    is a computation of its own (2,293 graph nodes instead of 619 on the bundled model: a block pass reusing that
    graph cost 2.4 ms against 1.9, a causal pass of as many rows 1.8, on a 2-core CPU). Counted when the block graph is first built and when it is reused, beside a
    causal pass of many rows, where the block sequence's sampler, set to no rows, builds nothing (build_sampling
    would have it build a run on a dummy row that is never computed); the rows still equal numpy's on the block's
    raw logits."""
    from clover_gguf.graph_probe import GraphProbe

    probe = GraphProbe(r"clover_token", read_data=False)
    with LlamaContext(bundled_gguf, n_ctx=256, n_seq_max=3, n_threads=2, eval_callback=probe.callback) as ctx:
        prompt = ctx.tokenize("Count from 3 to 9.")
        ctx.decode(prompt, 0, logits=False)
        mask = int(ctx.meta("tokenizer.ggml.mask_token_id"))
        block = [mask] * 32
        ids = np.array([3, 5, 8], dtype=np.int32)
        raw = ctx.block(block, len(prompt))  # the raw rows, no sampler attached
        counts = []
        for _ in range(2):  # built, then reused
            probe.clear()
            rows = ctx.block(block, len(prompt), gather=Gather(ids=ids, n_rows=32, width=32, probs=True))
            counts.append(len(probe.records))
            _check_greedy(rows, raw, ids, 32, True)
        probe.clear()
        ctx.decode(block[:18], len(prompt), gather=Gather(ids=ids, n_rows=18, width=32, probs=False))
        counts.append(len(probe.records))
        assert probe.error is None
        assert sorted(ctx._selectors) == [0, 1]
        assert counts == [1, 1, 1]
