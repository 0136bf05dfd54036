"""The decoding loops of clover_gguf.decoding against a fake backend whose logits are scripted, one rule a test."""

from __future__ import annotations

import numpy as np
import pytest

from clover_gguf.auto import AutoPolicy, PassCosts
from clover_gguf.controls import Controls, make_processors
from clover_gguf.decoding import Backend, generate, generate_all

V, MASK, EOS, B = 12, 11, 10, 6


def dist(tok: int, p: float) -> np.ndarray:
    """Logits whose softmax puts probability p on tok and spreads the rest evenly over the tokens a pass can choose
    (the mask token never is: it gets next to none, so p is also the confidence once the selection drops it)."""
    probs = np.full(V, (1.0 - p) / (V - 2))
    probs[MASK] = 1e-30
    probs[tok] = p
    return np.log(probs)


class FakeBackend:
    """causal(context) -> logits [V] predicting the token after `context`; block(prefix, block, k) -> [B, V]."""

    def __init__(self, causal, block=None, block_size=B):
        self.causal, self.block = causal, block
        self.mask_token_id, self.eos_ids, self.block_size = MASK, frozenset({EOS}), block_size
        self.calls: list[tuple] = []
        self.reset()

    @property
    def n_past(self) -> int:
        return len(self.ids)

    def reset(self) -> None:
        self.ids, self.n_block, self.last = [], 0, 0

    def commit(self, ids):
        self.calls.append(("commit", list(ids)))
        rows = [self.causal(self.ids + list(ids[:i + 1])) for i in range(len(ids))]
        self.ids += list(ids)
        self.last = len(ids)
        return np.stack(rows)

    def prefill(self, ids):
        return self.commit(ids)[-1]

    def block_logits(self, block):
        self.calls.append(("block", list(block)))
        self.n_block += 1
        return np.asarray(self.block(list(self.ids), list(block), self.n_block - 1))

    def rollback(self, n):
        self.calls.append(("rollback", n))
        assert 0 <= n <= self.last, "rollback past the latest commit"
        self.ids = self.ids[:len(self.ids) - n]
        self.last -= n


def scripted(passes):
    """block logits from a list of per-pass rows: passes[k][i] = (token, prob) for position i."""
    return lambda prefix, block, k: np.stack([dist(t, p) for t, p in passes[k]])


PROMPT = [1, 2, 3]


def test_fake_backend_is_a_backend():
    assert isinstance(FakeBackend(lambda c: dist(0, 0.5)), Backend)


def test_threshold_fills_every_confident_position_in_one_pass():
    passes = [[(4, 0.99), (5, 0.5), (6, 0.97), (7, 0.2), (8, 0.96), (9, 0.3)],
              [(4, 0.99), (5, 0.99), (6, 0.99), (7, 0.99), (8, 0.99), (9, 0.99)]]
    be = FakeBackend(lambda c: dist(0, 0.5), scripted(passes))
    toks, stats = generate_all(be, PROMPT, mode="diffusion", max_new_tokens=B, threshold=0.95)
    blocks = [c[1] for c in be.calls if c[0] == "block"]
    assert blocks[0] == [MASK] * B
    assert blocks[1] == [4, MASK, 6, MASK, 8, MASK]  # exactly the positions above 0.95 after pass 1
    assert toks == [4, 5, 6, 7, 8, 9]
    assert stats.block_passes == 2 and stats.finish_reason == "length"


def test_threshold_is_the_given_value():
    passes = [[(4, 0.9), (5, 0.79), (6, 0.85), (7, 0.7), (8, 0.6), (9, 0.5)]] + \
             [[(4, 0.99)] * B] * 6
    be = FakeBackend(lambda c: dist(0, 0.5), scripted(passes))
    generate_all(be, PROMPT, mode="diffusion", max_new_tokens=B, threshold=0.8)
    blocks = [c[1] for c in be.calls if c[0] == "block"]
    assert blocks[1] == [4, MASK, 6, MASK, MASK, MASK]  # 0.9 and 0.85 exceed 0.8, 0.79 does not


