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


def test_a_block_pass_selects_its_rows_in_one_computation(bundled_gguf):
    """The sampler computes a sequence's announced rows as one computation over the rows llama.cpp hands it
    (llama_sampler_data.seq_logits, the series' 0010), each call getting the slice of its own row
    (llama_sampler_data.row): one `clover_token` tensor per pass, not one per row. Counted when the block graph is
    first built and when it is reused, beside a causal pass of 18 rows, where the block sequence's sampler (no rows
    announced, a call for no row) builds nothing on llama.cpp's dummy row; the rows still equal numpy's on the
    block's raw logits. (One computation per row, the first 0010's library: 32 `clover_token` tensors and 2,550 graph
    nodes for a 32-token block on the bundled model, against 657 for one run; timings: docs/llama-cpp-patch.md,
    patch 0010.)"""
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


# ---- constrained output and logprobs (clover_sampler_init_ext, clover_sampler_set_inputs_ext) ----------------------
def string_mask(seed: int = 0):
    """A JSON string's kind of mask at V = 248,320: 8,300 ids excluded (the sampler gathers them: "deny")."""
    from clover_gguf.testing.automaton import string_mask as mask

    return mask(V_BIG, seed)


def structure_mask(seed: int = 0, extra=()):
    """A JSON structure position's kind: 60 ids allowed (the sampler gathers them: "allow")."""
    from clover_gguf.testing.automaton import structure_mask as mask

    return mask(V_BIG, seed, extra)


def _taken(ids: np.ndarray, g: Gather) -> np.ndarray:
    """The ids the sampler takes: `ids`, then each mask's ids (the allowed, or the excluded when fewer; masks in the
    order rows first use them, ids ascending), each once."""
    out = [int(t) for t in ids]
    seen = set(out)
    for j in dict.fromkeys(int(k) for k in g.row_mask if k >= 0):
        m = g.masks[j]
        d = m.dense()
        for t in np.flatnonzero(d if m.n_allowed <= m.n_vocab - m.n_allowed else ~d).tolist():
            if t not in seen:
                seen.add(t)
                out.append(t)
    return np.array(out, dtype=np.int64)


def _restricted(raw: np.ndarray, g: Gather) -> np.ndarray:
    """numpy, float32: the rows corrected at the ids (g.coef) with -inf where a row's mask does not allow."""
    z = _corrected(raw, g.ids, g.coef)
    return g.restrict(z)


def _masked_gather(rng, n_rows, probs=True, temp=0.0, top_n=0, coef=True):
    """A block pass's gather: 12 ids with coefficients; rows 0, 3: a string mask, 1, 4: a structure mask that
    allows two of the ids, 2: another structure mask, the rest free."""
    from clover_gguf.constraint import Mask

    ids = np.array(rng.choice(V_BIG, size=12, replace=False), dtype=np.int32)
    masks = [string_mask(), structure_mask(extra=ids[:2].tolist()), structure_mask(seed=5)]
    row_mask = np.full(n_rows, -1, dtype=np.int32)
    row_mask[[0, 3]], row_mask[[1, 4]], row_mask[2] = 0, 1, 2
    g = Gather(ids=ids, n_rows=n_rows, width=32768, probs=probs, temp=temp, top_n=top_n, masks=masks,
               row_mask=row_mask, coef=_coef(rng, n_rows, len(ids)) if coef else None)
    assert isinstance(masks[0], Mask) and masks[0].n_ids() == 8300 and masks[1].n_ids() >= 60
    return g


