"""What the decoders need of a grammar: the state of an answer against it, token by token (constrained output).

A Constraint follows the answer's tokens in order. The decoders ask it which tokens may come next (a bitmask over the
model's vocabulary, the form grammar engines compute), tell it each token they keep, and take tokens back when a
draft is rejected. clover_gguf.grammar wraps a grammar engine in this interface (JSON schemas, tool calls); the
decoders (clover_gguf.decoding) use only this, so any mode can be constrained by any grammar.

Bitmask layout (xgrammar's and llguidance's): int32 words, token t allowed iff bit (t % 32) of word t // 32 is set;
ceil(n_vocab / 32) words for the model's n_vocab (ids past the tokenizer's own vocabulary are never allowed). End
tokens are allowed exactly where the grammar may end.
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
