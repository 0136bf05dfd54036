"""Constrained output and logprobs in the decoders (clover_gguf.decoding) on fake backends: every kept token is one
the grammar allows, in every mode, greedy and sampled, on dense logits and through a simulation of the graph's
selection; constrained greedy draft-self and auto give constrained greedy AR's text; the grammar is rolled back to
what is kept; logprobs are the log-softmax of the processed rows, computed independently here from the model's
causal rows. tests/test_sampler_lib.py checks the real sampler's restricted rows and top-n against numpy, and
tests/test_runtime_constrained.py decodes through llama.cpp and MLX."""

from __future__ import annotations

import numpy as np
import pytest

from clover_gguf import decoding
from clover_gguf.controls import Controls, GraphRows, Sampling, make_processors, process
from clover_gguf.decoding import TOP_LOGPROBS_MAX, generate, generate_all
from test_decoding import BITING, EOS, MASK, PROMPT, V
from test_selection import THINK, THINK_END, Float32, GraphSim, _Model
from clover_gguf.testing.automaton import TokenAutomaton, replay

WORDS = range(10)  # the fake models' ordinary tokens (EOS 10, MASK 11)


# ---- grammars over the fake vocabulary ------------------------------------------------------------------------
def alternating(length: int = 9, may_end: int = 3):
    """Parities alternate; the answer may end after `may_end` tokens and is finished after `length`."""
    def allowed(s):
        n, last = s
        words = [t for t in WORDS if last is None or t % 2 != last]
        return (words if n < length else []) + ([EOS] if n >= may_end else [])
    return lambda: TokenAutomaton(V, (0, None), allowed, lambda s, t: (s[0] + 1, t % 2), [EOS],
                                  lambda s: s[0] >= length)


def ascending():
    """Each token above the one before (the state: the last one); finished after 9; may end after two tokens."""
    def allowed(s):
        last, n = s
        return [t for t in WORDS if t > last] + ([EOS] if n >= 2 else [])
    return lambda: TokenAutomaton(V, (-1, 0), allowed, lambda s, t: (t, s[1] + 1), [EOS], lambda s: s[0] == 9)


def random_dfa(seed: int, states: int = 5):
    """A random automaton: each state allows 2..6 words, goes to a random state on each; some states may end."""
    rng = np.random.default_rng([seed, 77])
    allow = [sorted(rng.choice(10, size=int(rng.integers(2, 7)), replace=False).tolist()) for _ in range(states)]
    nxt = rng.integers(0, states, size=(states, 10))
    final = rng.random(states) < 0.4
    final[0] = False
    return lambda: TokenAutomaton(V, 0, lambda s: allow[s] + ([EOS] if final[s] else []),
                                  lambda s, t: int(nxt[s, t]), [EOS])


# a form with fixed parts: each position allows one word alone (a list of one: forced) or a choice of them
FORM = [[3], [1], [4], [0, 2, 5, 7], [1], [5], [2, 6, 8], [1, 3], [9], [2], [6], [5], [3], [0, 4, 8], [5], [8],
        [9], [7], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [9], [3], [2]]


def form(fields=FORM):
    """The positions of `fields` in order (state: how many written), then only the end: half of it forced."""
    return lambda: TokenAutomaton(V, 0, lambda s: fields[s] if s < len(fields) else [EOS], lambda s, t: s + 1, [EOS],
                                  lambda s: s >= len(fields))


GRAMMARS = {"alternating": alternating, "ascending": ascending, "dfa": lambda: random_dfa(3), "form": form}


class Sim(GraphSim):
    """The graph's selection simulated (test_selection.GraphSim) with what constrained output and logprobs add: the
    rows' masks applied (-inf where a row's mask does not allow), the processed rows' top-n, the last row kept."""

    def rows(self, logits, gather) -> GraphRows:
        raw = np.asarray(logits, dtype=np.float32)
        out = super().rows(gather.restrict(raw), gather)
        if gather.top_n:
            z = gather.restrict(raw).copy()
            t = np.arange(len(z))[:, None]
            z[t, gather.padded_ids()] = out.at_ids
            out.top_ids = np.argsort(-z, axis=1, kind="stable")[:, :gather.top_n][:, ::-1].copy()  # any order
            out.top_logits = np.take_along_axis(z, out.top_ids, 1)
        if gather.save_last:
            last = raw[-1].copy()
            out.saved = lambda tok: float(last[tok])
        return out