def test_restricted_greedy_rows_equal_numpy_on_the_raw_rows(big_gguf):
    """A 32-row block pass at V = 248,320, rows restricted by a string mask (8,300 ids excluded: gathered with -inf),
    structure masks (60 allowed: gathered, the rest of the row excluded) or nothing, with coefficients that decide: the
    logits at every id taken (the given ids, then the masks') equal numpy's restricted corrected row, the chunk
    maxima those of the row without the taken ids (-inf for a restricted-to-its-ids row), the choice numpy's argmax
    of the restricted row, the top 20 numpy's top 20 (their logits and ids), for tokens only and with probabilities."""
    rng = np.random.default_rng(3)
    with LlamaContext(big_gguf, n_ctx=256, n_threads=2) as ctx:
        prompt = [int(t) for t in rng.integers(0, 1000, 12)]
        ctx.decode(prompt, 0, logits=False)
        block = [int(t) for t in rng.integers(0, V_BIG, 32)]
        raw = ctx.block(block, len(prompt))
        for probs, top_n in ((True, 20), (False, 0)):
            g = _masked_gather(np.random.default_rng(4), 32, probs=probs, top_n=top_n)
            rows = ctx.block(block, len(prompt), gather=g)
            taken = _taken(g.ids, g)
            assert rows.n_ids == len(taken)
            z = _restricted(raw, g)
            np.testing.assert_array_equal(rows.at_ids[:, :len(taken)], z[:, taken])
            want_ids, want_best, want_p = _expected_greedy(raw, taken)
            free = (g.row_mask < 0) | (g.row_mask == 0)  # rows whose rest is read (the structure rows' is excluded)
            np.testing.assert_array_equal(rows.rest_logits[free], want_best[free].astype(np.float32))
            np.testing.assert_array_equal(rows.rest_ids[free], want_ids[free])
            assert np.all(rows.rest_logits[~free] == -np.inf)
            np.testing.assert_array_equal(rows.tokens, z.argmax(-1))
            np.testing.assert_array_equal(rows.token_logits, z.max(-1))
            assert all(g.masks[j].allows(int(t)) for t, j in zip(rows.tokens, g.row_mask) if j >= 0)
            assert not g.masks[0].allows(int(raw[0].argmax())) or z[0].argmax() == raw[0].argmax()
            if probs:
                np.testing.assert_allclose(rows.rest_probs[free], want_p[free], rtol=2e-5)
            if top_n:
                top = np.argsort(-z, axis=1)[:, :top_n]
                for r in range(32):
                    got = sorted(zip(rows.top_ids[r].tolist(), rows.top_logits[r].tolist()), key=lambda p: -p[1])
                    assert [t for t, _ in got] == top[r].tolist(), r
                    np.testing.assert_array_equal([v for _, v in got], z[r, top[r]])
            else:
                assert rows.top_ids is None


def test_restricted_greedy_ties_go_to_the_lowest_id(big_gguf):
    """A structure row whose two allowed ids tie exactly above every other (coefficients c0 = c1 = 0, the same c2,
    the higher id listed first) chooses the lower; a string row choosing from the rest with a tie between its best
    allowed id and a gathered one (the excluded best of the row gathered with -inf) chooses the lower."""
    from clover_gguf.constraint import Mask

    rng = np.random.default_rng(13)
    with LlamaContext(big_gguf, n_ctx=256, n_threads=2) as ctx:
        prompt = [int(t) for t in rng.integers(0, 1000, 12)]
        ctx.decode(prompt, 0, logits=False)
        block = [int(t) for t in rng.integers(0, V_BIG, 2)]
        raw = ctx.block(block, len(prompt))
        a, b = sorted(rng.choice(V_BIG, size=2, replace=False).tolist())
        first = int(raw[1].argmax())
        second = int(np.argsort(-raw[1])[1])  # the row's best allowed once `first` is excluded
        t = min(second, first) - 1 if min(second, first) > 0 else max(second, first) + 1
        ids = np.array([b, a, t], dtype=np.int32)
        coef = np.zeros((3, 2, 3), dtype=np.float32)
        coef[:2] = 1.0
        coef[:, 0, :2] = [[0, 0], [0, 0], [50.0, 50.0]]
        coef[:, 1, 2] = [0.0, 0.0, raw[1, second]]  # the gathered id t at exactly the best allowed logit
        allow = np.ones(V_BIG, dtype=bool)
        allow[first] = False
        masks = [Mask.of([a, b, int(raw[0].argmax())], V_BIG), Mask.of(np.flatnonzero(allow), V_BIG)]
        g = Gather(ids=ids, n_rows=2, width=32, probs=True, coef=coef, masks=masks,
                   row_mask=np.array([0, 1], dtype=np.int32))
        rows = ctx.block(block, len(prompt), gather=g)
    assert rows.tokens.tolist() == [a, min(t, second)]
    assert rows.token_logits.tolist() == [50.0, raw[1, second]]


