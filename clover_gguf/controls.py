"""Clover's generation controls and the samplers: the one batched interface every decoder uses (mlx-lm style).

A logits processor is `processor(histories, logits) -> logits`: `logits` is float [T, V], one row per position to
decide, and `histories[i]` the answer's tokens before row i (never the prompt). A sampler is
`sampler(logits [T, V]) -> tokens [T]`. `process` applies processors in order; every decoder goes through it, one
row (AR) or a whole block at once.

The model card's controls, applied in this order:
1. repetition penalty r (1.05): for every token already generated, logit / r if positive, logit * r if not;
2. frequency penalty f (0.0): logit - f * count(token in generated);
3. presence penalty p (0.9): logit - p if the token was generated at all;
4. length penalty L (10.0): once the answer is `start` (8192) tokens long, the end tokens gain
   L * min(1, (n - start) / ramp) (ramp 8192) — a push towards finishing (our reading of "towards the end tokens");
5. think-end bias B (10.0): while thinking (a <think> not yet closed by </think>), once the thinking span is
   `start` (4096) tokens long, </think> gains B * min(1, (n_think - start) / ramp) (ramp 4096).
All apply under sampling and greedy alike. Values come from the GGUF (`clover_moe.generation.*`), overridable.
"""

from __future__ import annotations

import itertools
from typing import Callable, Sequence

import numpy as np

from clover_gguf.metadata import Controls  # the card's values and their GGUF keys: one home

Processor = Callable[[Sequence[Sequence[int]], np.ndarray], np.ndarray]  # (histories [T], logits [T, V]) -> [T, V]
Sampler = Callable[[np.ndarray], np.ndarray]  # logits [T, V] -> tokens [T]


def _ramp(n: int, start: int, ramp: int) -> float:
    if n < start:
        return 0.0
    return 1.0 if ramp <= 0 else min(1.0, (n - start) / ramp)


def make_processors(c: Controls, end_ids: Sequence[int], think_id: int | None = None, think_end_id: int | None = None,
                    thinking_at_start: bool = False) -> list[Processor]:
    """The card's controls as processors. thinking_at_start: the prompt itself opened a <think> span."""
    procs: list[Processor] = []
    if c.repetition_penalty != 1.0 or c.frequency_penalty or c.presence_penalty:
        procs.append(_Penalties(c))
    if c.length_penalty and end_ids:
        procs.append(_LengthPenalty(c, end_ids))
    if c.think_end_bias and think_end_id is not None:
        procs.append(_ThinkEndBias(c, think_id, think_end_id, thinking_at_start))
    return procs


def process(processors: Sequence[Processor], histories: Sequence[Sequence[int]], logits: np.ndarray) -> np.ndarray:
    """Apply the processors in order: logits [T, V] (float64 out), histories[i] the tokens before row i."""
    out = np.asarray(logits, dtype=np.float64)
    for p in processors:
        out = np.asarray(p(histories, out), dtype=np.float64)
    return out