def _run(backend, grammar, **kw):
    g = grammar()
    out, reason, lps, chunks = [], None, [], []
    for ch in generate(backend, PROMPT, constraint=g, **kw):
        out += ch.tokens
        chunks.append(ch)
        if ch.logprobs is not None:
            assert len(ch.logprobs) == len(ch.tokens)
            lps += ch.logprobs
        reason = ch.stats.finish_reason
    return out, reason, lps, g, chunks[-1].stats


MODES = [("ar", "exact", "prefix"), ("diffusion", "exact", "prefix"), ("diffusion", "exact", "tail"),
         ("diffusion", "exact", "plain"), ("diffusion", "exact", "strict"), ("draft-self", "exact", "prefix"),
         ("draft-self", "threshold", "plain"), ("auto", "exact", "prefix")]


@pytest.fixture(params=[1024, 0], ids=["cheap-applied", "wide-checked"])
def cheap(request, monkeypatch):
    """CHEAP_MASK_IDS as shipped (every fake mask is cheap: applied in every pass), and 0 (every mask wide: only
    one-row passes and those needing probabilities apply it; the rest are checked, a refused choice chosen again)."""
    monkeypatch.setattr(decoding, "CHEAP_MASK_IDS", request.param)
    return request.param


@pytest.mark.parametrize("grammar", list(GRAMMARS))
@pytest.mark.parametrize("graph", [False, True], ids=["dense", "graph"])
def test_constrained_greedy_draft_self_and_auto_give_constrained_ar(grammar, graph, cheap):
    """20 random models, the card's controls biting: draft-self and auto (exact) keep AR's constrained text and finish
    reason, the backend holds exactly the kept tokens, and the grammar's state is the answer's. The grammar changes
    the text of most answers."""
    changed = 0
    for seed in range(20):
        m = _Model(seed)
        procs = make_processors(BITING, [EOS], THINK, THINK_END)
        kw = dict(max_new_tokens=30, logits_processors=procs, threshold=0.9)
        be = (lambda: Sim(m.causal, m.block)) if graph else (lambda: Float32(m.causal, m.block))
        want, why, _, g_ar, _ = _run(be(), GRAMMARS[grammar](), mode="ar", **kw)
        assert replay(GRAMMARS[grammar](), want, why == "stop") is None
        for mode in ("draft-self", "auto"):
            b = be()
            got, reason, _, g, stats = _run(b, GRAMMARS[grammar](), mode=mode, **kw)
            assert (got, reason) == (want, why), (seed, mode)
            assert b.n_past == len(PROMPT) + len(got) - (reason == "length")  # a cut answer's last is not committed
            assert len(g.states) - 1 == len(got)  # the grammar holds the kept tokens, nothing rejected
        plain, _ = generate_all(be(), PROMPT, mode="ar", **kw)
        changed += plain != want
    assert changed >= 12


@pytest.mark.parametrize("mode, accept, end_rule", MODES)
@pytest.mark.parametrize("grammar", list(GRAMMARS))
def test_every_kept_token_is_allowed_in_every_mode(mode, accept, end_rule, grammar, cheap):
    """Greedy on dense logits and through the graph's simulation, sampled at temperature 1.5 (and threshold
    acceptance at 0: every draft token would pass it without the grammar's check): every answer follows the grammar,
    and the grammar holds exactly its tokens."""
    for seed in range(8):
        m = _Model(seed)
        runs = [(Float32(m.causal, m.block), None), (Sim(m.causal, m.block), None),
                (Float32(m.causal, m.block), Sampling(1.5, seed=seed))]
        for be, sampler in runs:
            for threshold in ((0.9, 0.0) if accept == "threshold" else (0.9,)):
                got, reason, _, g, _ = _run(be, GRAMMARS[grammar](), mode=mode, accept=accept, end_rule=end_rule,
                                            threshold=threshold, sampler=sampler, max_new_tokens=24)
                assert replay(GRAMMARS[grammar](), got, reason == "stop") is None, (seed, type(be), sampler, got)
                assert len(g.states) - 1 == len(got) or reason == "length", (seed, got, len(g.states))


@pytest.mark.parametrize("mode", ["ar", "diffusion", "draft-self", "auto"])
def test_a_finished_grammar_lets_only_an_end_token_follow(mode):
    """A grammar finished after five tokens that allows no end token before: every answer is five tokens and
    stops, though the models would go on (they end after about 15 tokens on their own)."""
    for seed in range(10):
        m = _Model(seed)
        got, reason, _, _, _ = _run(Float32(m.causal, m.block), alternating(5, may_end=5), mode=mode,
                                    max_new_tokens=30)
        assert len(got) == 5 and reason == "stop", (seed, got, reason)


