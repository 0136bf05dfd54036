"""Selection in the graph (controls.Selector on GraphRows) against selection on dense logits: the same tokens,
confidences and accept / reject decisions. The graph is simulated here in numpy, float32 as llama.cpp computes it
(libclover_sampler: the processed logits at the gathered ids, each chunk's largest of the rest and its softmax
probability there, the row's choice); tests/test_sampler_lib.py checks the real one against numpy,
tests/test_runtime_tiny.py decodes with it."""

from __future__ import annotations

import numpy as np
import pytest

from clover_gguf.controls import Controls, GraphRows, Histories, Selector, make_processors, thinking_spans
from clover_gguf.decoding import GraphBackend, generate_all
from test_decoding import BITING, EOS, MASK, PROMPT, V, FakeBackend, _HashModel

THINK, THINK_END = 7, 8  # as BITING's test in test_decoding plays them


class Float32(FakeBackend):
    """A FakeBackend whose logits are float32, as llama.cpp's are."""

    def commit(self, ids):
        return super().commit(ids).astype(np.float32)

    def block_logits(self, block):
        return super().block_logits(block).astype(np.float32)


class GraphSim(Float32):
    """The graph's selection rows, computed in numpy from the dense logits (float32 softmax): the vocabulary read in
    chunks of `chunk` ids."""

    def __init__(self, *a, chunk: int = 4, shuffle: int = 0, shuffle_ties: bool = False, **kw):
        super().__init__(*a, **kw)
        self.chunk, self.rng, self.shuffle_ties = chunk, np.random.default_rng(shuffle), shuffle_ties
        self.gathers = []

    def rows(self, logits: np.ndarray, gather) -> GraphRows:
        self.gathers.append(gather)
        x = np.asarray(logits, dtype=np.float32)
        t = np.arange(len(x))[:, None]
        ids = gather.padded_ids()  # [T, width]
        at = x[t, ids]
        if gather.coef is not None:  # the processors' coefficients, in float32 as the graph applies them
            c = gather.padded_coef()
            at = at * np.where(at > 0, c[0], c[1]) + c[2]
        m = x.copy()
        m[t, ids] = -np.inf
        c = self.chunk
        mc = m.reshape(len(x), -1, c)  # [T, n, c]
        local = np.argmax(mc, axis=-1)
        if self.shuffle_ties:  # the graph's top-1 of a chunk picks any of equal logits
            local = np.asarray([[self.rng.choice(np.flatnonzero(row == row.max())) for row in r] for r in mc])
        best = np.take_along_axis(mc, local[..., None], -1)[..., 0]
        with np.errstate(invalid="ignore"):
            e = np.exp(mc - best[..., None], dtype=np.float32)
            p = (1.0 / e.sum(-1, dtype=np.float32)).astype(np.float32)  # the chunk maximum's probability there
        rest_ids = local + np.arange(mc.shape[1]) * c
        # the choice: the largest of both sides, the lowest id among equal ones
        values, cand = np.concatenate([at, best], 1), np.concatenate([ids, rest_ids], 1)
        top = values.max(-1)
        tokens = np.where(values == top[:, None], cand, np.iinfo(np.int64).max).min(-1)
        return GraphRows(at_ids=at, rest_ids=rest_ids, rest_logits=best, rest_probs=p if gather.probs else None,
                         tokens=tokens, token_logits=top)

    def prefill_rows(self, ids, gather):
        logits = self.prefill(ids)
        return None if gather is None else self.rows(logits[None], gather)

    def commit_rows(self, ids, gather):
        logits = self.commit(ids)
        return None if gather is None else self.rows(logits, gather)

    def block_rows(self, block, positions, gather):
        return self.rows(self.block_logits(block)[list(positions)], gather)