def test_fallback_fills_only_the_single_most_confident_position():
    passes = [[(4, 0.3), (5, 0.5), (6, 0.9), (7, 0.2), (8, 0.6), (9, 0.1)]] + [[(1, 0.99)] * B] * 5
    be = FakeBackend(lambda c: dist(0, 0.5), scripted(passes))
    generate_all(be, PROMPT, mode="diffusion", max_new_tokens=B, threshold=0.95)
    blocks = [c[1] for c in be.calls if c[0] == "block"]
    assert blocks[1] == [MASK, MASK, 6, MASK, MASK, MASK]


def test_end_token_inside_a_block_ends_the_answer_without_waiting_for_later_positions():
    # pass 0: eos at 3 and the tail resolve, 0..2 not yet; pass 1: 0..2 resolve -> done, position 5 never needed
    passes = [[(4, 0.5), (5, 0.5), (6, 0.5), (EOS, 0.99), (2, 0.99), (3, 0.1)],
              [(4, 0.99), (5, 0.99), (6, 0.99), (EOS, 0.99), (2, 0.99), (3, 0.1)]]
    be = FakeBackend(lambda c: dist(0, 0.5), scripted(passes))
    toks, stats = generate_all(be, PROMPT, mode="diffusion", max_new_tokens=100, threshold=0.95)
    assert toks == [4, 5, 6]  # the end token and what follows it are dropped
    assert stats.finish_reason == "stop"
    assert stats.block_passes == 2
    assert [c[0] for c in be.calls] == ["commit", "block", "block"]  # no commit of the last block
    assert stats.forward_passes == 3 and stats.tokens_per_pass == 1.0


def test_finished_block_is_committed_by_one_counted_causal_pass():
    passes = [[(4, 0.99)] * B, [(EOS, 0.99)] + [(4, 0.99)] * (B - 1)]
    be = FakeBackend(lambda c: dist(0, 0.5), scripted(passes))
    toks, stats = generate_all(be, PROMPT, mode="diffusion", max_new_tokens=100)
    assert toks == [4] * B
    assert [c[0] for c in be.calls] == ["commit", "block", "commit", "block"]
    assert be.calls[2] == ("commit", [4] * B)
    assert stats.forward_passes == 4 and stats.generated_tokens == B


def test_ar_one_pass_per_token_the_end_token_included():
    answer = [5, 6, 7]
    be = FakeBackend(lambda c: dist((answer + [EOS])[len(c) - len(PROMPT)], 0.9))
    toks, stats = generate_all(be, PROMPT, mode="ar", max_new_tokens=10)
    assert toks == answer and stats.forward_passes == 4 and stats.finish_reason == "stop"


def test_logits_processors_run_before_sampling_and_confidence():
    banned = 4
    def ban(histories, logits):
        out = logits.copy()
        out[:, banned] = -np.inf
        return out
    passes = [[(banned, 0.99), (5, 0.99)] + [(6, 0.99)] * (B - 2)] + [[(6, 0.99)] * B] * B
    be = FakeBackend(lambda c: dist(0, 0.5), scripted(passes))
    toks, _ = generate_all(be, PROMPT, mode="diffusion", max_new_tokens=B, logits_processors=[ban])
    assert banned not in toks
    blocks = [c[1] for c in be.calls if c[0] == "block"]
    assert blocks[1][0] == MASK  # with 4 banned, position 0 is no longer confident


def _draft_backend(draft, causal_answer, causal_p=0.99, block_p=0.99):
    """Block passes propose `draft` at confidence `block_p`; the causal model says `causal_answer` then eos."""
    def causal(ctx):
        i = len(ctx) - len(PROMPT)
        seq = causal_answer + [EOS] * 50
        return dist(seq[i], causal_p[i] if isinstance(causal_p, list) else causal_p)
    def block(prefix, blk, k):
        i0 = len(prefix) - len(PROMPT)
        seq = draft + [EOS] * 50
        return np.stack([dist(seq[i0 + j], block_p) for j in range(len(blk))])
    return FakeBackend(causal, block)


def test_draft_self_exact_keeps_the_matching_prefix_plus_the_causal_token():
    # causal answer 5 6 7 8 9 | draft proposes 5 6 7 3 9: first position (5) is the pending causal token,
    # 6 7 are accepted, 3 is rejected and replaced by the causal 8
    be = _draft_backend([5, 6, 7, 3, 9, 1], [5, 6, 7, 8, 9])
    chunks = list(generate(be, PROMPT, mode="draft-self", max_new_tokens=100, accept="exact"))
    assert chunks[0].tokens == [5, 6, 7]
    first_verify = next(c for c in be.calls if c[0] == "commit" and c[1] != PROMPT)
    assert first_verify[1] == [5, 6, 7, 3, 9, 1]
    assert ("rollback", 3) in be.calls  # 3, 9, 1 forgotten
    toks = [t for c in chunks for t in c.tokens]
    assert toks == [5, 6, 7, 8, 9]
    st = chunks[-1].stats
    assert st.drafted_tokens >= 5 and st.accepted_tokens >= 2 and st.finish_reason == "stop"