def _reference_logprobs(m, answer, grammar, procs, n_top):
    """Per answer token: (its logprob, the top n_top (token, logprob)) under the causal row that predicts it, computed
    here from the model's own causal function: float32 logits, the processors, the mask token excluded, the grammar's
    mask at that point, then log-softmax in float64."""
    g = grammar()
    out = []
    for j, t in enumerate(answer):
        row = np.asarray(m.causal(PROMPT + answer[:j]), dtype=np.float32)[None]
        x = process(procs, [answer[:j]], row)[0].astype(np.float64)
        x[MASK] = -np.inf
        allowed = g.allowed() if not g.finished() else frozenset({EOS})
        x[[i for i in range(V) if i not in allowed]] = -np.inf
        lse = np.log(np.exp(x - x.max()).sum()) + x.max()
        order = sorted((i for i in range(V) if np.isfinite(x[i])), key=lambda i: (-x[i], i))[:n_top]
        out.append((x[t] - lse, [(i, x[i] - lse) for i in order]))
        assert g.accept(t)
    return out


@pytest.mark.parametrize("mode, accept", [("ar", "exact"), ("diffusion", "exact"), ("draft-self", "exact"),
                                          ("draft-self", "threshold"), ("auto", "exact")])
@pytest.mark.parametrize("graph", [False, True], ids=["dense", "graph"])
@pytest.mark.parametrize("n_top", [0, 3])
def test_logprobs_are_the_log_softmax_of_the_processed_causal_rows(mode, accept, graph, n_top, cheap):
    """Every kept token's logprob and its row's top alternatives (most likely first, the lower id among equal ones)
    equal the log-softmax of the causal row that predicts it, processed (card's controls biting, the grammar's mask),
    computed independently from the model; greedy and sampled (temperature 1 logprobs whatever the draw's
    temperature). Asking for logprobs leaves the text as it is."""
    procs = make_processors(BITING, [EOS], THINK, THINK_END)
    for seed in range(6):
        m = _Model(seed)
        for sampler in ([None] if graph else [None, Sampling(1.3, seed=seed)]):
            be = Sim(m.causal, m.block) if graph else Float32(m.causal, m.block)
            kw = dict(mode=mode, accept=accept, threshold=0.9, max_new_tokens=20, logits_processors=procs)
            got, reason, lps, _, _ = _run(be, alternating(12), sampler=sampler, logprobs=n_top, **kw)
            assert [lp.token for lp in lps] == got
            want = _reference_logprobs(m, got, alternating(12), procs, n_top)
            for lp, (ref, top) in zip(lps, want):
                assert lp.logprob == pytest.approx(ref, abs=1e-5)
                assert [t for t, _ in lp.top] == [t for t, _ in top]
                np.testing.assert_allclose([v for _, v in lp.top], [v for _, v in top], atol=1e-5)
            if sampler is None:
                plain = _run(Float32(m.causal, m.block), alternating(12), **kw)[0]
                assert plain == got


def test_logprobs_are_checked():
    m = _Model(0)
    for bad in (-1, TOP_LOGPROBS_MAX + 1, True, 2.0):
        with pytest.raises(ValueError, match="logprobs"):
            generate_all(Float32(m.causal, m.block), PROMPT, mode="ar", logprobs=bad)


def test_without_a_constraint_or_logprobs_the_passes_are_unchanged():
    """A run asking for neither makes the same passes with the same gathers as before (no masks, no top-n, nothing
    kept): the chunks carry no logprobs."""
    m = _Model(1)
    for mode in ("ar", "diffusion", "draft-self"):
        be = Sim(m.causal, m.block)
        chunks = list(generate(be, PROMPT, mode=mode, max_new_tokens=20, logits_processors=make_processors(
            Controls(), [EOS], THINK, THINK_END)))
        assert all(c.logprobs is None for c in chunks)
        assert all(g.masks is None and g.top_n == 0 and not g.save_last for g in be.gathers)