@pytest.mark.parametrize("top_k", [0, 1])
def test_restricted_sampled_rows_report_numpy_probabilities(big_gguf, top_k):
    """temp > 0 with restricted rows: the probabilities at the ids taken and of the draw, and the top 5's, are those
    of numpy's softmax of the restricted corrected row; every draw is allowed; with top_k 1 the draw is that row's
    most likely token; the processed logits returned with the top 5 are numpy's."""
    rng = np.random.default_rng(17)
    with LlamaContext(big_gguf, n_ctx=256, n_threads=2) as ctx:
        prompt = [int(t) for t in rng.integers(0, 1000, 10)]
        ctx.decode(prompt, 0, logits=False)
        block = [int(t) for t in rng.integers(0, V_BIG, 8)]
        raw = ctx.block(block, len(prompt))
        g = _masked_gather(np.random.default_rng(5), 8, temp=1.0, top_n=5)
        g.top_k, g.uniform = top_k, rng.uniform(0.01, 0.99, 8).astype(np.float32)
        rows = ctx.block(block, len(prompt), gather=g)
    z = _restricted(raw, g).astype(np.float64)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    taken = _taken(g.ids, g)
    np.testing.assert_allclose(rows.at_ids[:, :len(taken)], p[:, taken], rtol=1e-4, atol=1e-12)
    np.testing.assert_allclose(rows.token_probs, p[np.arange(8), rows.tokens], rtol=1e-4)
    assert all(g.masks[j].allows(int(t)) for t, j in zip(rows.tokens, g.row_mask) if j >= 0)
    if top_k == 1:
        np.testing.assert_array_equal(rows.tokens, z.argmax(-1))
    top = np.argsort(-z, axis=1)[:, :5]
    for r in range(8):
        order = np.argsort(-rows.top_logits[r])
        assert rows.top_ids[r][order].tolist() == top[r].tolist()
        np.testing.assert_allclose(rows.top_probs[r][order], p[r, top[r]], rtol=1e-4)
        np.testing.assert_array_equal(rows.top_logits[r][order], z[r, top[r]].astype(np.float32))
    np.testing.assert_array_equal(rows.token_z, z[np.arange(8), rows.tokens].astype(np.float32))


def test_the_last_row_is_kept_raw_for_a_token_asked_for_later(big_gguf):
    """save_last: after a causal pass with the selection in the graph (no logits copied), any token's raw logit in
    its last row reads back exact; a pass that saves nothing leaves a sampler without a saved row refusing."""
    rng = np.random.default_rng(21)
    with LlamaContext(big_gguf, n_ctx=256, n_threads=2) as ctx:
        prompt = [int(t) for t in rng.integers(0, 1000, 9)]
        ctx.decode(prompt[:-3], 0, logits=False)
        raw = ctx.decode(prompt[-3:], len(prompt) - 3)  # three rows, as llama.cpp computes them
        ctx.clear()
        ctx.decode(prompt[:-3], 0, logits=False)
        g = Gather(ids=np.array([5, 7], dtype=np.int32), n_rows=3, width=32, probs=True, save_last=True, top_n=3)
        rows = ctx.decode(prompt[-3:], len(prompt) - 3, gather=g)
        for t in [0, 5, int(raw[2].argmax()), *rng.integers(0, V_BIG, 20).tolist(), V_BIG - 1]:
            assert rows.saved(t) == raw[2, t]
        with pytest.raises(ValueError):
            rows.saved(V_BIG)
        lib = sampler_library(ctx.L)
        s = lib.clover_sampler_init_ext(V_BIG, 32, True, 0.0, 0, 1.0, 0, True)
        out = ctypes.c_float()
        assert lib.clover_sampler_saved_logit(s, 0, ctypes.byref(out)) == -1  # made, never saved
        ctx.L.llama_sampler_free(s)