def test_draft_self_threshold_rejects_a_low_probability_causal_match():
    # the causal argmax equals the draft everywhere, but position 2 has causal probability 0.6 only
    draft = [5, 6, 7, 8, 9, 1]
    probs = [0.99, 0.99, 0.6, 0.99, 0.99, 0.99] + [0.99] * 50
    be = _draft_backend(draft, [5, 6, 7, 8, 9], causal_p=probs)
    exact = list(generate(be, PROMPT, mode="draft-self", max_new_tokens=5, accept="exact"))
    assert exact[0].tokens == [5, 6, 7, 8, 9]
    be = _draft_backend(draft, [5, 6, 7, 8, 9], causal_p=probs)
    thr = list(generate(be, PROMPT, mode="draft-self", max_new_tokens=5, accept="threshold", threshold=0.95))
    assert thr[0].tokens == [5, 6]  # 7 needed causal probability >= 0.95
    assert ("rollback", 4) in be.calls
    assert [t for c in thr for t in c.tokens] == [5, 6, 7, 8, 9]


@pytest.mark.parametrize("mode", ["draft-self", "auto"])
def test_exact_drafts_fill_at_the_draft_threshold_and_the_text_stays_the_causal_ones(mode):
    """draft_threshold replaces the fill threshold of exactly verified drafts: block rows at 0.7 fill a draft in one
    pass at 0.5 and one position a pass at the card's 0.95; the same text either way. With accept="threshold" the
    one threshold stays (it is also the acceptance's)."""
    causal = [5, 6, 7, 8, 9, 1, 2, 3, 4, 5, 6, 7]
    runs = {}
    for dt in (None, 0.5):
        be = _draft_backend(causal, causal, block_p=0.7)
        policy = None
        if mode == "auto":  # drafts known to pay: every block a draft
            policy = AutoPolicy(PassCosts(), B)
            policy.ar_step.add(1.0)
            policy.costs.observe("block", B, 1e-6)
            policy.costs.observe("causal", B, 1e-6)
            policy.drafts_seen = 2
        toks, st = generate_all(be, PROMPT, mode=mode, max_new_tokens=len(causal), block_size=B, threshold=0.95,
                                draft_threshold=dt, policy=policy)
        runs[dt] = (toks, st)
    assert runs[None][0] == runs[0.5][0] == causal
    assert runs[0.5][1].block_passes == runs[0.5][1].drafts  # one pass a draft
    assert runs[None][1].block_passes >= 2 * runs[None][1].drafts  # 0.95: one position a pass
    be = _draft_backend(causal, causal, block_p=0.7)
    _, st = generate_all(be, PROMPT, mode="draft-self", max_new_tokens=len(causal), block_size=B, threshold=0.95,
                         draft_threshold=0.5, accept="threshold")
    assert st.block_passes >= 2 * st.drafts