@pytest.mark.parametrize("draft_threshold", [None, 0.5], ids=["card-drafts", "drafts-stop-at-a-stall"])
def test_a_wide_mask_is_checked_not_applied_in_passes_of_several_rows(monkeypatch, draft_threshold):
    """With every mask wide (CHEAP_MASK_IDS 0): verifications of several rows gather no mask, block passes restrict
    only their head and only after a pass chose a token the head does not allow (a minority of them), one-row passes
    apply theirs; the answers still follow the grammar and equal AR's. With drafts that stop at a stall (a
    draft_threshold: decoding.STOP_AT_STALL) too: a head the grammar refused is not a stall, so the pass that restricts
    it still comes."""
    monkeypatch.setattr(decoding, "CHEAP_MASK_IDS", 0)
    seen = {"commit": [0, 0], "block": [0, 0], "one": 0}

    class Kinds(Sim):
        def commit_rows(self, ids, gather):
            self.kind = "commit"
            return super().commit_rows(ids, gather)

        def block_rows(self, block, positions, gather):
            self.kind = "block"
            return super().block_rows(block, positions, gather)

        def rows(self, logits, gather):
            if gather.n_rows == 1:
                seen["one"] += gather.masks is not None
            else:
                seen[self.kind][gather.masks is not None] += 1
                if gather.masks is not None:
                    assert self.kind == "block" and gather.row_mask.tolist() == [0] + [-1] * (gather.n_rows - 1)
            return super().rows(logits, gather)

    for seed in range(10):
        m = _Model(seed)
        got, reason, _, _, _ = _run(Kinds(m.causal, m.block), random_dfa(seed), mode="draft-self", max_new_tokens=24,
                                    draft_threshold=draft_threshold)
        assert replay(random_dfa(seed), got, reason == "stop") is None
        assert got == _run(Sim(m.causal, m.block), random_dfa(seed), mode="ar", max_new_tokens=24)[0]
    assert seen["commit"][1] == 0 and seen["commit"][0] > 0
    assert 0 < seen["block"][1] < seen["block"][0]
    assert seen["one"] > 0


def _replay_events(events: list[dict]) -> tuple[list[int], int]:
    """An answer rebuilt from the observer's events alone (decoding.generate's observe), a pass's "refused" positions
    masked again -> (the answer, how many refused positions were seen)."""
    answer, slots, refused = [], None, 0
    for ev in events:
        kind = ev["type"]
        if kind == "block":
            slots = [None] * ev["size"]
            for i, t in zip(ev["known"], ev["tokens"]):
                slots[i] = t
        elif kind == "pass":
            for i in ev["refused"]:
                assert slots[i] is not None, "a refused position was not filled"
                slots[i] = None
                refused += 1
            for i, t in zip(ev["filled"], ev["tokens"]):
                assert slots[i] is None, f"position {i} filled twice"
                slots[i] = t
            assert all(slots[i] is None for i in ev["masked"])
        elif kind == "verify":
            kept = slots[:ev["cut"]]
            answer += kept[:-1] if ev["ended"] else kept
            slots = None
        elif kind == "commit":
            answer += slots
            slots = None
        elif kind == "forced":
            for i, t in zip(ev["filled"], ev["tokens"]):
                assert slots[i] is None, f"position {i} filled twice"
                slots[i] = t
        elif kind == "ar":
            answer += [ev["token"], *ev.get("forced", ())]
    if slots is not None:  # a diffusion block that ended the answer: up to its end token
        answer += slots[:next(i for i, t in enumerate(slots) if t == EOS)]
    return answer, refused


@pytest.mark.parametrize("mode", ["diffusion", "draft-self", "auto", "ar"])
@pytest.mark.parametrize("grammar", ["dfa", "form"])
def test_the_block_view_replays_a_constrained_answer(mode, grammar):
    """The observer's events (serve's block view) under a grammar: positions filled by a pass and refused by the
    grammar later come back in a pass's "refused" list, and a reader that masks them again rebuilds the answer token
    for token; observing changes nothing."""
    seen = 0
    for seed in range(8):
        m = _Model(seed)
        kw = dict(mode=mode, max_new_tokens=60, threshold=0.9)
        make = (lambda: random_dfa(seed)) if grammar == "dfa" else form
        want, why, _, _, _ = _run(Float32(m.causal, m.block), make(), **kw)
        events = []
        got, reason, _, _, _ = _run(Float32(m.causal, m.block), make(), observe=events.append, **kw)
        assert (got, reason) == (want, why)
        if reason == "stop":
            answer, refused = _replay_events(events)
            assert answer == got, seed
            seen += refused
    assert seen > 0 or mode == "ar" or grammar == "form"