def test_a_width_whose_outputs_do_not_fit_a_row_is_refused_not_aborted(small_gguf):
    """Issue 52: a gather wider than what llama.cpp's output row holds (n_vocab values; greedy: width + chunks + 1 +
    top_n, sampled: width + 1 + top_n) made llama.cpp abort the process (GGML_ASSERT n_elements <= stride). The
    sampler refuses it (NULL), the runtime says so in one ValueError, and the widest width it takes works."""
    with LlamaContext(small_gguf, n_ctx=256, n_threads=2) as ctx:
        lib = sampler_library(ctx.L)
        v = ctx.n_vocab
        m = v // lib.clover_sampler_chunk(v)
        for temp, top_n, fit in ((0.0, 0, v - m - 1), (0.0, 5, v - m - 6), (1.0, 0, v - 1), (1.0, 7, v - 8)):
            assert ctx.gather_limit(temp > 0, top_n) == fit
            s = lib.clover_sampler_init_ext(v, fit, True, temp, 0, 1.0, top_n, False)
            assert s
            ctx.L.llama_sampler_free(s)
            assert not lib.clover_sampler_init_ext(v, fit + 1, True, temp, 0, 1.0, top_n, False)
        assert not lib.clover_sampler_init(v, 512, True, 0.0, 0, 1.0)  # issue 52's width on this 448 vocabulary
        assert not lib.clover_sampler_init_ext(v, 32, True, 0.0, 0, 1.0, 65, False)  # top_n past the most
        ids = ctx.tokenize("Count from 3 to 9.")
        flags = [False] * (len(ids) - 1) + [True]
        with pytest.raises(ValueError, match="refused its settings"):
            ctx.decode(ids, 0, logits=flags, gather=Gather(ids=np.array([3], dtype=np.int32), n_rows=1, width=512))
        ctx.clear()
        raw = ctx.decode(ids, 0, logits=flags)
        ctx.clear()
        want = np.arange(v - m - 1, dtype=np.int32)  # every id but the last m + 1: the widest gather
        rows = ctx.decode(ids, 0, logits=flags, gather=Gather(ids=want, n_rows=1, width=v - m - 1))
        _check_greedy(rows, raw, want, v - m - 1, True)


def test_bad_masks_are_refused(small_gguf):
    """A mask index out of range, a mask that allows nothing, more ids than the width: -1 through the C API and
    one ValueError through the runtime."""
    from clover_gguf.constraint import Mask

    with LlamaContext(small_gguf, n_ctx=128, n_threads=2) as ctx:
        lib = sampler_library(ctx.L)
        v = ctx.n_vocab
        s = lib.clover_sampler_init_ext(v, 8, True, 0.0, 0, 1.0, 0, False)
        ids = (ctypes.c_int32 * 1)(3)

        def put(words, rows, width_ok=True):
            w = np.ascontiguousarray(np.stack(words), dtype=np.int32)
            r = np.ascontiguousarray(rows, dtype=np.int32)
            return lib.clover_sampler_set_inputs_ext(s, ids, 1, len(rows), None, 0, None, w.ctypes.data,
                                                     w.shape[1], w.shape[0], r.ctypes.data)

        few = Mask.of([1, 2, 3], v).words
        assert put([few], [0, -1]) == 3  # id 3 given, 1 and 2 added
        assert put([few], [1, 0]) == -1 and put([few], [-2, 0]) == -1
        assert put([np.zeros_like(few)], [0]) == -1  # allows nothing
        assert put([Mask.of(range(20), v).words], [0]) == -1  # 20 ids taken past a width of 8
        ctx.L.llama_sampler_free(s)
        prompt = ctx.tokenize("Count from 3 to 9.")
        g = Gather(ids=np.array([3], dtype=np.int32), n_rows=1, width=8, masks=[Mask.of(range(20), v)],
                   row_mask=np.array([0], dtype=np.int32))
        with pytest.raises(ValueError, match="refused its inputs"):
            ctx.decode(prompt, 0, logits=[False] * (len(prompt) - 1) + [True], gather=g)