def test_a_draft_is_verified_at_the_first_pass_that_leaves_its_usable_prefix_unchanged(monkeypatch):
    """Block rows sure of every position but the one after the pending token: a pass fills the positions behind
    that gap, which a verification cannot keep. The draft is verified after that pass (its usable prefix: the
    pending token alone), not after a second pass that fills the gap; the text is AR's either way. Drafts at a given
    threshold (no draft_threshold: the card's, check-block's) still resolve whole."""
    import clover_gguf.decoding as decoding

    answer = [5, 6, 7, 8, 9, 1, 2, 3, 4] * 3  # longer than the answers asked for: no end token in any block

    def block(prefix, blk, k):
        i0 = len(prefix) - len(PROMPT)
        gap = blk.index(MASK)  # the first masked position
        return np.stack([dist((answer + [EOS] * 50)[i0 + j], 0.3 if j == gap == 1 else 0.99)
                         for j in range(len(blk))])

    def causal(ctx):
        return dist((answer + [EOS] * 50)[len(ctx) - len(PROMPT)], 0.99)

    ar, _ = generate_all(FakeBackend(causal, block), PROMPT, mode="ar", max_new_tokens=9)
    runs = {}
    for stop in (True, False):
        monkeypatch.setattr(decoding, "STOP_AT_STALL", stop)
        be = FakeBackend(causal, block)
        toks, st = generate_all(be, PROMPT, mode="draft-self", max_new_tokens=9, draft_threshold=0.5)
        verifies = [c[1] for c in be.calls if c[0] == "commit" and c[1] != PROMPT]
        runs[stop] = (toks, st, verifies)
    assert runs[True][0] == runs[False][0] == ar == answer[:9]
    stopped, whole = runs[True][1], runs[False][1]
    assert stopped.block_passes == stopped.drafts  # one pass a draft: it left the prefix at the pending token
    assert all(len(v) == 1 for v in runs[True][2])  # verified: the pending token alone
    assert whole.block_passes == 2 * whole.drafts  # resolved whole: a second pass fills the gap
    assert len(runs[False][2][0]) == B
    monkeypatch.setattr(decoding, "STOP_AT_STALL", True)
    _, card = generate_all(FakeBackend(causal, block), PROMPT, mode="draft-self", max_new_tokens=9)
    assert card.block_passes == 2 * card.drafts


def test_draft_self_accepted_end_token_ends_the_answer_and_is_not_kept():
    be = _draft_backend([5, 6, EOS], [5, 6])
    toks, stats = generate_all(be, PROMPT, mode="draft-self", max_new_tokens=100)
    assert toks == [5, 6] and stats.finish_reason == "stop"
    assert be.n_past == len(PROMPT) + 2
    assert stats.drafted_tokens == 2 and stats.accepted_tokens == 2


class _HashModel:
    """A deterministic pseudo language model over a small vocabulary: logits depend on the whole context."""

    def __init__(self, seed):
        self.seed = seed

    def causal(self, ctx):
        rng = np.random.default_rng([self.seed, len(ctx), *ctx[-3:]])
        logits = rng.normal(size=V) * 3
        logits[MASK] = -1e9
        if len(ctx) > len(PROMPT) + 14:
            logits[EOS] += 20
        return logits

    def block(self, prefix, blk, k):
        # noisy guesses: right about two thirds of the time, confident at random
        rows = []
        ctx = list(prefix)
        rng = np.random.default_rng([self.seed, 99, k, len(prefix)])
        for j in range(len(blk)):
            tok = blk[j] if blk[j] != MASK else int(np.argmax(self.causal(ctx)))
            if blk[j] == MASK and rng.random() < 0.33:
                tok = int(rng.integers(0, V - 1))
            rows.append(self.guess(tok, rng))
            ctx.append(tok)
        return np.stack(rows)

    def guess(self, tok: int, rng: np.random.Generator) -> np.ndarray:
        """A block position's log-probabilities, its guess `tok` at one of three confidences."""
        return dist(tok, float(rng.choice([0.5, 0.97, 0.99])))


@pytest.mark.parametrize("draft_threshold", [None, 0.5], ids=["card-drafts", "drafts-stop-at-a-stall"])
@pytest.mark.parametrize("seed", range(12))
def test_greedy_draft_self_exact_equals_ar_token_for_token(seed, draft_threshold):
    m = _HashModel(seed)
    ar, _ = generate_all(FakeBackend(m.causal, m.block), PROMPT, mode="ar", max_new_tokens=40)
    be = FakeBackend(m.causal, m.block)
    ds, stats = generate_all(be, PROMPT, mode="draft-self", max_new_tokens=40, accept="exact",
                             draft_threshold=draft_threshold)
    assert ds == ar
    assert stats.finish_reason == "stop"  # the model ends after about 15 tokens, well inside max_new_tokens
    assert be.n_past == len(PROMPT) + len(ds)  # every rejected draft token and the end token were rolled back


# the card's controls, made to bite on a 12-token vocabulary within a short answer: penalties strong enough to change
# the choice, the length penalty and the think-end bias ramping after a few tokens (tokens 7 and 8 play <think>)
BITING = Controls(presence_penalty=2.5, frequency_penalty=0.7, repetition_penalty=1.6, length_penalty=6.0,
                  length_penalty_start=6, length_penalty_ramp=5, think_end_bias=5.0, think_end_bias_start=2,
                  think_end_bias_ramp=3)