# ---- forced tokens ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("graph", [False, True], ids=["dense", "graph"])
def test_forced_tokens_save_passes_and_keep_the_text(graph, cheap):
    """The form's fixed parts cost no pass: AR makes exactly one pass fewer per forced token, draft-self and auto
    fewer passes in all, diffusion too; greedy text equal with and without in ar, draft-self and auto (AR's); the
    card's controls biting; every answer follows the form, the grammar and the backend hold the kept tokens."""
    procs = make_processors(BITING, [EOS], THINK, THINK_END)
    saved = {}
    for mode in ("ar", "draft-self", "auto", "diffusion"):
        passes = {True: 0, False: 0}
        for seed in range(12):
            m = _Model(seed)
            be = (lambda: Sim(m.causal, m.block)) if graph else (lambda: Float32(m.causal, m.block))
            kw = dict(mode=mode, max_new_tokens=40, logits_processors=procs, threshold=0.9)
            runs = {}
            for forced in (True, False):
                b = be()
                got, reason, _, g, st = _run(b, form(), forced=forced, **kw)
                assert replay(form(), got, reason == "stop") is None, (mode, forced, seed, got)
                assert len(g.states) - 1 == len(got), (mode, forced, seed)
                assert b.n_past == len(PROMPT) + len(got) or mode == "diffusion", (mode, forced, seed)
                runs[forced] = (got, reason, st)
                passes[forced] += st.forward_passes
            on, off = runs[True][2], runs[False][2]
            assert off.forced_tokens == 0 and on.forced_tokens > 0, (mode, seed)
            if mode != "diffusion":
                assert runs[True][:2] == runs[False][:2], (mode, seed)
                assert runs[True][0] == _run(be(), form(), forced=False, **{**kw, "mode": "ar"})[0]
            if mode == "ar":  # one pass per token, but the forced ones
                assert on.forward_passes == off.forward_passes - on.forced_tokens == len(runs[True][0]) + 1 - \
                    on.forced_tokens, seed
                assert on.tokens_per_pass > off.tokens_per_pass
        saved[mode] = passes
        assert passes[True] < passes[False], (mode, passes)
    assert saved["ar"][False] - saved["ar"][True] >= 12 * 8  # the form forces 14 of its 22 tokens


def test_forced_tokens_with_sampling_and_logprobs():
    """Sampled (temperature 1.5): every answer follows the form, forced tokens placed; the logprobs of forced and
    chosen tokens alike are the log-softmax of the processed causal rows (a forced token's: 0, its row allows it
    alone), in every mode, computed independently."""
    procs = make_processors(BITING, [EOS], THINK, THINK_END)
    for seed in range(6):
        m = _Model(seed)
        for mode in ("ar", "diffusion", "draft-self", "auto"):
            got, reason, _, _, st = _run(Float32(m.causal, m.block), form(), mode=mode,
                                         sampler=Sampling(1.5, seed=seed), max_new_tokens=30)
            assert replay(form(), got, reason == "stop") is None and st.forced_tokens > 0, (seed, mode)
            got, reason, lps, _, st = _run(Float32(m.causal, m.block), form(), mode=mode, threshold=0.9,
                                           max_new_tokens=30, logits_processors=procs, logprobs=2)
            want = _reference_logprobs(m, got, form(), procs, 2)
            for lp, (ref, top) in zip(lps, want):
                assert lp.logprob == pytest.approx(ref, abs=1e-5)
                assert [t for t, _ in lp.top] == [t for t, _ in top]
            assert sum(lp.logprob == 0.0 for lp in lps) >= st.forced_tokens > 0


def test_forced_tokens_show_in_the_stats_and_the_events():
    """An AR step that carries forced tokens says so in its "ar" event; a block's forced positions come in "forced"
    events, never in a pass's; forced tokens are not counted as the model's drafted or accepted tokens."""
    m = _Model(2)
    for mode in ("ar", "draft-self", "diffusion"):
        events = []
        got, _, _, _, st = _run(Float32(m.causal, m.block), form(), mode=mode, observe=events.append, threshold=0.9,
                                max_new_tokens=40)
        carried = sum(len(e.get("forced", ())) for e in events if e["type"] == "ar")
        placed = sum(len(e["filled"]) for e in events if e["type"] == "forced")
        assert (carried if mode == "ar" else placed) >= st.forced_tokens > 0, mode
        assert st.drafted_tokens <= len(got) - st.forced_tokens