def test_selection_with_masks_and_logprobs_in_the_graph_equals_numpy(big_gguf):
    """controls.Selector on a 32-row block pass at V = 248,320, the card's controls made to bite, rows restricted by a
    string mask, structure masks and nothing: the graph's choice (tokens, confidences, asked probabilities, the
    logprobs of the chosen and of other computed tokens, the top 20 in order) equals the dense numpy selection on
    the same raw rows."""
    from clover_gguf.controls import Controls, Histories, Selector, make_processors

    biting = Controls(presence_penalty=5.0, frequency_penalty=1.0, repetition_penalty=2.0)
    rng = np.random.default_rng(8)
    with LlamaContext(big_gguf, n_ctx=256, n_threads=2) as ctx:
        prompt = [int(t) for t in rng.integers(0, 1000, 12)]
        ctx.decode(prompt, 0, logits=False)
        block = [int(t) for t in rng.integers(0, V_BIG, 32)]
        raw = ctx.block(block, len(prompt))
        answer = [int(raw[0].argmax()), int(raw[1].argmax()), *rng.integers(0, V_BIG, 6).tolist()]
        h = Histories(answer, [], [0] * 32)
        procs = make_processors(biting, [V_BIG - 1], None, None)
        masks = [string_mask(), structure_mask(extra=[int(raw[1].argmax())]), None, structure_mask(seed=7)] * 8
        dense = Selector(procs, None, [V_BIG - 1], never=[V_BIG - 2]).choose(h, raw, masks=masks)
        sel = Selector(procs, None, [V_BIG - 1], never=[V_BIG - 2])
        g = sel.gather(h, want=answer[:3], masks=masks, logprobs=20)
        got = sel.choose(h, ctx.block(block, len(prompt), gather=g), g)
    np.testing.assert_array_equal(got.tokens, dense.tokens)
    assert not np.array_equal(dense.tokens, raw.argmax(-1))  # the masks and controls decided
    np.testing.assert_allclose(got.conf, dense.conf, rtol=1e-5)
    for i in range(32):
        for t in answer[:3]:
            assert got.prob(i, t) == pytest.approx(dense.prob(i, t), rel=1e-4, abs=1e-12)
            assert got.logprob(i, t) == pytest.approx(dense.logprob(i, t), abs=2e-5)
        assert got.logprob(i, int(got.tokens[i])) == pytest.approx(dense.logprob(i, int(dense.tokens[i])), abs=2e-5)
        top_g, top_d = got.top(i, 20), dense.top(i, 20)
        assert [t for t, _ in top_g] == [t for t, _ in top_d], i
        np.testing.assert_allclose([v for _, v in top_g], [v for _, v in top_d], atol=2e-5)
        assert len(top_d) == (20 if masks[i] is None or masks[i].n_allowed > 20 else masks[i].n_allowed)


def test_the_sampler_keeps_to_llama_cpps_sampler_interface():
    """clover-sampler-test (clover_gguf/csrc/clover_sampler_test.cpp, built beside the library by build-llama) drives
    the sampler through llama.cpp's public sampler interface alone: the calls it does not know (several rows in one
    call, a 3-D tensor, an I32 row, a view of a row of a 3-D tensor, an announced row of another length, a row a
    sampler before it narrowed) are refused and marked so (llama_sampler_data.refused), the data left as it was, the
    reason in llama.cpp's log and kept; the calls of build_sampling (rows of the padded logits copy, each read as
    passed, calls for no row, llama.cpp's probe row) are known; the greedy choices are the rows' argmax (a sequence's
    rows interleaved with another's too), with coefficients and a bitmask row that decide, each call taking the inputs
    of its llama_sampler_data.row whatever the order of the calls; a clone (settings, inputs, restrictions, row limit)
    gives the same.
    Planted breaks: the k-th call taken for the k-th row again (data.row ignored) -> 1 check FAILED (the call
    order); refuse() not marking the call -> 5 checks FAILED; round 4's library (rows read through view_src, calls
    counted, refusals unmarked) -> 14 checks FAILED."""
    import subprocess

    from clover_gguf.build import SAMPLER_TEST, find_library

    info = find_library()
    assert info is not None, "no llama.cpp build: run `clover-gguf build-llama`"
    p = subprocess.run([str(info.tool(SAMPLER_TEST))], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "all checks passed" in p.stdout, p.stdout + p.stderr


def test_a_call_the_sampler_does_not_know_fails_the_decode_naming_why(small_gguf, monkeypatch):
    """Through llama.cpp itself: a chain with upstream's top-k before our sampler makes build_sampling pass it a row
    already narrowed to 50 candidates, a call it does not know. It refuses (nothing computed on a guess), llama.cpp's
    log says why, and the decode is a RuntimeError naming the reason instead of rows read as if they were ours."""
    from clover_gguf.llama_context import capture_llama_log

    with LlamaContext(small_gguf, n_ctx=128, n_threads=2) as ctx:
        ids = ctx.tokenize("Count from 3 to 9.")
        last = [False] * (len(ids) - 1) + [True]
        g = Gather(ids=np.array([3, 5], dtype=np.int32), n_rows=1, width=32)
        rows = ctx.decode(ids, 0, logits=last, gather=g)  # a chain of its own: known calls, no refusal
        assert rows.tokens.shape == (1,) and ctx._sampler.clover_sampler_error(ctx._selectors[0][1]) is None
        ctx.clear()
        ctx._select_off(0)

        L = ctx.L
        chain_init = L.llama_sampler_chain_init

        def with_top_k_first(params):
            chain = chain_init(params)
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_k(50))
            return chain

        monkeypatch.setattr(L, "llama_sampler_chain_init", with_top_k_first)
        codes = []
        decode = L.llama_decode

        def recorded(*args):
            codes.append(decode(*args))
            return codes[-1]

        monkeypatch.setattr(L, "llama_decode", recorded)
        with capture_llama_log() as log, pytest.raises(RuntimeError, match=r"refused this decode's rows \(sequence 0: "
                                                       r".*a sampler before it in its chain narrowed"):
            ctx.decode(ids, 0, logits=last, gather=Gather(ids=np.array([3, 5], dtype=np.int32), n_rows=1, width=32))
        assert log.grep(r"clover_sampler: refused row 0 of a sampling graph \(1 rows announced\): a sampler before")
        # the decode itself failed (the series' llama_sampler_data.refused -> llama_decode -4), nothing was computed:
        # the prompt is not in the memory
        assert codes == [-4], codes
        assert L.llama_memory_seq_pos_max(L.llama_get_memory(ctx.ctx), 0) == -1