def test_greedy_draft_self_exact_equals_ar_with_the_cards_controls_on():
    """The processors see, for every verified position, exactly the tokens before it: then draft-self (exact)
    reproduces AR's greedy text with every control on. An off-by-one in the verification history breaks this."""
    changed = 0
    for seed in range(16):
        m = _HashModel(seed)
        procs = make_processors(BITING, [EOS], 7, 8)
        ar, _ = generate_all(FakeBackend(m.causal, m.block), PROMPT, mode="ar", max_new_tokens=40,
                             logits_processors=procs)
        plain, _ = generate_all(FakeBackend(m.causal, m.block), PROMPT, mode="ar", max_new_tokens=40)
        ds, _ = generate_all(FakeBackend(m.causal, m.block), PROMPT, mode="draft-self", max_new_tokens=40,
                             accept="exact", logits_processors=procs)
        assert ds == ar, seed
        changed += ar != plain
    assert changed >= 8  # the controls changed most answers: the test exercises them


def test_each_block_position_is_processed_with_the_tokens_before_it():
    """In a block pass, a masked position's history is the committed answer plus the block's resolved tokens
    before it (the masked ones before it are not tokens yet)."""
    seen = []

    def record(histories, logits):
        seen.append([list(h) for h in histories])
        return logits

    passes = [[(4, 0.99), (5, 0.5), (6, 0.99), (7, 0.5), (8, 0.5), (9, 0.5)],  # 0 and 2 resolve
              [(4, 0.99), (5, 0.99), (6, 0.99), (7, 0.99), (8, 0.99), (9, 0.99)],  # the rest
              [(1, 0.99), (2, 0.5), (3, 0.5), (1, 0.5), (2, 0.5), (3, 0.5)],  # block 2: position 0 first
              [(1, 0.99)] * B]
    be = FakeBackend(lambda c: dist(0, 0.5), scripted(passes))
    toks, _ = generate_all(be, PROMPT, mode="diffusion", max_new_tokens=2 * B, logits_processors=[record])
    first = [4, 5, 6, 7, 8, 9]
    assert toks == first + [1] * B
    assert seen[0] == [[]] * B
    assert seen[1] == [[4], [4, 6], [4, 6], [4, 6]]  # positions 1, 3, 4, 5 after 0 and 2 resolved
    # the commit pass checks the block (diffusion's acceptance): each row after the tokens up to its own (the last
    # row's choice, the token after the block, is not used)
    assert seen[2] == [first[:i + 1] for i in range(B)]
    assert seen[3] == [first] * B  # block 2 starts after the committed first block
    assert seen[4] == [first + [1]] * (B - 1)


def test_max_new_tokens_cuts_every_mode():
    m = _HashModel(3)  # ends after about 15 tokens: 4 always cuts
    for mode in ("ar", "diffusion", "draft-self"):
        whole, _ = generate_all(FakeBackend(m.causal, m.block), PROMPT, mode=mode, max_new_tokens=40)
        toks, stats = generate_all(FakeBackend(m.causal, m.block), PROMPT, mode=mode, max_new_tokens=4)
        assert len(whole) > 4 and toks == whole[:4] and stats.finish_reason == "length", mode
        assert stats.generated_tokens == 4


# ---- end tokens in block passes (decoding.END_RULES) ------------------------------------------------------------
def _early_end_block(prefix, blk, k):
    """Pass 0 is sure the answer is two tokens long (end tokens from position 2 on) but unsure of the two; a later
    pass fills whatever the block leaves room for: 4 5 6 then the end when position 2 is free, 4 5 before an end
    already sitting at 2 (the cut answer)."""
    if k == 0:
        return np.stack([dist(4, 0.5), dist(5, 0.5)] + [dist(EOS, 0.99)] * (B - 2))
    if blk[2] == EOS:
        return np.stack([dist(4, 0.99), dist(5, 0.99)] + [dist(EOS, 0.99)] * (B - 2))
    return np.stack([dist(4, 0.99), dist(5, 0.99), dist(6, 0.99)] + [dist(EOS, 0.99)] * (B - 3))


