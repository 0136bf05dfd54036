"""What the decoders need of a grammar: the state of an answer against it, token by token (constrained output).

A Constraint follows the answer's tokens in order. The decoders ask it which tokens may come next (a bitmask over the
model's vocabulary, the form grammar engines compute), tell it each token they keep, and take tokens back when a
draft is rejected. clover_gguf.grammar wraps a grammar engine in this interface (JSON schemas, tool calls); the
decoders (clover_gguf.decoding) use only this, so any mode can be constrained by any grammar.

Bitmask layout (xgrammar's and llguidance's): int32 words, token t allowed iff bit (t % 32) of word t // 32 is set;
ceil(n_vocab / 32) words for the model's n_vocab (ids past the tokenizer's own vocabulary are never allowed). End
tokens are allowed exactly where the grammar may end.

How the decoders use it (docs/runtime.md, "Constrained output"): they copy each mask (an engine may refill one buffer),
never pass an end token to `accept` (it ends the answer), call `accept` only with tokens a mask of the same state
allowed (its False is then an engine's inconsistency, except while a block is validated: there it rejects a token),
and roll back only tokens they accepted. Once `finished()`, only the end tokens may follow, whatever the mask says.

Forced tokens (optional, `Forcing`): where the grammar allows exactly one continuation (a closing tag, a schema's
fixed key), `forced()` names its tokens, so the decoders place them without a model pass of their own (docs/runtime.md,
"Forced tokens"). Its contract: each token of the run is the only token the mask of the state before it allows (the
first: the current state's), so a row restricted there can choose nothing else, greedy or sampled. A constraint without
`forced` still has its one-token masks used: the decoders take such a mask's token as a run of one.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Constraint(Protocol):
    """A grammar's state after the answer's tokens so far."""

    def mask(self) -> np.ndarray:
        """int32 [ceil(n_vocab / 32)]: the tokens allowed next (see the module's layout)."""
        ...

    def accept(self, token: int) -> bool:
        """Advance by `token`; False (and the state unchanged) when the grammar does not allow it here."""
        ...

    def rollback(self, n: int) -> None:
        """Take back the last `n` accepted tokens (a rejected draft's)."""
        ...

    def finished(self) -> bool:
        """The grammar is complete and allows nothing but the end of the answer."""
        ...


@runtime_checkable
class Forcing(Constraint, Protocol):
    """A Constraint that names the run of tokens its grammar forces from the current state."""

    def forced(self) -> list[int]:
        """The tokens forced from here on, in order ([] where the grammar leaves a choice): each the only token its
        state allows (see the module's doc). The state is unchanged."""
        ...


def allowed(mask: np.ndarray, token: int) -> bool:
    """Whether `token` is allowed in this bitmask."""
    word = token >> 5
    return 0 <= word < len(mask) and bool((int(mask[word]) >> (token & 31)) & 1)


def mask_ids(mask: np.ndarray, n_vocab: int) -> np.ndarray:
    """The allowed ids of a bitmask, ascending (int64)."""
    bits = np.unpackbits(np.ascontiguousarray(mask, dtype="<i4").view(np.uint8), bitorder="little")
    return np.flatnonzero(bits[:n_vocab])


def mask_of(ids, n_vocab: int) -> np.ndarray:
    """The bitmask that allows exactly `ids` (the inverse of mask_ids)."""
    bits = np.zeros(-(-n_vocab // 32) * 32, dtype=np.uint8)
    bits[np.asarray(list(ids), dtype=np.int64)] = 1
    return np.packbits(bits, bitorder="little").view("<i4").copy()


class Mask:
    """A bitmask as the decoders carry it: its words (a copy: an engine may refill its buffer) over a vocabulary of
    n_vocab ids, and how many of them it allows (counted once)."""

    __slots__ = ("words", "n_vocab", "n_allowed")

    def __init__(self, words: np.ndarray, n_vocab: int):
        n_words = -(-n_vocab // 32)
        w = np.zeros(n_words, dtype="<i4")
        src = np.asarray(words).reshape(-1)
        k = min(n_words, len(src))
        w[:k] = src[:k]
        if n_vocab % 32:  # bits past the vocabulary are not ids
            w[-1] &= np.int32(np.uint32((1 << (n_vocab % 32)) - 1).view(np.int32))
        self.words, self.n_vocab = w, int(n_vocab)
        self.n_allowed = int(np.bitwise_count(w.view(np.uint32)).sum())

    @classmethod
    def of(cls, ids, n_vocab: int) -> "Mask":
        """The mask that allows exactly `ids`."""
        return cls(mask_of(ids, n_vocab), n_vocab)

    @classmethod
    def one(cls, token: int, n_vocab: int) -> "Mask":
        """The mask that allows `token` alone (a forced token's row), without a pass over the vocabulary's bits."""
        m = cls.__new__(cls)
        m.words = np.zeros(-(-n_vocab // 32), dtype="<i4")
        m.words[token >> 5] = np.uint32(1 << (token & 31)).view(np.int32)
        m.n_vocab, m.n_allowed = int(n_vocab), 1
        return m

    def allows(self, token: int) -> bool:
        return 0 <= token < self.n_vocab and allowed(self.words, token)

    def n_ids(self) -> int:
        """The ids a selection restricted by this mask names: the allowed ones or the excluded ones, the fewer."""
        return min(self.n_allowed, self.n_vocab - self.n_allowed)

    def dense(self, width: int | None = None) -> np.ndarray:
        """bool [width] (default n_vocab): the allowed ids of a row that wide (a full-vocabulary array: the dense
        path's); ids past n_vocab are not allowed."""
        width = self.n_vocab if width is None else int(width)
        out = np.zeros(width, dtype=bool)
        bits = np.unpackbits(self.words.view(np.uint8), bitorder="little")[:min(width, self.n_vocab)]
        out[:bits.size] = bits
        return out

    def only(self) -> int | None:
        """The one id this mask allows, or None where it allows none or several."""
        if self.n_allowed != 1:
            return None
        word = int(np.flatnonzero(self.words)[0])
        return 32 * word + (int(self.words[word]) & 0xFFFFFFFF).bit_length() - 1

    def same(self, other: "Mask | None") -> bool:
        """Whether `other` allows exactly the same ids."""
        return other is not None and (other is self or (other.n_vocab == self.n_vocab and
                                                        other.n_allowed == self.n_allowed and
                                                        np.array_equal(other.words, self.words)))