class _Model(_HashModel):
    """_HashModel with confidences drawn from an interval, not three values: no two positions tie exactly (a tie
    would be broken by float rounding, differently in float64 and float32)."""

    def guess(self, tok, rng):
        probs = rng.dirichlet(np.ones(V)) * 0.1
        probs[tok] += rng.uniform(0.4, 0.999)
        return np.log(probs / probs.sum())


def test_the_simulation_is_a_graph_backend():
    m = _HashModel(0)
    assert isinstance(GraphSim(m.causal, m.block), GraphBackend)
    assert not isinstance(Float32(m.causal, m.block), GraphBackend)


CONTROLS = {"off": None, "card": Controls(), "biting": BITING}


@pytest.mark.parametrize("controls", list(CONTROLS))
@pytest.mark.parametrize("mode, accept, end_rule", [
    ("ar", "exact", "prefix"), ("diffusion", "exact", "prefix"), ("diffusion", "exact", "tail"),
    ("draft-self", "exact", "prefix"), ("draft-self", "threshold", "plain")])
def test_graph_selection_decodes_as_dense_selection(controls, mode, accept, end_rule):
    """Every mode, the card's controls off, on and biting: tokens, passes and drafts equal, pass by pass (20 models:
    with the "tail" rule these answers often end within a block, and the controls change only some of them)."""
    changed = 0
    for seed in range(20):
        m = _Model(seed)
        c = CONTROLS[controls]
        procs = make_processors(c, [EOS], THINK, THINK_END) if c else ()
        kw = dict(mode=mode, max_new_tokens=40, accept=accept, end_rule=end_rule, threshold=0.9,
                  logits_processors=procs)
        dense_be, graph_be = Float32(m.causal, m.block), GraphSim(m.causal, m.block, shuffle=seed)
        want, want_stats = generate_all(dense_be, PROMPT, **kw)
        got, got_stats = generate_all(graph_be, PROMPT, **kw)
        assert got == want, seed
        assert got_stats == want_stats, seed
        assert graph_be.calls == dense_be.calls  # the same passes over the same tokens
        assert graph_be.gathers, "the graph path was not taken"
        if c:
            plain, _ = generate_all(Float32(m.causal, m.block), PROMPT, **{**kw, "logits_processors": ()})
            changed += plain != want
    if controls == "biting":
        assert changed >= 3  # the controls decided tokens: the sparse path had to reproduce them


def _case(seed: int, n_rows: int = 6, prefix_len: int = 30, tail_len: int = 8):
    rng = np.random.default_rng(seed)
    toks = [0, 1, 2, 3, 5, EOS, THINK, THINK_END]
    prefix = rng.choice(toks, size=prefix_len).tolist()
    tail = rng.choice(toks, size=tail_len).tolist()
    lens = sorted(rng.integers(0, tail_len + 1, size=n_rows).tolist())
    logits = (rng.normal(size=(n_rows, V)) * 3).astype(np.float32)
    return Histories(prefix, tail, lens), logits


@pytest.mark.parametrize("seed", range(8))
def test_a_choice_from_the_graph_equals_the_dense_one(seed):
    """Tokens equal, confidences and any asked probability to float32 precision, best_of equal."""
    h, logits = _case(seed)
    c = Controls(length_penalty_start=20, length_penalty_ramp=10, think_end_bias_start=2, think_end_bias_ramp=3,
                 presence_penalty=1.5, repetition_penalty=1.3, frequency_penalty=0.4)
    for at_start in (False, True):
        procs = make_processors(c, [EOS, MASK], THINK, THINK_END, at_start)
        dense = Selector(procs, None, [EOS]).choose(h, logits)
        sel = Selector(procs, None, [EOS])
        g = sel.gather(h, want=[4, 9])
        sim = GraphSim(lambda ctx: None, chunk=3, shuffle=seed)
        got = sel.choose(h, sim.rows(logits, g), g)
        np.testing.assert_array_equal(got.tokens, dense.tokens)
        np.testing.assert_allclose(got.conf, dense.conf, rtol=2e-6)
        for i in range(len(h)):
            for tok in (4, 9, EOS, THINK_END, int(dense.tokens[i])):
                if tok in got.col:
                    assert got.prob(i, tok) == pytest.approx(dense.prob(i, tok), rel=2e-6, abs=1e-12)
            assert got.best_of(i, [EOS, MASK]) == dense.best_of(i, [EOS, MASK])