@pytest.mark.parametrize("rule, answer, first_pass_fills", [
    ("plain", [4, 5], [MASK, MASK] + [EOS] * (B - 2)),  # the card's rule: the end tokens go in first, the answer is cut
    ("tail", [4, 5], [MASK, MASK] + [EOS] * (B - 2)),
    ("prefix", [4, 5, 6], [4] + [MASK] * (B - 1)),  # no end token behind a masked position: the fallback fills 0
    ("strict", [4, 5, 6], [4] + [MASK] * (B - 1)),  # 0.99 < END_THRESHOLD
])
def test_end_rule_decides_whether_an_early_end_token_cuts_the_answer(rule, answer, first_pass_fills):
    be = FakeBackend(lambda c: dist(0, 0.5), _early_end_block)
    toks, stats = generate_all(be, PROMPT, mode="diffusion", max_new_tokens=100, end_rule=rule)
    blocks = [c[1] for c in be.calls if c[0] == "block"]
    assert blocks[1] == first_pass_fills
    assert toks == answer and stats.finish_reason == "stop"


def test_strict_end_rule_takes_an_end_token_above_end_threshold(monkeypatch):
    import clover_gguf.decoding as decoding

    monkeypatch.setattr(decoding, "END_THRESHOLD", 0.98)  # now the pass-0 end tokens (0.99) clear it
    toks, _ = generate_all(FakeBackend(lambda c: dist(0, 0.5), _early_end_block), PROMPT, mode="diffusion",
                           max_new_tokens=100, end_rule="strict")
    assert toks == [4, 5]


def test_prefix_rule_takes_an_end_token_whose_prefix_fills_in_the_same_pass():
    passes = [[(4, 0.99), (5, 0.99), (EOS, 0.99), (EOS, 0.99), (7, 0.3), (7, 0.3)]]
    be = FakeBackend(lambda c: dist(0, 0.5), scripted(passes))
    toks, stats = generate_all(be, PROMPT, mode="diffusion", max_new_tokens=100, end_rule="prefix")
    assert toks == [4, 5] and stats.block_passes == 1


def test_prefix_rule_fallback_may_take_an_end_token_at_the_first_masked_position():
    passes = [[(EOS, 0.6), (5, 0.3), (6, 0.3), (7, 0.3), (8, 0.3), (9, 0.3)]]  # the end is the likeliest there
    toks, stats = generate_all(FakeBackend(lambda c: dist(0, 0.5), scripted(passes)), PROMPT, mode="diffusion",
                               max_new_tokens=100, end_rule="prefix")
    assert toks == [] and stats.finish_reason == "stop" and stats.block_passes == 1


def test_tail_rule_fills_the_positions_after_a_resolved_end_token_at_once():
    passes = [[(4, 0.5), (5, 0.5), (EOS, 0.99), (7, 0.3), (8, 0.3), (9, 0.3)],
              [(4, 0.99), (5, 0.99), (EOS, 0.99), (7, 0.3), (8, 0.3), (9, 0.3)]]
    blocks = {}
    for rule in ("plain", "tail"):
        be = FakeBackend(lambda c: dist(0, 0.5), scripted(passes))
        toks, _ = generate_all(be, PROMPT, mode="diffusion", max_new_tokens=100, end_rule=rule)
        assert toks == [4, 5]
        blocks[rule] = [c[1] for c in be.calls if c[0] == "block"][1]
    assert blocks["plain"] == [MASK, MASK, EOS, MASK, MASK, MASK]
    assert blocks["tail"] == [MASK, MASK, EOS, EOS, EOS, EOS]


def test_unknown_end_rule_is_refused():
    with pytest.raises(ValueError, match="end_rule"):
        generate_all(FakeBackend(lambda c: dist(0, 0.5)), PROMPT, mode="diffusion", end_rule="eager")


@pytest.mark.parametrize("rule", ["plain", "prefix", "strict", "tail"])
@pytest.mark.parametrize("seed", range(4))
def test_draft_self_exact_equals_ar_under_every_end_rule(rule, seed):
    m = _HashModel(seed)
    ar, _ = generate_all(FakeBackend(m.causal, m.block), PROMPT, mode="ar", max_new_tokens=40)
    ds, _ = generate_all(FakeBackend(m.causal, m.block), PROMPT, mode="draft-self", max_new_tokens=40,
                         accept="exact", end_rule=rule)
    assert ds == ar
