"""Constraints for tests and benches (clover_gguf.constraint.Constraint), so that the decoders are exercised without
a grammar engine (clover_gguf.grammar holds the real one): a token automaton over a model's vocabulary, a character
pattern built on it, a check that replays an answer through a fresh constraint, and synthetic masks of the two kinds
a JSON grammar makes at the 35B's vocabulary (most of it allowed inside a string, a few dozen ids at a structure
position) with a constraint that cycles through them."""

from __future__ import annotations

from typing import Callable, Hashable, Iterable, Sequence

import numpy as np

from clover_gguf.constraint import Mask, mask_of


class TokenAutomaton:
    """A Constraint whose state after each token is `step(state, token)`; `allowed(state)` the tokens that may follow
    (the end tokens where the answer may end), `done(state)` whether it is finished. Counts its calls."""

    def __init__(self, n_vocab: int, start: Hashable, allowed: Callable[[Hashable], Iterable[int]],
                 step: Callable[[Hashable, int], Hashable], ends: Iterable[int],
                 done: Callable[[Hashable], bool] = lambda s: False):
        self.n_vocab, self.allowed_of, self.step, self.done = n_vocab, allowed, step, done
        self.ends = frozenset(int(t) for t in ends)
        self.states = [start]
        self.masks = self.accepts = self.rollbacks = self.forced_calls = 0
        self._cache: dict[Hashable, tuple[frozenset[int], np.ndarray]] = {}

    def _of(self, state):
        if state not in self._cache:
            ids = frozenset(int(t) for t in self.allowed_of(state))
            self._cache[state] = (ids, mask_of(sorted(ids), self.n_vocab))
        return self._cache[state]

    def allowed(self, state=None) -> frozenset[int]:
        return self._of(self.states[-1] if state is None else state)[0]

    @property
    def state(self):
        return self.states[-1]

    # ---- Constraint -------------------------------------------------------------------------------------------
    def mask(self) -> np.ndarray:
        self.masks += 1
        return self._of(self.states[-1])[1].copy()

    def accept(self, token: int) -> bool:
        self.accepts += 1
        token = int(token)
        if token in self.ends or token not in self.allowed():
            return False
        self.states.append(self.step(self.states[-1], token))
        return True

    def rollback(self, n: int) -> None:
        self.rollbacks += 1
        assert 0 <= n < len(self.states), f"rollback of {n} with {len(self.states) - 1} tokens accepted"
        del self.states[len(self.states) - n:]

    def finished(self) -> bool:
        return bool(self.done(self.states[-1]))

    def forced(self) -> list[int]:
        """constraint.Forcing: the run of states that allow one token alone (not an end token), from this one."""
        run, state = [], self.states[-1]
        while not self.done(state):
            ids = self.allowed(state)
            if len(ids) != 1 or next(iter(ids)) in self.ends:
                break
            run.append(next(iter(ids)))
            state = self.step(state, run[-1])
        self.forced_calls += 1
        return run


def replay(make: Callable[[], TokenAutomaton], answer: Sequence[int], stopped: bool) -> str | None:
    """Why `answer` breaks the grammar (None: it follows it): each token allowed where it stands (only end tokens
    once finished), and an answer that stopped on an end token ends where the grammar may end."""
    g = make()
    for j, t in enumerate(answer):
        if g.finished():
            return f"token {j} ({t}) after the grammar finished"
        if t not in g.allowed() or not g.accept(t):
            return f"token {j} ({t}) not allowed in state {g.state!r}: {sorted(g.allowed())}"
    if stopped and not g.finished() and not (g.allowed() & g.ends):
        return f"the answer stopped where the grammar may not end (state {g.state!r})"
    return None