def _flatten(histories: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (lengths [T], row of each token [N], tokens [N]) for T histories holding N tokens in all."""
    lens = np.fromiter((len(h) for h in histories), dtype=np.int64, count=len(histories))
    flat = np.fromiter(itertools.chain.from_iterable(histories), dtype=np.int64, count=int(lens.sum()))
    return lens, np.repeat(np.arange(len(histories)), lens), flat


class _Penalties:
    """Repetition, frequency and presence penalties over the generated tokens (card items 1-3)."""

    def __init__(self, c: Controls):
        self.c = c

    def __call__(self, histories, logits):
        _, row, flat = _flatten(histories)
        if not flat.size:
            return logits
        t, v = logits.shape
        counts = np.bincount(row * v + flat, minlength=t * v).reshape(t, v)  # [T, V] occurrences per row
        x = logits.astype(np.float32)  # [T, V]
        c = self.c
        if c.repetition_penalty != 1.0:
            pen = np.where(x > 0, x / np.float32(c.repetition_penalty), x * np.float32(c.repetition_penalty))
        else:
            pen = x
        pen = pen - c.frequency_penalty * counts - c.presence_penalty  # float64, rounded once below
        return np.where(counts > 0, pen, x).astype(np.float32)


class _LengthPenalty:
    """The end tokens gain L * ramp once the answer is `start` tokens long (card item 4)."""

    def __init__(self, c: Controls, end_ids: Sequence[int]):
        self.c, self.ends = c, np.asarray(sorted(set(end_ids)), dtype=np.int64)

    def __call__(self, histories, logits):
        c = self.c
        amount = [c.length_penalty * _ramp(len(h), c.length_penalty_start, c.length_penalty_ramp) for h in histories]
        return _raise_rows(logits, self.ends, amount)


class _ThinkEndBias:
    """</think> gains B * ramp once the open thinking span is `start` tokens long (card item 5)."""

    def __init__(self, c: Controls, think_id: int | None, think_end_id: int, thinking_at_start: bool):
        self.c, self.think_id, self.think_end_id, self.at_start = c, think_id, think_end_id, thinking_at_start

    def __call__(self, histories, logits):
        c = self.c
        spans = thinking_spans(histories, self.think_id, self.think_end_id, self.at_start)
        amount = [0.0 if n is None else c.think_end_bias * _ramp(n, c.think_end_bias_start, c.think_end_bias_ramp)
                  for n in spans]
        return _raise_rows(logits, self.think_end_id, amount)


def _raise_rows(logits: np.ndarray, ids, amounts: Sequence[float]) -> np.ndarray:
    """Row i of logits with amounts[i] added at `ids`; rows with nothing to add are left as they are."""
    if not any(amounts):
        return logits
    out = logits.astype(np.float32, copy=True)
    for i, a in enumerate(amounts):
        if a:
            out[i, ids] += a
    return out


def thinking_spans(histories: Sequence[Sequence[int]], think_id: int | None, think_end_id: int,
                   thinking_at_start: bool) -> list[int | None]:
    """For each history: the tokens generated inside the currently open <think> span, or None when not thinking.
    The span is open after the last <think> not followed by a </think> (or from the start when the prompt opened
    it: thinking_at_start and neither token generated). All rows at once."""
    lens, row, flat = _flatten(histories)
    pos = np.arange(flat.size) - np.repeat(np.cumsum(lens) - lens, lens)  # index of each token inside its row
    last_open = np.full(len(histories), -1)  # index of the last <think> (-1: none)
    last_close = np.full(len(histories), -1)
    if think_id is not None:
        hit = flat == think_id
        np.maximum.at(last_open, row[hit], pos[hit])
    hit = flat == think_end_id
    np.maximum.at(last_close, row[hit], pos[hit])
    out: list[int | None] = []
    for n, o, e in zip(lens.tolist(), last_open.tolist(), last_close.tolist()):
        if o > e:
            out.append(n - o - 1)
        elif e < 0 and thinking_at_start:  # neither token: the prompt's span is still open
            out.append(n)
        else:
            out.append(None)
    return out


def thinking_span(generated: Sequence[int], think_id: int | None, think_end_id: int, thinking_at_start: bool
                  ) -> int | None:
    """thinking_spans of one history."""
    return thinking_spans([generated], think_id, think_end_id, thinking_at_start)[0]


# ---- samplers -------------------------------------------------------------------------------------------------
def softmax(logits: np.ndarray) -> np.ndarray:
    """Probabilities over the last axis, in float64."""
    x = np.asarray(logits, dtype=np.float64)
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def greedy(logits: np.ndarray) -> np.ndarray:
    """[T, V] -> [T]: argmax, the lowest index among ties."""
    return np.argmax(logits, axis=-1)


def make_sampler(temp: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None) -> Sampler:
    """temp 0 = greedy; otherwise per row: top-k, then top-p (nucleus), then a draw at temperature `temp`, rows in
    order from one random generator (seeded: the same draws every run; None or negative, as llama.cpp's -1: a fresh
    random seed)."""
    if temp <= 0:
        return greedy
    rng = np.random.default_rng(None if seed is None or seed < 0 else seed)

    def sample(logits: np.ndarray) -> np.ndarray:
        x = np.atleast_2d(np.asarray(logits, dtype=np.float64)) / temp  # [T, V]
        if top_k and top_k < x.shape[-1]:
            kth = np.partition(x, -top_k, axis=-1)[:, -top_k:].min(-1, keepdims=True)
            x = np.where(x < kth, -np.inf, x)
        p = softmax(x)
        if top_p < 1.0:
            order = np.argsort(-p, axis=-1, kind="stable")
            ranked = np.take_along_axis(p, order, -1)
            keep_ranked = np.cumsum(ranked, -1) - ranked < top_p  # the smallest prefix reaching top_p
            keep = np.zeros_like(keep_ranked)
            np.put_along_axis(keep, order, keep_ranked, -1)
            p = np.where(keep, p, 0.0)
            p /= p.sum(-1, keepdims=True)
        return np.array([rng.choice(row.size, p=row) for row in p], dtype=np.int64)

    return sample