def test_ties_go_to_the_lowest_id_on_both_sides_of_the_gather():
    h = Histories([], [], [0, 0, 0])
    logits = np.zeros((3, V), dtype=np.float32)
    logits[0, [3, 6]] = 5.0  # two ungathered ids tie, in two chunks of 4
    logits[1, [2, EOS]] = 5.0  # an ungathered id ties with a gathered one (EOS), the ungathered lower
    logits[2, [EOS, 11]] = 5.0  # the gathered one lower
    sel = Selector((), None, [EOS])
    g = sel.gather(h)
    got = sel.choose(h, GraphSim(lambda ctx: None, chunk=4).rows(logits, g), g)
    assert got.tokens.tolist() == Selector((), None, [EOS]).choose(h, logits).tokens.tolist() == [3, 2, EOS]


def test_prefix_occurrences_and_spans_follow_a_growing_answer():
    """The selector's running counts of the answer (kept as it grows) and the rows' thinking spans equal the dense
    reading of each row's whole history."""
    rng = np.random.default_rng(3)
    out: list[int] = []
    sel = Selector(make_processors(BITING, [EOS], THINK, THINK_END, True), None, [EOS])
    from clover_gguf.controls import _Rows

    for step in range(12):
        out += rng.choice([0, 1, 2, THINK, THINK_END, 5], size=int(rng.integers(0, 4))).tolist()
        tail = rng.choice([0, 1, 2, THINK, THINK_END, 6], size=5).tolist()
        h = Histories(out, tail, [0, 2, 5])
        g = sel.gather(h)
        rows = _Rows(h, sel.stats, g.ids, g.columns)
        for i, hist in enumerate(h):
            want = [hist.count(int(t)) for t in g.ids]
            assert rows.counts()[i].tolist() == want, (step, i)
        assert rows.spans(THINK, THINK_END, True) == thinking_spans(list(h), THINK, THINK_END, True)


@pytest.mark.parametrize("how", ["copies", "a slice, then the answer", "a diverging copy"])
def test_prefix_counts_carry_over_to_another_list_with_the_same_start(how):
    """Diffusion commits a block with a slice of the answer as its prefix, then passes the answer itself: the counts
    go on from the tokens they saw when a new list starts with them (no rescan), and start over when it does not;
    either way they equal the dense reading of each row's history."""
    from clover_gguf.controls import _Rows

    rng = np.random.default_rng(4)
    out: list[int] = []
    sel = Selector(make_processors(BITING, [EOS], THINK, THINK_END, True), None, [EOS])
    for step in range(10):
        out += rng.choice([0, 1, 2, THINK, THINK_END, 5], size=int(rng.integers(1, 4))).tolist()
        if how == "copies":
            prefix = list(out)
        elif how == "a slice, then the answer":
            prefix = out[:len(out) - 1] if step % 2 else out
        else:
            prefix = list(out)
            if step == 6:  # a different answer of the same length: the counts must start over
                prefix[0] = 7 if prefix[0] != 7 else 8
                out = prefix
        counted = sel.stats.seen  # a reset makes a new list
        h = Histories(prefix, [1, 2], [0, 2])
        g = sel.gather(h)
        rows = _Rows(h, sel.stats, g.ids, g.columns)
        for i, hist in enumerate(h):
            assert rows.counts()[i].tolist() == [hist.count(int(t)) for t in g.ids], (how, step, i)
        started_over = sel.stats.seen is not counted
        assert started_over == (how == "a diverging copy" and step == 6), (how, step)
