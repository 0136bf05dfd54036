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

Selection (`Selector`): a pass's rows -> the chosen tokens and their confidences (`Choice`), from either
- dense logits [T, V] (any backend: the processors, then the sampler, in numpy), or
- what llama.cpp's graph computed (`GraphRows`, runtime.LlamaBackend): the controls change the logits of a few ids
  per row only (the tokens of the row's history, the end tokens, </think>): their sparse form (`coef`) is per-id
  coefficients, x -> x * (c0 if x > 0 else c1) + c2, that the graph applies at those ids (`Gather`); it returns the
  corrected logits there, the largest logits of the rest of the row with their softmax probabilities, and (greedy)
  the row's choice, or (temperature) its draw: the token is chosen in the graph, the host reads back a few hundred
  numbers (docs/runtime.md, "Selection in llama.cpp's graph").
Never chosen (`Selector(never=...)`, the decoders pass the mask token): ids whose logit is -inf in every row after
the processors, on both paths: dense, one column set per row; in the graph, the ids are always gathered (so the rest
of the row leaves them out) and get -inf as their added coefficient. No pass, mode or temperature can sample, commit
or show them, and the confidences are the softmax without them.

Restricted rows (constrained output: a grammar's bitmask per row, constraint.Mask): every id the mask does not allow
gets -inf after the processors, on both paths (dense: a column mask; in the graph: the bitmask goes to
libclover_sampler, which gathers the allowed ids and excludes the rest of the row, or gathers the excluded ids with
-inf, whichever list is shorter). The processed row (for the choice, the confidences and the logprobs) is the
restricted one.

Logprobs (`Choice.logprob`, `Choice.top`): the log-softmax of the processed row at temperature 1 (the row the token
was chosen from, or checked against), and its most likely tokens; in the graph from the row's log-sum-exp, the
gathered logits and the sampler's top-n.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from clover_gguf.constraint import Mask
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


# ---- histories ------------------------------------------------------------------------------------------------
class Histories(Sequence):
    """The histories of T rows that share a prefix: row i holds prefix + tail[:lens[i]]. A block pass: the committed
    answer, then the block's tokens resolved before each masked position; a verification: the answer, then the draft
    up to each row. Reads as a list of lists (what dense processors take); the sparse path uses the parts."""

    def __init__(self, prefix: Sequence[int], tail: Sequence[int] = (), lens: Sequence[int] = (0,)):
        self.prefix, self.tail, self.lens = prefix, list(tail), [int(n) for n in lens]

    def __len__(self) -> int:
        return len(self.lens)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return list(self.prefix) + self.tail[:self.lens[i]]

    def __iter__(self) -> Iterator[list[int]]:
        return (self[i] for i in range(len(self)))


def _flatten(histories: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (lengths [T], row of each token [N], tokens [N]) for T histories holding N tokens in all."""
    lens = np.fromiter((len(h) for h in histories), dtype=np.int64, count=len(histories))
    flat = np.fromiter(itertools.chain.from_iterable(histories), dtype=np.int64, count=int(lens.sum()))
    return lens, np.repeat(np.arange(len(histories)), lens), flat


class _Penalties:
    """Repetition, frequency and presence penalties over the generated tokens (card items 1-3)."""

    history = True  # the sparse form needs the histories' tokens gathered (Selector.gather)

    def __init__(self, c: Controls):
        self.c = c

    def __call__(self, histories, logits):
        _, row, flat = _flatten(histories)
        if not flat.size:
            return logits
        t, v = logits.shape
        counts = np.bincount(row * v + flat, minlength=t * v).reshape(t, v)  # [T, V] occurrences per row
        return self._apply(logits, counts)

    def _apply(self, logits: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """logits [T, W] and the occurrences of their tokens [T, W] (int64) -> penalised logits (float32)."""
        x = logits.astype(np.float32)  # [T, W]
        c = self.c
        if c.repetition_penalty != 1.0:
            pen = np.where(x > 0, x / np.float32(c.repetition_penalty), x * np.float32(c.repetition_penalty))
        else:
            pen = x
        pen = pen - c.frequency_penalty * counts - c.presence_penalty  # float64, rounded once below
        return np.where(counts > 0, pen, x).astype(np.float32)

    # sparse form: only the tokens of the histories change (history = True: Selector.gather takes them all)
    def touches(self) -> Sequence[int]:
        return ()

    def coef(self, rows: "_Rows", out: np.ndarray) -> None:
        """x -> x * (c0 if x > 0 else c1) + c2 at the rows' ids, into out [3, T, W] (the identity there before): what
        _apply does, as coefficients (the graph's form; x * (1 / r) and one float32 subtraction instead of x / r and a
        float64 one: at most an ulp apart)."""
        c = self.c
        r = np.float32(c.repetition_penalty)
        n = rows.col.n_prefix
        if not rows.tail_len():  # the usual AR step: the seen ids are the prefix's, the first n columns
            out[0, :, :n] = np.float32(1.0) / r
            out[1, :, :n] = r
            out[2, :, :n] -= c.frequency_penalty * rows.stats.counts[:n] + c.presence_penalty
            return
        counts = rows.counts()
        seen = counts > 0
        np.copyto(out[0], np.float32(1.0) / r, where=seen)
        np.copyto(out[1], r, where=seen)
        np.subtract(out[2], c.frequency_penalty * counts + c.presence_penalty, out=out[2], where=seen)


class _LengthPenalty:
    """The end tokens gain L * ramp once the answer is `start` tokens long (card item 4)."""

    def __init__(self, c: Controls, end_ids: Sequence[int]):
        self.c, self.ends = c, np.asarray(sorted(set(end_ids)), dtype=np.int64)

    def _amounts(self, lengths: Sequence[int]) -> list[float]:
        c = self.c
        return [c.length_penalty * _ramp(n, c.length_penalty_start, c.length_penalty_ramp) for n in lengths]

    def __call__(self, histories, logits):
        return _raise_rows(logits, self.ends, self._amounts([len(h) for h in histories]))

    def touches(self) -> Sequence[int]:
        return self.ends.tolist()

    def coef(self, rows: "_Rows", out: np.ndarray) -> None:
        if rows.longest() >= self.c.length_penalty_start:  # else no row reaches the start (the usual case)
            _raise_rows(out[2], rows.cols(self.ends), self._amounts(rows.lengths()), out=out[2])


class _ThinkEndBias:
    """</think> gains B * ramp once the open thinking span is `start` tokens long (card item 5)."""

    def __init__(self, c: Controls, think_id: int | None, think_end_id: int, thinking_at_start: bool):
        self.c, self.think_id, self.think_end_id, self.at_start = c, think_id, think_end_id, thinking_at_start

    def _amounts(self, spans: Sequence[int | None]) -> list[float]:
        c = self.c
        return [0.0 if n is None else c.think_end_bias * _ramp(n, c.think_end_bias_start, c.think_end_bias_ramp)
                for n in spans]

    def __call__(self, histories, logits):
        spans = thinking_spans(histories, self.think_id, self.think_end_id, self.at_start)
        return _raise_rows(logits, self.think_end_id, self._amounts(spans))

    def touches(self) -> Sequence[int]:
        return [self.think_end_id]

    def _spans(self, rows: "_Rows") -> list[int | None]:
        return rows.spans(self.think_id, self.think_end_id, self.at_start)

    def coef(self, rows: "_Rows", out: np.ndarray) -> None:
        if rows.longest() >= self.c.think_end_bias_start:  # else none reaches the start (a span is at most its history)
            _raise_rows(out[2], rows.cols([self.think_end_id]), self._amounts(self._spans(rows)), out=out[2])


def _raise_rows(logits: np.ndarray, ids, amounts: Sequence[float], out: np.ndarray | None = None) -> np.ndarray:
    """Row i of logits with amounts[i] added at `ids`, in `out` (a float32 copy when None); rows with nothing to add
    are left as they are."""
    if not any(amounts):
        return logits
    if out is None:
        out = logits.astype(np.float32, copy=True)
    for i, a in enumerate(amounts):
        if a:
            out[i, ids] += a
    return out


def _span(n: int, last_open: int, last_close: int, thinking_at_start: bool) -> int | None:
    """The open thinking span of a history of n tokens whose last <think> / </think> sit at these indices (-1: none):
    the tokens after the last <think> not followed by </think>, or all n when the prompt opened the span and neither
    token was generated; None when not thinking."""
    if last_open > last_close:
        return n - last_open - 1
    if last_close < 0 and thinking_at_start:
        return n
    return None


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
    return [_span(n, o, e, thinking_at_start) for n, o, e in zip(lens.tolist(), last_open.tolist(),
                                                                   last_close.tolist())]


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


class Sampling:
    """Temperature sampling (make_sampler): per row top-k, then top-p (nucleus), then a draw at temperature `temp`,
    rows in order from one random generator. Its parameters and generator are what the graph's sampler uses too."""

    def __init__(self, temp: float, top_p: float = 1.0, top_k: int = 0, seed: int | None = None):
        self.temp, self.top_p, self.top_k = float(temp), float(top_p), int(top_k)
        self.rng = np.random.default_rng(None if seed is None or seed < 0 else seed)

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        p = self.probs(logits)
        return np.array([self.rng.choice(row.size, p=row) for row in p], dtype=np.int64)

    def probs(self, logits: np.ndarray) -> np.ndarray:
        """[T, V] processed logits -> the distribution each row is drawn from [T, V]."""
        x = np.atleast_2d(np.asarray(logits, dtype=np.float64)) / self.temp  # [T, V]
        if self.top_k and self.top_k < x.shape[-1]:
            kth = np.partition(x, -self.top_k, axis=-1)[:, -self.top_k:].min(-1, keepdims=True)
            x = np.where(x < kth, -np.inf, x)
        p = softmax(x)
        if self.top_p < 1.0:
            order = np.argsort(-p, axis=-1, kind="stable")
            ranked = np.take_along_axis(p, order, -1)
            keep_ranked = np.cumsum(ranked, -1) - ranked < self.top_p  # the smallest prefix reaching top_p
            keep = np.zeros_like(keep_ranked)
            np.put_along_axis(keep, order, keep_ranked, -1)
            p = np.where(keep, p, 0.0)
            p /= p.sum(-1, keepdims=True)
        return p

    def uniforms(self, n: int) -> np.ndarray:
        """n draws for the graph's sampler, from this sampler's generator: float32 on a grid of 2^22 points inside
        (0, 1), so that u * (a total near 1) stays strictly inside the total in float32."""
        grid = 1 << 22
        return ((np.floor(self.rng.random(n) * grid) + 0.5) / grid).astype(np.float32)


def make_sampler(temp: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None) -> Sampler:
    """temp 0 = greedy; otherwise per row: top-k, then top-p (nucleus), then a draw at temperature `temp`, rows in
    order from one random generator (seeded: the same draws every run; None or negative, as llama.cpp's -1: a fresh
    random seed)."""
    if temp <= 0:
        return greedy
    return Sampling(temp, top_p, top_k, seed)


# ---- selection ------------------------------------------------------------------------------------------------
class Choice:
    """What a pass decided for its T rows: tokens [T] and their confidence [T] (the probability of the chosen token
    under the softmax of the processed row); the probability of any token asked for when the pass ran (`prob`), and
    the most likely of a set of ids (`best_of`, the lowest id on ties)."""

    def __init__(self, tokens: np.ndarray, conf: np.ndarray):
        self.tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        self.conf = np.asarray(conf, dtype=np.float64).reshape(-1)

    def prob(self, i: int, token: int) -> float:
        raise NotImplementedError

    def best_of(self, i: int, ids: Sequence[int]) -> int:
        raise NotImplementedError

    def logprob(self, i: int, token: int) -> float:
        """log of the token's probability under row i's processed softmax (temperature 1); -inf where excluded.
        Needs a pass run for logprobs (Selector.gather's logprobs) on the graph path."""
        raise NotImplementedError

    def top(self, i: int, n: int) -> list[tuple[int, float]]:
        """Row i's n most likely tokens as (token, logprob), the most likely first (the lower id among equal ones);
        fewer where fewer are possible (a row restricted to fewer ids)."""
        raise NotImplementedError


def _ranked(ids: np.ndarray, values: np.ndarray, n: int, lse: float) -> list[tuple[int, float]]:
    """(id, value - lse) of the n largest finite values, the largest first, the lower id among equal ones; each id once
    (the graph's padded slots repeat one)."""
    keep = np.isfinite(values)
    ids, values = np.asarray(ids, dtype=np.int64)[keep], np.asarray(values, dtype=np.float64)[keep]
    order = np.lexsort((ids, -values))
    out, seen = [], set()
    for j in order:
        t = int(ids[j])
        if t not in seen:
            seen.add(t)
            out.append((t, float(values[j] - lse)))
            if len(out) == n:
                break
    return out


class _DenseChoice(Choice):
    def __init__(self, processed: np.ndarray, tokens: np.ndarray):
        self.processed = processed
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        self._p: np.ndarray | None = None
        self._lse: dict[int, float] = {}
        super().__init__(tokens, self.probs()[np.arange(len(tokens)), tokens])

    def probs(self) -> np.ndarray:
        if self._p is None:
            self._p = softmax(self.processed)
        return self._p

    def prob(self, i: int, token: int) -> float:
        return float(self.probs()[i, token])

    def best_of(self, i: int, ids: Sequence[int]) -> int:
        ids = sorted(ids)
        return ids[int(np.argmax(self.processed[i, ids]))]

    def _log_total(self, i: int) -> float:
        if i not in self._lse:
            x = np.asarray(self.processed[i], dtype=np.float64)
            m = x.max()
            self._lse[i] = float(m + np.log(np.exp(x - m).sum()))
        return self._lse[i]

    def logprob(self, i: int, token: int) -> float:
        return float(self.processed[i, token]) - self._log_total(i)

    def top(self, i: int, n: int) -> list[tuple[int, float]]:
        if n <= 0:
            return []
        x = np.asarray(self.processed[i], dtype=np.float64)
        k = min(n, x.size)
        # the n largest, and every id equal to the n-th (so that ties go to the lower id)
        kth = np.partition(x, x.size - k)[x.size - k]
        cand = np.flatnonzero(x >= kth)
        return _ranked(cand, x[cand], n, self._log_total(i))


class _SparseChoice(Choice):
    """A choice from the graph's rows: `values` [T, W] holds, per row, at the gathered ids, the processed logits
    (greedy; `log_total` [T] the log of the row's softmax total, None when the pass asked for tokens only) or the
    probabilities (sampled: `log_total` None, `probs` True). With logprobs: `logits` [T, W] the processed logits at
    the ids, `token_logits` [T] the chosen tokens', `log_total` the rows' log-sum-exp, `top_ids` / `top_logits`
    [T, N] each row's N most likely (in no order), `saved` the raw logit of a token in the last row (save_last)."""

    def __init__(self, tokens, conf, col, values: np.ndarray, log_total: np.ndarray | None,
                 probs: bool = False, rows: GraphRows | None = None, logits: np.ndarray | None = None,
                 token_logits: np.ndarray | None = None):
        super().__init__(tokens, conf)
        self.col, self.values, self.log_total, self.probs = col, values, log_total, probs
        self.logits = values if logits is None and not probs else logits
        self.token_logits = token_logits
        self.top_ids = rows.top_ids if rows is not None else None
        self.top_logits = rows.top_logits if rows is not None else None
        self.saved = rows.saved if rows is not None else None

    def _lse(self, i: int) -> float:
        if self.log_total is None:
            raise ValueError("this pass was not run for logprobs (Selector.gather's logprobs)")
        return float(self.log_total[i])

    def logprob(self, i: int, token: int) -> float:
        token = int(token)
        lse = self._lse(i)
        if self.token_logits is not None and token == int(self.tokens[i]):
            return float(self.token_logits[i]) - lse
        if self.logits is not None and token in self.col:
            return float(self.logits[i, self.col[token]]) - lse
        if self.top_ids is not None:
            hit = np.flatnonzero(self.top_ids[i] == token)
            if hit.size:
                return float(self.top_logits[i, hit[0]]) - lse
        if self.saved is not None and i == len(self.tokens) - 1:
            # not gathered: no coefficient touches it (and the decoders ask only for tokens the row allowed)
            return float(self.saved(token)) - lse
        raise ValueError(f"token {token} was not computed in row {i} of this pass")

    def top(self, i: int, n: int) -> list[tuple[int, float]]:
        if n <= 0:
            return []
        if self.top_ids is None:
            raise ValueError("this pass was not run for the most likely tokens (Selector.gather's logprobs)")
        return _ranked(self.top_ids[i], self.top_logits[i], n, self._lse(i))

    def prob(self, i: int, token: int) -> float:
        if not self.probs and self.log_total is None:
            raise ValueError("this pass was run for its tokens only (Gather.probs False)")
        if int(token) not in self.col:
            raise ValueError(f"token {token} was not asked for when the pass ran (Selector.gather's want)")
        v = self.values[i, self.col[int(token)]]
        return float(v if self.probs else np.exp(v - self.log_total[i]))

    def best_of(self, i: int, ids: Sequence[int]) -> int:
        ids = sorted(ids)
        return ids[int(np.argmax(self.values[i, [self.col[int(t)] for t in ids]]))]


@dataclass
class Gather:
    """The per-row inputs of a pass whose selection runs in the graph: the ids whose logits are taken out of every
    row (the same list for all rows), the processors as per-id coefficients [3, T, W] (None: none) and with
    temperature one uniform per row. `width` is the graph's gather width (a few sizes, so that the graph is rebuilt
    rarely); `probs` False when the pass needs tokens only (an AR step, an exact verification), which spares the graph
    a softmax per row."""

    ids: np.ndarray  # [W] int32, distinct
    n_rows: int
    width: int
    probs: bool = True  # greedy: also what the confidences need (the rest of each row's softmax total)
    temp: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    coef: np.ndarray | None = None  # [3, T, W] float32
    uniform: np.ndarray | None = None  # [T] float32
    columns: "_Columns | None" = None  # token id -> column (Selector.gather)
    # constrained output: the distinct masks of the restricted rows and each row's index among them (-1: none); the
    # graph takes their ids (allowed or excluded, the fewer) after `ids`, within `width`
    masks: list[Mask] | None = None
    row_mask: np.ndarray | None = None  # [T] int32
    top_n: int = 0  # also each row's top_n most likely tokens (logprobs)
    save_last: bool = False  # keep the last row's raw logits, for a token known only after the pass (logprobs)

    def padded_ids(self) -> np.ndarray:
        """[T, width] int32: the ids in every row, unused slots repeating the first (what the graph reads)."""
        out = np.empty((self.n_rows, self.width), dtype=np.int32)
        out[:, :len(self.ids)] = self.ids
        out[:, len(self.ids):] = self.ids[0]
        return out

    def padded_coef(self) -> np.ndarray:
        """[3, T, width] float32: unused slots repeat the first id's (the graph writes every slot back to its id)."""
        out = np.empty((3, self.n_rows, self.width), dtype=np.float32)
        out[:, :, :len(self.ids)] = self.coef
        out[:, :, len(self.ids):] = self.coef[:, :, :1]
        return out

    def restrict(self, logits: np.ndarray) -> np.ndarray:
        """Rows [T, V] with -inf where a row's mask does not allow (a copy when any row is restricted): what the graph
        computes on, for a backend that selects densely on its device (MLX) and the tests' simulation."""
        if self.row_mask is None or not (self.row_mask >= 0).any():
            return logits
        out = np.array(logits, copy=True)
        for i, j in enumerate(self.row_mask.tolist()):
            if j >= 0:
                out[i, ~self.masks[j].dense(out.shape[1])] = -np.inf
        return out


@dataclass
class GraphRows:
    """What the graph returns for T rows after a pass with a Gather (LlamaContext.decode):
    greedy: `at_ids` [T, W] the row's processed logits at the gathered ids (Gather.coef applied); the rest of the row
    read in n chunks of the vocabulary: `rest_ids` / `rest_logits` [T, n] each chunk's largest logit and its id,
    `rest_probs` [T, n] (with Gather.probs) that logit's probability within its chunk's softmax; `tokens` [T] the
    row's choice, the largest of those logits (the lowest id among equal ones), `token_logits` [T] its logit;
    sampled: `tokens` [T] the draws, `token_probs` [T] their probabilities, `at_ids` [T, W] the probabilities at
    the gathered ids (softmax of the processed row at temperature 1)."""

    at_ids: np.ndarray
    rest_ids: np.ndarray | None = None
    rest_logits: np.ndarray | None = None
    rest_probs: np.ndarray | None = None
    tokens: np.ndarray | None = None
    token_logits: np.ndarray | None = None
    token_probs: np.ndarray | None = None
    # constrained output and logprobs: the gathered columns (the ids and those the masks added; None: the ids alone),
    # each row's top_n most likely tokens and their processed logits (in no order; a padded id may repeat), sampled:
    # the processed logits at the gathered ids and of the drawn token; the raw logit of a token in the last row
    n_ids: int | None = None
    top_ids: np.ndarray | None = None
    top_logits: np.ndarray | None = None
    top_probs: np.ndarray | None = None
    at_logits: np.ndarray | None = None
    token_z: np.ndarray | None = None
    saved: Callable[[int], float] | None = None


GATHER_WIDTHS = (32, 128, 512, 2048, 8192, 32768, 131072)


def gather_width(n: int) -> int:
    """The graph's gather width for n ids: the first of GATHER_WIDTHS that holds them (n itself past the last)."""
    for w in GATHER_WIDTHS:
        if w >= n:
            return w
    return n


class _PrefixStats:
    """Occurrences of each token in the prefix all rows share (the answer so far), kept up to date as it grows: the
    decoder only appends to the answer. Another list object whose first n tokens are the ones counted (diffusion
    commits a block with the answer before it, a slice of the answer) goes on from there; any other prefix starts
    over. (Starting over on every new object rescanned the whole answer twice a block: 0.6 ms a pass at 600 tokens.)"""

    def __init__(self, marks: Sequence[int]):
        self.marks = [int(t) for t in marks]  # tokens whose last position is kept (<think>, </think>)
        self.src: Sequence[int] | None = None
        self.reset()

    def reset(self) -> None:
        self.seen: list[int] = []  # the tokens counted, in order (what another prefix object is compared with)
        self.col: dict[int, int] = {}  # token -> index in ids
        self.ids = np.empty(64, dtype=np.int64)
        self.counts = np.zeros(64, dtype=np.int64)
        self.last = {t: -1 for t in self.marks}

    def update(self, prefix: Sequence[int]) -> None:
        n = len(self.seen)
        if len(prefix) < n or (prefix is not self.src and (not isinstance(prefix, list) or prefix[:n] != self.seen)):
            self.reset()
            n = 0
        self.src = prefix
        for i in range(n, len(prefix)):
            t = int(prefix[i])
            self.seen.append(t)
            j = self.col.get(t)
            if j is None:
                j = self.col[t] = len(self.col)
                if j == len(self.ids):
                    self.ids = np.concatenate([self.ids, np.empty_like(self.ids)])
                    self.counts = np.concatenate([self.counts, np.zeros_like(self.counts)])
                self.ids[j] = t
                self.counts[j] = 0
            self.counts[j] += 1
            if t in self.last:
                self.last[t] = i


class _Columns:
    """token id -> its column in a gather list laid out as [the prefix's ids (in _PrefixStats' order) | others]:
    without a dictionary over the whole list (rebuilding one per pass would cost more than the pass's numpy)."""

    def __init__(self, prefix_col: dict[int, int], n_prefix: int, others: Sequence[int]):
        self.prefix_col, self.n_prefix = prefix_col, n_prefix
        self.others = {int(t): n_prefix + j for j, t in enumerate(others)}

    def __getitem__(self, token: int) -> int:
        j = self.prefix_col.get(token) if self.n_prefix else None
        return self.others[token] if j is None else j

    def of(self, tokens: Sequence[int]) -> list[int]:
        """[self[t] for t in tokens], without a method call per token."""
        pre, others = (self.prefix_col if self.n_prefix else {}), self.others
        return [pre[t] if t in pre else others[t] for t in map(int, tokens)]

    def __contains__(self, token: int) -> bool:
        return (self.n_prefix and token in self.prefix_col) or token in self.others


class _Rows:
    """One pass's rows for the sparse processors: the histories, the gathered ids and what the processors ask of
    them (occurrences, lengths, thinking spans), computed once each."""

    def __init__(self, h: Histories, stats: _PrefixStats, ids: np.ndarray, col: _Columns):
        self.h, self.stats, self.ids, self.col = h, stats, ids, col
        self._counts: np.ndarray | None = None

    def cols(self, ids: Sequence[int]) -> list[int]:
        return self.col.of(ids)

    def tail_len(self) -> int:
        """The longest row's tokens past the shared prefix."""
        return max(self.h.lens, default=0)

    def lengths(self) -> list[int]:
        n = len(self.h.prefix)
        return [n + k for k in self.h.lens]

    def longest(self) -> int:
        """The longest history's length (max of lengths())."""
        return len(self.h.prefix) + self.tail_len()

    def counts(self) -> np.ndarray:
        """[T, W] int64: occurrences of each gathered id in each row's history."""
        if self._counts is None:
            st, w = self.stats, len(self.ids)
            counts = np.zeros((len(self.h), w), dtype=np.int64)
            n_prefix = self.col.n_prefix  # the prefix's ids come first in the gather list (Selector.gather)
            if n_prefix:
                counts[:, :n_prefix] = st.counts[:n_prefix]
            n_tail = self.tail_len()
            if n_tail:
                lens = np.asarray(self.h.lens)
                tail_cols = np.asarray(self.col.of(self.h.tail[:n_tail]))
                r, j = np.nonzero(np.arange(n_tail)[None, :] < lens[:, None])
                np.add.at(counts, (r, tail_cols[j]), 1)
            self._counts = counts
        return self._counts

    def spans(self, think_id: int | None, think_end_id: int, at_start: bool) -> list[int | None]:
        """thinking_spans of the rows, from the prefix's last marks and each row's tail."""
        n, last = len(self.h.prefix), self.stats.last
        o, e = last.get(think_id, -1) if think_id is not None else -1, last[think_end_id]
        by_len = [(o, e)]
        for k, t in enumerate(self.h.tail[:self.tail_len()]):
            if t == think_id:
                o = n + k
            elif t == think_end_id:
                e = n + k
            by_len.append((o, e))
        return [_span(n + k, *by_len[k], at_start) for k in self.h.lens]


class Selector:
    """Processors and a sampler, applied to a pass's rows (`choose`), dense or in the graph. One per answer: it keeps
    the occurrences of the answer's tokens as the answer grows."""

    def __init__(self, processors: Sequence[Processor] = (), sampler: Sampler | None = None,
                 end_ids: Sequence[int] = (), never: Sequence[int] = ()):
        self.processors = list(processors)
        self.sampler = sampler or greedy
        self.end_ids = sorted({int(t) for t in end_ids})
        # ids no row may choose (the mask token); a negative id (a file without one) is no id
        self.never = np.asarray(sorted({int(t) for t in never if t is not None and int(t) >= 0}), dtype=np.int64)
        self.sampling = self.sampler if isinstance(self.sampler, Sampling) else None
        # the graph can select when every processor has the sparse form and the sampler is one of ours
        self.in_graph = (all(hasattr(p, "coef") for p in self.processors) and
                         (self.sampler is greedy or self.sampling is not None))
        marks = [t for p in self.processors if isinstance(p, _ThinkEndBias) for t in (p.think_id, p.think_end_id)
                 if t is not None]
        self.stats = _PrefixStats(marks)
        self._identity: dict[tuple[int, int, int], np.ndarray] = {}  # coef's starting point, per shape
        self.history = any(getattr(p, "history", False) for p in self.processors)
        # what every gather holds besides the histories: the ids the processors touch, the end tokens
        self.fixed_ids = list(dict.fromkeys([int(t) for p in self.processors if hasattr(p, "touches")
                                             for t in p.touches()] + self.end_ids + self.never.tolist()))

    def _exclude(self, logits: np.ndarray, source: np.ndarray, cols) -> np.ndarray:
        """logits [T, W] with -inf in the columns `cols` (of the `never` ids); a copy only when `logits` shares
        memory with the pass's own `source` (the processors usually made a new array already)."""
        if not self.never.size:
            return logits
        if np.may_share_memory(logits, source):
            logits = logits.copy()
        logits[:, cols] = -np.inf
        return logits

    # ---- dense --------------------------------------------------------------------------------------------
    def choose_dense(self, h: Sequence[Sequence[int]], logits: np.ndarray,
                     masks: Sequence[Mask | None] | None = None) -> Choice:
        """masks: per row, the ids it may choose (None: any)."""
        processed = self._exclude(process(self.processors, h, logits), logits, self.never)
        if masks is not None and any(m is not None for m in masks):
            if np.may_share_memory(processed, logits):
                processed = processed.copy()
            for i, m in enumerate(masks):
                if m is not None:
                    processed[i, ~m.dense(processed.shape[1])] = -np.inf
        return _DenseChoice(processed, self.sampler(processed))

    # ---- in the graph -------------------------------------------------------------------------------------
    def gather(self, h: Histories, want: Sequence[int] = (), probs: bool = True,
               masks: Sequence[Mask | None] | None = None, logprobs: int | None = None,
               save_last: bool = False) -> Gather:
        """The ids the graph takes out of every row: the prefix's tokens first (in their order in _PrefixStats), then
        the tail's, the ids the processors touch, the end tokens and `want` (tokens whose probability the decoder
        will ask). probs False: the pass needs its tokens only (Choice.conf is then NaN). masks: per row, the ids it
        may choose (None: any; the graph adds their ids, Gather.masks). logprobs: the rows' logprobs are needed
        (Choice.logprob) with that many most likely tokens (Choice.top); save_last: also the logprob of a token
        not named now in the last row."""
        if logprobs is not None:
            probs = True  # the rows' log-sum-exp
        st = self.stats
        st.update(h.prefix)
        n_prefix = len(st.col) if self.history else 0
        seen = st.col if self.history else {}
        tail = h.tail[:max(h.lens, default=0)] if self.history else ()
        others: dict[int, None] = {}  # in order, distinct
        for t in itertools.chain(tail, self.fixed_ids, want):
            t = int(t)
            if t not in seen:
                others[t] = None
        others = list(others)
        ids = np.empty(n_prefix + len(others), dtype=np.int32)
        ids[:n_prefix] = st.ids[:n_prefix]
        ids[n_prefix:] = others
        distinct, row_mask = _distinct(masks, len(h))
        # the masks' ids come after these (the graph dedupes them): at most their count each
        width = gather_width(len(ids) + sum(m.n_ids() for m in distinct))
        g = Gather(ids, len(h), width, probs=probs, masks=distinct or None, row_mask=row_mask, save_last=save_last)
        if logprobs is not None:
            # sampled: at least one, for the row's log-sum-exp (the top token's logit over its probability)
            g.top_n = max(int(logprobs), 1 if self.sampling is not None else 0)
        g.columns = _Columns(st.col, n_prefix, others)
        g.coef = self.coef(h, g)
        if self.sampling is not None:
            s = self.sampling
            g.temp, g.top_k, g.top_p = s.temp, s.top_k, s.top_p
            g.uniform = s.uniforms(len(h))
        return g

    def _rows(self, h: Histories, g: Gather) -> _Rows:
        self.stats.update(h.prefix)
        return _Rows(h, self.stats, g.ids, g.columns)

    def coef(self, h: Histories, g: Gather) -> np.ndarray:
        """[3, T, W] float32: the processors as x -> x * (c0 if x > 0 else c1) + c2 at the gathered ids (the graph's
        form; only the penalties scale, and they come first, the rest add; the `never` ids get -inf)."""
        rows = self._rows(h, g)
        shape = (3, len(h), len(g.ids))
        identity = self._identity.get(shape)
        if identity is None:
            if len(self._identity) > 64:
                self._identity.clear()
            identity = self._identity[shape] = np.zeros(shape, dtype=np.float32)
            identity[:2] = 1.0
        out = identity.copy()
        for p in self.processors:
            p.coef(rows, out)
        if self.never.size:
            out[2][:, rows.cols(self.never)] = -np.inf  # x * scale - inf: never chosen, probability 0
        return out

    def choose(self, h: Sequence[Sequence[int]], rows: np.ndarray | GraphRows, gather: Gather | None = None,
               masks: Sequence[Mask | None] | None = None) -> Choice:
        """The pass's rows -> Choice: dense logits [T, V] (masks: per row, the ids it may choose), or the graph's
        GraphRows for the Gather it ran with (which carried the masks)."""
        if not isinstance(rows, GraphRows):
            return self.choose_dense(h, rows, masks)
        col, w = gather.columns, len(gather.ids)
        n = rows.n_ids if rows.n_ids is not None else w  # the columns that hold an id (the masks' too)
        if rows.token_probs is not None:  # sampled in the graph
            lse = None
            if rows.top_probs is not None:  # logprobs: the log-sum-exp from the row's most likely token
                j = np.argmax(rows.top_probs, axis=1)
                r = np.arange(len(j))
                lse = rows.top_logits[r, j].astype(np.float64) - np.log(rows.top_probs[r, j].astype(np.float64))
            return _SparseChoice(rows.tokens, rows.token_probs, col, rows.at_ids[:, :n].astype(np.float64), lse,
                                 probs=True, rows=rows,
                                 logits=None if rows.at_logits is None else rows.at_logits[:, :n],
                                 token_logits=rows.token_z)
        if self.sampler is not greedy:
            raise ValueError("graph rows without a draw need the greedy sampler")
        # chosen in the graph: the largest processed logit of the row, the lowest id among equal ones
        at = rows.at_ids[:, :n].astype(np.float64)  # [T, W] processed
        tokens = rows.tokens
        if not gather.probs:
            return _SparseChoice(tokens, np.full(len(tokens), np.nan), col, at, None)
        m = rows.token_logits.astype(np.float64)[:, None]  # [T, 1] the chosen logit: the row's largest
        # the row's softmax total relative to exp(m): the gathered ids' terms, and per chunk of the rest its sum,
        # which is its largest term over that term's probability in the chunk (a dead chunk, all -inf: no term; a
        # chunk's sum is at most c times its largest, so no overflow)
        e = np.exp(rows.rest_logits - m)
        np.divide(e, rows.rest_probs, out=e, where=e > 0)
        total = np.exp(at - m).sum(-1) + e.sum(-1)
        return _SparseChoice(tokens, 1.0 / total, col, at, m[:, 0] + np.log(total), rows=rows,
                             token_logits=rows.token_logits)


def _distinct(masks: Sequence[Mask | None] | None, n_rows: int) -> tuple[list[Mask], np.ndarray | None]:
    """Per-row masks -> (the distinct ones, each row's index among them or -1); rows share a mask by identity or by
    equal content with the row before (a string's rows: one mask)."""
    if masks is None or all(m is None for m in masks):
        return [], None
    if len(masks) != n_rows:
        raise ValueError(f"{len(masks)} masks for {n_rows} rows")
    distinct: list[Mask] = []
    index = np.full(n_rows, -1, dtype=np.int32)
    for i, m in enumerate(masks):
        if m is None:
            continue
        j = next((k for k, d in enumerate(distinct) if d is m), None)
        if j is None and distinct and distinct[-1].same(m):
            j = len(distinct) - 1
        if j is None:
            distinct.append(m)
            j = len(distinct) - 1
        index[i] = j
    return distinct, index
