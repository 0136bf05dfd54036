"""Clover's generation controls and samplers, as small composable functions (mlx-lm style).

A logits processor is `processor(generated, logits) -> logits`: `generated` are the answer's tokens so far (never
the prompt), `logits` a float vector [V] for the next position. The model card's controls, applied in this order:

1. repetition penalty r (1.05): for every token already generated, logit / r if positive, logit * r if not;
2. frequency penalty f (0.0): logit - f * count(token in generated);
3. presence penalty p (0.9): logit - p if the token was generated at all;
4. length penalty L (10.0): once the answer is `start` (8192) tokens long, the end tokens gain
   L * min(1, (n - start) / ramp) (ramp 8192) — a push towards finishing (our reading of "towards the end tokens");
5. think-end bias B (10.0): while thinking (a <think> not yet closed by </think>), once the thinking span is
   `start` (4096) tokens long, </think> gains B * min(1, (n_think - start) / ramp) (ramp 4096).
All apply under sampling and greedy alike. Values come from the GGUF (`clover.generation.*`), overridable.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np

from clover_gguf.config import GenerationDefaults

Processor = Callable[[Sequence[int], np.ndarray], np.ndarray]
Sampler = Callable[[np.ndarray], int]


_CARD = GenerationDefaults()  # the model card's values live in one place: config.GenerationDefaults


@dataclass(frozen=True)
class Controls:
    presence_penalty: float = _CARD.presence_penalty
    frequency_penalty: float = _CARD.frequency_penalty
    repetition_penalty: float = _CARD.repetition_penalty
    length_penalty: float = _CARD.length_penalty
    length_penalty_start: int = _CARD.length_penalty_start
    length_penalty_ramp: int = _CARD.length_penalty_ramp
    think_end_bias: float = _CARD.think_end_bias
    think_end_bias_start: int = _CARD.think_end_bias_start
    think_end_bias_ramp: int = _CARD.think_end_bias_ramp

    GGUF_KEYS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "length_penalty",
                 "length_penalty_start", "length_penalty_ramp", "think_end_bias", "think_end_bias_start",
                 "think_end_bias_ramp")

    @classmethod
    def from_meta(cls, meta: Callable[[str], str | None], **overrides) -> "Controls":
        """From a GGUF's `clover.generation.*` keys (meta(key) -> string or None), then explicit overrides."""
        kw = {}
        for k in cls.GGUF_KEYS:
            v = meta(f"clover.generation.{k}")
            if v is not None:
                kw[k] = type(getattr(cls, k))(float(v))
        c = cls(**kw)
        return replace(c, **{k: v for k, v in overrides.items() if v is not None})

    def off(self) -> "Controls":
        return replace(self, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, length_penalty=0.0,
                       think_end_bias=0.0)


def _ramp(n: int, start: int, ramp: int) -> float:
    if n < start:
        return 0.0
    return 1.0 if ramp <= 0 else min(1.0, (n - start) / ramp)


def _raise(logits: np.ndarray, ids, amount: float) -> np.ndarray:
    """logits with `amount` added at `ids` (a new array; the input itself when amount is 0)."""
    if amount == 0.0:
        return logits
    out = logits.astype(np.float32, copy=True)
    out[ids] += amount
    return out


def make_processors(c: Controls, end_ids: Sequence[int], think_id: int | None = None, think_end_id: int | None = None,
                    thinking_at_start: bool = False) -> list[Processor]:
    """The card's controls as processors. thinking_at_start: the prompt itself opened a <think> span."""
    procs: list[Processor] = []

    if c.repetition_penalty != 1.0 or c.frequency_penalty or c.presence_penalty:
        def penalties(generated: Sequence[int], logits: np.ndarray) -> np.ndarray:
            if not len(generated):
                return logits
            ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
            out = logits.astype(np.float32, copy=True)
            x = out[ids]
            if c.repetition_penalty != 1.0:
                x = np.where(x > 0, x / c.repetition_penalty, x * c.repetition_penalty)
            x = x - c.frequency_penalty * counts - c.presence_penalty
            out[ids] = x
            return out

        procs.append(penalties)

    if c.length_penalty and end_ids:
        ends = np.asarray(sorted(set(end_ids)), dtype=np.int64)

        def length(generated: Sequence[int], logits: np.ndarray) -> np.ndarray:
            ramp = _ramp(len(generated), c.length_penalty_start, c.length_penalty_ramp)
            return _raise(logits, ends, c.length_penalty * ramp)

        procs.append(length)

    if c.think_end_bias and think_end_id is not None:
        def think_end(generated: Sequence[int], logits: np.ndarray) -> np.ndarray:
            n_think = thinking_span(generated, think_id, think_end_id, thinking_at_start)
            if n_think is None:
                return logits
            ramp = _ramp(n_think, c.think_end_bias_start, c.think_end_bias_ramp)
            return _raise(logits, think_end_id, c.think_end_bias * ramp)

        procs.append(think_end)
    return procs


def thinking_span(generated: Sequence[int], think_id: int | None, think_end_id: int, thinking_at_start: bool
                  ) -> int | None:
    """Tokens generated inside the currently open <think> span, or None when not thinking."""
    open_at = 0 if thinking_at_start else None
    for i, t in enumerate(generated):
        if think_id is not None and t == think_id:
            open_at = i + 1
        elif t == think_end_id:
            open_at = None
    return None if open_at is None else len(generated) - open_at


def apply(processors: Sequence[Processor], generated: Sequence[int], logits: np.ndarray) -> np.ndarray:
    for p in processors:
        logits = p(generated, logits)
    return logits


# ---- samplers -------------------------------------------------------------------------------------------------
def softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64) - np.max(logits)
    e = np.exp(x)
    return e / e.sum()


def greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits))  # the lowest index among ties


def make_sampler(temp: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None) -> Sampler:
    """temp 0 = greedy; otherwise top-k, then top-p (nucleus), then a draw at temperature `temp`."""
    if temp <= 0:
        return greedy
    rng = np.random.default_rng(seed)

    def sample(logits: np.ndarray) -> int:
        x = logits.astype(np.float64) / temp
        if top_k and top_k < x.size:
            kth = np.partition(x, -top_k)[-top_k]
            x = np.where(x < kth, -np.inf, x)
        p = softmax(x)
        if top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            keep = np.cumsum(p[order]) - p[order] < top_p  # the smallest prefix reaching top_p
            mask = np.zeros_like(p, dtype=bool)
            mask[order[keep]] = True
            p = np.where(mask, p, 0.0)
            p /= p.sum()
        return int(rng.choice(p.size, p=p))

    return sample