def test_sampled_rows_are_read_where_llamas_getters_put_each_row(small_gguf):
    """The runtime reads each output row through llama.cpp's _ith getters at its batch index, not n rows at a stride
    from the first row's address: with getters that place the rows of a 4-row decode every other row of a buffer
    (NaN between them: a layout llama.cpp is free to have), the rows read are the same as from llama.cpp's own
    getters, greedy and sampled."""
    with LlamaContext(small_gguf, n_ctx=128, n_threads=2) as ctx:
        ids = ctx.tokenize("Count from 3 to 9.")
        last4 = [False] * (len(ids) - 4) + [True] * 4
        first, v = len(ids) - 4, ctx.n_vocab
        for g in (Gather(ids=np.array([3, 5], dtype=np.int32), n_rows=4, width=32, probs=True),
                  Gather(ids=np.array([3, 5], dtype=np.int32), n_rows=4, width=32, temp=0.8, top_n=3,
                         coef=np.stack([np.ones((4, 2)), np.ones((4, 2)), np.zeros((4, 2))]).astype(np.float32),
                         uniform=np.linspace(0.1, 0.9, 4).astype(np.float32))):
            ctx.clear()
            want = ctx.decode(ids, 0, logits=last4, gather=g)
            real = ctx._api
            bufs = {}  # getter name -> [8, V]: batch row first + j at row 2 j, NaN (or -1) elsewhere
            for name in ("llama_get_sampled_logits_ith", "llama_get_sampled_probs_ith",
                         "llama_get_sampled_candidates_ith"):
                dtype = np.int32 if "candidates" in name else np.float32
                buf = np.full((8, v), -1 if dtype == np.int32 else np.nan, dtype=dtype)
                for j in range(4):
                    addr = getattr(real, name)(ctx.ctx, first + j)
                    if not addr:
                        buf = None
                        break
                    buf[2 * j] = np.frombuffer((ctypes.c_char * (v * 4)).from_address(addr), dtype=dtype)
                bufs[name] = buf

            class Spaced:
                def __getattr__(self, name):
                    if name in bufs:
                        held = bufs[name]
                        return lambda c, i: held[2 * (i - first)].ctypes.data if held is not None else None
                    return getattr(real, name)

            ctx._api, ctx._views = Spaced(), {}
            try:
                got = ctx._graph_rows(first, 4, g, 0)
            finally:
                ctx._api, ctx._views = real, {}
            for field in ("at_ids", "rest_ids", "rest_logits", "rest_probs", "tokens", "token_logits", "token_probs",
                          "top_ids", "top_probs", "top_logits"):
                a, b = getattr(want, field), getattr(got, field)
                assert (a is None) == (b is None), field
                if a is not None:
                    np.testing.assert_array_equal(a, b, err_msg=field)