def char_pattern(pieces: Sequence[bytes], segments: Sequence[tuple[str, str]], ends: Iterable[int]
                 ) -> Callable[[], TokenAutomaton]:
    """A factory of constraints for text made of `segments` in order, each ("lit", text) or ("some", characters:
    one or more of them), over tokens whose text is pieces[t] (a token with no text is never allowed); the grammar is
    finished after the last segment. States are (segment, characters of it so far)."""
    ends = frozenset(ends)
    n_seg = len(segments)

    def advance(state, ch: str):
        seg, k = state
        while seg < n_seg:
            kind, text = segments[seg]
            if kind == "lit":
                if k < len(text):
                    return (seg, k + 1) if text[k] == ch else None
                seg, k = seg + 1, 0
                continue
            if ch in text:
                return (seg, k + 1)
            if k == 0:
                return None
            seg, k = seg + 1, 0
        return None

    def run(state, token: int):
        text = pieces[token].decode("utf-8", "replace") if token < len(pieces) else ""
        if not text:
            return None
        for ch in text:
            state = advance(state, ch)
            if state is None:
                return None
        return state

    def at_end(state) -> bool:
        seg, k = state
        while seg < n_seg:
            kind, text = segments[seg]
            if kind == "lit" and k < len(text):
                return False
            if kind == "some" and k == 0:
                return False
            seg, k = seg + 1, 0
        return True

    def finished(state) -> bool:  # at the end with nothing that could continue
        seg, k = state
        return at_end(state) and (seg >= n_seg - 1 and segments[-1][0] == "lit" and
                                  (seg == n_seg or k == len(segments[-1][1])))

    def allowed(state):
        out = [t for t in range(len(pieces)) if t not in ends and run(state, t) is not None]
        if at_end(state):
            out += sorted(ends)
        return out

    return lambda: TokenAutomaton(len(pieces), (0, 0), allowed, lambda s, t: run(s, t), ends, finished)


# ---- synthetic masks of a JSON grammar's two kinds -------------------------------------------------------------
STRING_EXCLUDED = 8000  # ids a string position excludes besides the last SPECIAL (quote, backslash, control
SPECIAL = 300  # characters in some 3% of a 248k byte-level vocabulary; the special tokens at its end)
STRUCTURE_ALLOWED = 60  # ids a structure position allows (brackets, quotes, colons, commas, spaces, digits)


def string_mask(n_vocab: int, seed: int = 0, keep: Iterable[int] = ()) -> Mask:
    """Inside a JSON string: every id allowed but STRING_EXCLUDED random ones and the last SPECIAL (a "deny" mask for
    the sampler: the excluded ids are the fewer); `keep` ids stay allowed."""
    rng = np.random.default_rng([seed, 1])
    ok = np.ones(n_vocab, dtype=bool)
    ok[rng.choice(max(1, n_vocab - SPECIAL), size=min(STRING_EXCLUDED, max(0, n_vocab - SPECIAL - 1)),
                  replace=False)] = False
    ok[max(1, n_vocab - SPECIAL):] = False
    ok[list(keep)] = True
    return Mask.of(np.flatnonzero(ok), n_vocab)


def structure_mask(n_vocab: int, seed: int = 0, extra: Iterable[int] = ()) -> Mask:
    """At a JSON structure position: STRUCTURE_ALLOWED random ids (and `extra`) allowed (an "allow" mask)."""
    rng = np.random.default_rng([seed, 2])
    ids = {*rng.choice(n_vocab, size=min(STRUCTURE_ALLOWED, n_vocab), replace=False).tolist(), *extra}
    return Mask.of(sorted(ids), n_vocab)


class MaskCycle:
    """A Constraint whose k-th token (k from 0) is allowed by masks[k % len(masks)]: the grammar's cost to the
    decoders with realistic masks and no engine's own (its mask() hands out a precomputed array). Never finished."""

    def __init__(self, masks: Sequence[Mask]):
        self.masks = list(masks)
        self.n = 0

    def _now(self) -> Mask:
        return self.masks[self.n % len(self.masks)]

    def mask(self) -> np.ndarray:
        return self._now().words

    def accept(self, token: int) -> bool:
        if not self._now().allows(int(token)):
            return False
        self.n += 1
        return True

    def rollback(self, n: int) -> None:
        assert 0 <= n <= self.n
        self.n -= n

    def finished(self) -> bool:
        return False
