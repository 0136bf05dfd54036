"""Clover's decoding loops, written once for every backend: causal ("ar"), block diffusion ("diffusion"),
self-speculative decoding ("draft-self") and "auto", which chooses block by block between AR steps and draft-self
blocks from the pass costs measured on this device and the acceptance measured in this answer (clover_gguf.auto).

A backend (reference.ReferenceBackend on the PyTorch reference, runtime.LlamaBackend on the patched llama.cpp)
only evaluates the model; everything that decides tokens lives here and in clover_gguf.controls (`Selector`), on
numpy logits, or on what a backend's graph computed at the few ids the controls touch (the `*_rows` methods: the
same decisions, docs/runtime.md). `generate` yields chunks as they resolve, in the style of mlx-lm's
generate_step; `generate_all` collects them.

Conventions
-----------
* Logits are numpy float arrays over the vocabulary, `[V]` for one position, `[T, V]` for several.
* "Causal logits at position i" predict the token at position i + 1. The first token after a committed prefix is
  predicted by the prefix's *last* logits (what `prefill` / `commit` returned last).
* A sampler turns processed logits `[T, V]` into tokens `[T]`; the default is greedy: argmax, lowest index on
  ties (numpy's argmax). The confidence of a position is the softmax probability of the token the sampler chose.
* A logits processor is `(histories, logits[T, V]) -> logits[T, V]` (controls.Processor); `histories[i]` holds the
  tokens generated so far in this answer before row i (not the prompt), which for a block position means the
  committed answer tokens plus the resolved tokens before it in the block. Processors run before sampling and
  before confidences are taken, in every mode, also on the verification logits of draft-self.
* End tokens (`backend.eos_ids`) end the answer and are never yielded. The mask token (`backend.mask_token_id`) is
  never chosen: every selection gives it -inf (controls.Selector's `never`).
* Forward passes count every model evaluation the decoder asks for, the prompt's prefill included: one per
  `prefill`, `commit` and `block_logits` call. AR decoding therefore takes one pass per token, the end token
  included (n answer tokens + 1 passes, less the tokens a grammar forced).
* Pass costs: every pass but the prompt's is timed (`clock`, time.perf_counter unless a test injects one) into the
  answer's `auto.PassCosts` when one is given (the runtime keeps one per loaded model): causal passes by their
  tokens, block passes by the block's, rollbacks (draft-self's rejected tokens) by the tokens they keep.
* Constrained output (`constraint`, clover_gguf.constraint): every kept token is one the grammar allows where it
  stands, in every mode (docs/runtime.md, "Constrained output"). AR restricts each step's row to the grammar's mask.
  A block is validated in order as it resolves (`_Track`): each resolved token from the block's start is accepted
  into the grammar, the first one it refuses is masked again, and the block pass restricts the first unvalidated
  position (the head) to the grammar's mask, so every pass makes progress. A draft is such a block, ending at its
  first refused token; its verification restricts row i to the grammar's state after the draft's first i + 1
  tokens, so greedy draft-self and auto keep AR's constrained text, and the grammar is rolled back to what is kept.
  Once the grammar is finished only the end tokens may follow. Wide masks: CHEAP_MASK_IDS.
* Forced tokens (`forced`, on by default): where the grammar allows one token alone, state after state (a closing
  tag, a schema's fixed keys and punctuation: constraint.Forcing), those tokens cost no pass of their own. An AR step
  commits the answer's last token and the forced run after it in one pass, each forced row restricted to its one
  token, and takes its choice from the row after the run: the k forced tokens save k steps. A block (diffusion's, a
  draft) has its masked positions from the head on filled with the run before a pass and between passes, up to the
  first position already filled or the block's end (what lies past needs a pass); a draft's verification checks them
  as it checks every draft token (a row restricted to one token chooses it). Greedy text is the same with and without
  (draft-self and auto keep AR's), and a sampled answer's distribution too (a forced token has probability 1 under the
  grammar; the draws themselves differ: fewer rows draw). Counted in stats.forced_tokens.
* Logprobs (`logprobs`: None off, 0 the kept tokens' own, 1..TOP_LOGPROBS_MAX and that many alternatives): each kept
  token's log-probability under the processed row of the causal pass that kept it (an AR step's row, a draft's
  verification row, diffusion's commit pass, the prompt's row for the first token) and the row's most likely
  tokens (`TokenLogprob`, in Chunk.logprobs beside Chunk.tokens).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, Sequence, runtime_checkable

import numpy as np

from clover_gguf.auto import AutoPolicy, PassCosts, Plan
from clover_gguf.constraint import Constraint, Mask
from clover_gguf.controls import (GATHER_WIDTHS, Choice, Gather, GraphRows, Histories, Processor, Sampler, Selector,
                                  gather_width)

MODES = ("auto", "ar", "diffusion", "draft-self")
ACCEPT_MODES = ("exact", "threshold")
TOP_LOGPROBS_MAX = 20  # the most alternatives a kept token's logprob comes with (OpenAI's top_logprobs)
# A row's grammar restriction that names at most this many ids (the allowed or the excluded, the fewer: a JSON
# structure position allows a few dozen) is applied in every pass. A wider one (inside a JSON string most of the
# vocabulary is allowed and thousands of ids excluded) costs every row of a pass its ids in the graph, so a pass of
# several rows applies it only where it needs the restricted probabilities (logprobs, threshold acceptance), and
# otherwise checks the row's unrestricted choice against it: a choice it allows is the restricted row's choice too
# (the largest logit of a set that holds the row's largest; for a draw, rejection sampling), one it does not is
# chosen again from the restricted row (a block's head in its next pass, a draft's row by a one-token pass).
CHEAP_MASK_IDS = 1024


# ---------------------------------------------------------------------------------------------------------------
# The backend interface
# ---------------------------------------------------------------------------------------------------------------
@runtime_checkable
class Backend(Protocol):
    """What a model runtime provides to the decoders. One sequence; state is a committed causal prefix.

    Attributes
      mask_token_id  the token id that marks an unresolved block position (config.json `mask_token_id`)
      eos_ids        the end tokens (generation_config.json `eos_token_id`: <|im_end|>, <|endoftext|>)
      block_size     tokens per diffusion block (config.json `block_size`, 32 for Clover)
      n_past         number of committed tokens (the length of the causal prefix held in the caches)

    Methods (all logits are numpy arrays over the full vocabulary; nothing here samples)
      reset()                      forget every committed token (n_past becomes 0).
      prefill(ids) -> [V]          causal pass over `ids` after the committed prefix; commits them; returns the
                                   logits at the last of them (they predict the next token). One forward pass.
      commit(ids) -> [len(ids), V] the same causal pass, returning the logits at every position of `ids`
                                   (row i predicts the token after ids[i]). Used to commit a finished block and
                                   to verify a draft. One forward pass.
      block_logits(block) -> [B, V] block mode (architecture.md section 3) over the committed prefix for the B
                                   tokens of `block` (mask tokens where unresolved): bidirectional inside the
                                   block, right convolution, intra-block softmax, coreset routing. Commits
                                   NOTHING: the prefix state is exactly as before. One forward pass.
      rollback(n)                  forget the last n committed tokens (n <= n_past; only ever the tokens of the
                                   latest commit, which is all draft-self needs). The state must equal the one
                                   a causal pass over the kept tokens would give. Not counted as a pass.

    Optional: `settle()` applies a rollback now that the backend would otherwise defer to its next pass (so that auto
    times it with the draft it belongs to); `keep_backup` (a bool attribute): whether the next commit must be
    possible to roll back (set by the decoders before each commit: only draft verifications are rolled back).

    Optional: `n_vocab` (the rows' width; constrained output reads masks at it) and `gather_limit(sampled, top_n)`
    (the most ids its graph's selection may gather: a pass with more is selected on dense logits).

    Optional (GraphBackend): the same passes with the selection's full-vocabulary work done by the model's own
    graph; a `controls.Gather` says which ids to take out of each row, and they return `controls.GraphRows`
    (gather None: no rows at all, a commit whose logits nobody reads).
      prefill_rows(ids, gather)            the last position's row (gather None: none)
      commit_rows(ids, gather)             every position's row
      block_rows(block, positions, gather) the rows of these block positions
    """

    mask_token_id: int
    eos_ids: frozenset[int]
    block_size: int

    @property
    def n_past(self) -> int: ...

    def reset(self) -> None: ...

    def prefill(self, ids: Sequence[int]) -> np.ndarray: ...

    def commit(self, ids: Sequence[int]) -> np.ndarray: ...

    def block_logits(self, block: Sequence[int]) -> np.ndarray: ...

    def rollback(self, n: int) -> None: ...


@runtime_checkable
class GraphBackend(Backend, Protocol):
    """A Backend whose passes can also select in the model's graph (see Backend)."""

    def prefill_rows(self, ids: Sequence[int], gather: Gather | None) -> GraphRows | None: ...

    def commit_rows(self, ids: Sequence[int], gather: Gather | None) -> GraphRows | None: ...

    def block_rows(self, block: Sequence[int], positions: Sequence[int], gather: Gather) -> GraphRows: ...


# ---------------------------------------------------------------------------------------------------------------
# Passes and their selection: processors and samplers are clover_gguf.controls' (Selector)
# ---------------------------------------------------------------------------------------------------------------
def _selector(backend: Backend, processors: Sequence[Processor], sampler: Sampler | None,
              never: Sequence[int] = ()) -> Selector:
    """The selection of an answer's passes on this backend: its end tokens, and its mask token never chosen (it marks
    an unresolved block position; no mode at any temperature may sample, commit or show it), nor the `never` ids."""
    return Selector(processors, sampler, backend.eos_ids, never=(backend.mask_token_id, *never))


ONE_ROW_WIDTH_MAX = GATHER_WIDTHS[3]  # an AR answer's one-row gathers are sized for at most this many ids at once


class _Passes:
    """The model passes of one answer with the selection of their rows: in the backend's graph when it can and the
    selector allows it (every processor sparse, the sampler ours), else on dense logits. Either way the same
    Choice. Each pass but the prompt's is timed into `costs` (when given)."""

    def __init__(self, backend: Backend, selector: Selector, costs: PassCosts | None = None,
                 clock: Callable[[], float] = time.perf_counter, observe: Callable[[dict], None] | None = None,
                 logprobs: int | None = None):
        self.b, self.sel = backend, selector
        self.observe = observe  # generate's observer of the passes (see generate), or None
        self.graph = (selector.in_graph and isinstance(backend, GraphBackend) and
                      getattr(backend, "select_in_graph", True))
        self.costs, self.clock = costs, clock
        self.can_keep_backup = hasattr(backend, "keep_backup")
        self.logprobs = logprobs  # the answer's: None, or the alternatives each kept token's logprob comes with
        self.limit = getattr(backend, "gather_limit", None)
        self.grow = 0  # ids the answer's one-row gathers may still gain (an AR answer: its tokens; _one_row_width)
        self.one_row_width = 0  # the width its one-row gathers take, set by the first (0: not yet)

    def _fits(self, g: Gather) -> bool:
        """Whether the graph's sampler can take this gather (a small vocabulary cannot take many ids: its rows'
        outputs would not fit); the width is trimmed to what it takes. A pass that does not fit selects densely."""
        if self.limit is None:
            return True
        limit = self.limit(g.temp > 0, g.top_n)
        need = len(g.ids) + sum(m.n_ids() for m in g.masks or ())
        g.width = min(g.width, limit)
        return need <= limit

    def _gather(self, h: Histories, want: Sequence[int] = (), probs: bool = True,
                masks: Sequence[Mask | None] | None = None, lp: bool = False, save: bool = False) -> Gather | None:
        """The pass's Gather when it selects in the graph (None: dense)."""
        if not self.graph:
            return None
        g = self.sel.gather(h, want, probs=probs, masks=masks, logprobs=self.logprobs if lp else None,
                            save_last=save)
        if self.grow and g.n_rows == 1:
            g.width = max(g.width, self._one_row_width(g))
        return g if self._fits(g) else None

    def _one_row_width(self, g: Gather) -> int:
        """The gather width of every one-row pass of an AR answer, sized once for all of it. With the penalties each
        token the answer writes can add its id to the gather, and a gather outgrowing its width takes a new sampler,
        which llama.cpp attaches by re-reserving its compute buffers at the next decode (fresh pages, the graph
        built anew): on the slice35b about 35 ms more each (one thread), two of them in a 128-token answer (32 ->
        128 -> 512 ids), 2% of its time. So the first one-row gather (the prompt's) takes the width the whole answer
        can need, up to ONE_ROW_WIDTH_MAX: a longer answer outgrows it once more at most, over thousands of steps.
        The graph gathers that many ids a step; the host's Python stays the same (the ids and coefficients are as
        many as the answer has, the sampler pads them)."""
        if not self.one_row_width:
            need = len(g.ids) + sum(m.n_ids() for m in g.masks or ()) + (self.grow if self.sel.history else 0)
            self.one_row_width = gather_width(min(need, ONE_ROW_WIDTH_MAX))
        return self.one_row_width

    def _timed(self, kind: str, rows: int, call, *args):
        t0 = self.clock()
        out = call(*args)
        if self.costs is not None:
            self.costs.observe(kind, rows, self.clock() - t0)
        return out

    def prefill(self, ids: Sequence[int], h: Histories, masks: Sequence[Mask | None] | None = None,
                lp: bool = False, save: bool = False) -> Choice:
        """The prompt's pass and the choice of the first token (its confidence is not computed in the graph); masks:
        the row's restriction; lp: its logprobs are needed (save: for a token chosen later)."""
        g = self._gather(h, probs=False, masks=masks, lp=lp, save=save)
        if g is not None:
            return self.sel.choose(h, self.b.prefill_rows(ids, g), g)
        return self.sel.choose(h, self.b.prefill(ids)[None], masks=masks)

    def prefill_only(self, ids: Sequence[int]) -> None:
        """A prompt's pass whose row nobody reads (the block modes' blocks start all-mask)."""
        if self.graph:
            self.b.prefill_rows(ids, None)
        else:
            self.b.prefill(ids)

    def commit(self, ids: Sequence[int], h: Histories, want: Sequence[int] = (), probs: bool = False,
               draft: bool = False, masks: Sequence[Mask | None] | None = None, lp: bool = False,
               save: bool = False) -> Choice:
        """A causal pass committing `ids` and the choices of its rows; probs: the probabilities of `want` (and the
        confidences) are needed, not just the tokens; draft: a verification, which may be rolled back; masks: the
        rows' restrictions; lp: the rows' logprobs are needed (save: also of a token chosen later, in the last)."""
        if self.can_keep_backup:
            self.b.keep_backup = draft
        g = self._gather(h, want, probs=probs, masks=masks, lp=lp, save=save)
        if g is not None:
            return self.sel.choose(h, self._timed("causal", len(ids), self.b.commit_rows, ids, g), g)
        return self.sel.choose(h, self._timed("causal", len(ids), self.b.commit, ids), masks=masks)

    def commit_only(self, ids: Sequence[int]) -> None:
        """A causal pass whose rows nobody reads (a finished block)."""
        if self.can_keep_backup:
            self.b.keep_backup = False
        if self.graph:
            self._timed("causal", len(ids), self.b.commit_rows, ids, None)
        else:
            self._timed("causal", len(ids), self.b.commit, ids)

    def block(self, block: Sequence[int], positions: Sequence[int], h: Histories,
              masks: Sequence[Mask | None] | None = None) -> Choice:
        g = self._gather(h, masks=masks)
        if g is not None:
            return self.sel.choose(h, self._timed("block", len(block), self.b.block_rows, block, positions, g), g)
        return self.sel.choose(h, self._timed("block", len(block), self.b.block_logits, block)[list(positions)],
                               masks=masks)

    def rollback(self, n: int, kept: int, now: bool) -> None:
        """Forget the last n committed tokens (`kept`: the tokens of that commit that stay); now: apply it at once
        (timed) where the backend would defer it to its next pass."""
        self.b.rollback(n)
        settle = getattr(self.b, "settle", None)
        if now and n and settle is not None:
            self._timed("rollback", max(1, kept), settle)


# ---------------------------------------------------------------------------------------------------------------
# Constrained output: the grammar's state as the decoders follow it
# ---------------------------------------------------------------------------------------------------------------
class _Grammar:
    """An answer's constraint as the decoders use it: the mask of its current state as a constraint.Mask (copied and
    counted once; a repeat of the previous mask's content is that mask; the end tokens alone once the grammar is
    finished or allows nothing a row may choose), acceptance, rollback, and which rows of a pass apply their
    restriction (CHEAP_MASK_IDS)."""

    def __init__(self, constraint: Constraint, eos: frozenset[int], never: Sequence[int], n_vocab: int | None,
                 forced: bool = True):
        self.c, self.eos = constraint, frozenset(int(t) for t in eos)
        self.never = [int(t) for t in never if t is not None and int(t) >= 0]
        self.n_vocab = n_vocab
        self.forcing = forced  # forced tokens are placed without a pass (forced())
        self._now: Mask | None = None  # the current state's mask (None: not fetched since the state changed)
        self._last: Mask | None = None  # the mask fetched last
        self._ends: Mask | None = None
        self._run: list[int] | None = None  # the forced run from the current state, as forced() found it
        self._run_width = 0

    def mask(self) -> Mask | None:
        """What the current state allows next (None: anything; only an answer without end tokens)."""
        if self._now is None:
            self._now = self._fetch()
        return self._now

    def _fetch(self) -> Mask | None:
        if self.c.finished():
            return self._end_mask(None)
        words = np.asarray(self.c.mask())
        m = Mask(words, self.n_vocab or 32 * words.size)
        if m.n_allowed - sum(m.allows(t) for t in self.never) <= 0:  # nothing a row may choose: the answer ends
            return self._end_mask(m.n_vocab)
        if m.same(self._last):
            return self._last
        self._last = m
        return m

    def _end_mask(self, n_vocab: int | None) -> Mask | None:
        if self._ends is None and self.eos:
            if n_vocab is None:
                n_vocab = self.n_vocab or 32 * np.asarray(self.c.mask()).size
            self._ends = Mask.of(sorted(self.eos), n_vocab)
        return self._ends

    def allows(self, mask: Mask | None, token: int) -> bool:
        return mask is None or mask.allows(int(token))

    def accept(self, token: int) -> bool:
        """Advance by `token` (never an end token); False: the grammar refuses it here (the state unchanged)."""
        ok = bool(self.c.accept(int(token)))
        if ok:
            run, self._run, self._now = self._run, None, None
            if run and run[0] == int(token) and len(run) > 1:  # on along a forced run: the next state's mask is
                self._run = run[1:]  # its next token alone (constraint.Forcing's contract), no engine call
                self._now = Mask.one(run[1], self._run_width)
        return ok

    def forced(self, limit: int) -> list[int]:
        """The tokens the grammar forces from the current state (at most `limit`; not accepted): where the state's
        mask allows one token alone, the constraint's forced run when it names one that starts with that token
        (constraint.Forcing), else that token. [] where the grammar leaves a choice, where forced tokens are off,
        where the token is an end token or one no row may choose."""
        if limit <= 0 or not self.forcing:
            return []
        if self._run is None:
            m = self.mask()
            t = None if m is None else m.only()
            if t is None or t in self.eos or t in self.never:
                return []
            name = getattr(self.c, "forced", None)
            run = [int(x) for x in name()] if name is not None else []
            self._run = run if run and run[0] == t else [t]
            bad = next((i for i, x in enumerate(self._run) if x in self.eos or x in self.never), len(self._run))
            self._run = self._run[:max(1, bad)]
            self._run_width = m.n_vocab
        return self._run[:limit]

    def take(self, token: int) -> None:
        """Advance by a token a pass chose under this state's mask: the grammar must take it."""
        if not self.accept(token):
            raise RuntimeError(f"the constraint refused token {token}, which its own mask allowed")

    def rollback(self, n: int) -> None:
        if n > 0:
            self.c.rollback(n)
            self._now = self._run = None

    @staticmethod
    def split(masks: Sequence[Mask | None], probs: bool) -> tuple[list[Mask | None], list[Mask | None]]:
        """A pass's row masks -> (the ones its selection applies, the ones its choices are checked against after
        it): a cheap restriction always applies; a wide one where the pass has one row or needs the restricted
        probabilities (probs)."""
        eager = probs or len(masks) == 1  # (a forced row's mask, one id, is applied whatever CHEAP_MASK_IDS says)
        applied = [m if m is not None and (eager or m.n_ids() <= CHEAP_MASK_IDS or m.n_allowed == 1) else None
                   for m in masks]
        return applied, [m if a is None else None for m, a in zip(masks, applied)]


class _Track:
    """A grammar followed through one block (diffusion's, a draft's): its resolved positions validated in order from
    the block's start, each accepted into the grammar (an end token checked against its mask, never accepted); the
    first one the grammar refuses is masked again (what follows it stays resolved until the validation reaches it).
    masks[j]: what position j allows (the grammar's state after the block's first j tokens); the head, position n,
    is the first position not validated. draft: the block is a draft, which ends at its first refused token (what
    follows was guessed after a token the grammar refuses; the verification decides from there on)."""

    def __init__(self, gram: _Grammar, draft: bool = False):
        self.gram, self.draft = gram, draft
        self.masks: list[Mask | None] = [gram.mask()]
        self.n = 0
        self.ended = False  # an end token validated (at position n - 1)
        self.strict = False  # a pass chose a token the head does not allow: the next restricts the head, wide or not
        self.refused = False  # the grammar refused a resolved token
        self.forced: set[int] = set()  # positions the grammar's forced tokens filled (never refused, never re-masked)
        self.placed: list[int] = []  # of them, the ones not yet reported (resolve_block's "forced" event)
        self.refusals: list[int] = []  # positions refused since the last pass event (its "refused")

    @property
    def accepted(self) -> int:
        """The block's tokens accepted into the grammar."""
        return self.n - self.ended

    def head(self) -> Mask | None:
        return self.masks[self.n]

    def validate(self, block: list[int], resolved: list[bool], mask_token: int) -> None:
        """Validate the resolved positions from the head on; where the head is masked and the grammar forces
        tokens there, fill the masked positions from the head with them (up to the first resolved one or the
        block's end: what lies past needs a pass) and go on validating."""
        gram = self.gram
        while True:
            while not self.ended and self.n < len(block) and resolved[self.n]:
                t = int(block[self.n])
                end = t in gram.eos
                if not (gram.allows(self.masks[self.n], t) if end else gram.accept(t)):
                    block[self.n], resolved[self.n] = mask_token, False
                    self.strict = self.refused = True
                    self.refusals.append(self.n)
                    if self.draft:
                        return
                    break
                self.n += 1
                self.strict = False
                if end:
                    self.ended = True
                else:
                    self.masks.append(gram.mask())
            if self.ended or self.n >= len(block):
                return
            filled = 0
            for t in gram.forced(len(block) - self.n):
                i = self.n + filled
                if resolved[i]:
                    break
                block[i], resolved[i] = t, True
                self.forced.add(i)
                self.placed.append(i)
                filled += 1
            if not filled:
                return

    def row_masks(self, d: int) -> list[Mask | None]:
        """The restrictions of a causal pass over the block's first d (validated) tokens: row i predicts the token
        after position i, which masks[i + 1] restricts (nothing after an end token)."""
        return [self.masks[i + 1] if i + 1 < len(self.masks) else None for i in range(d)]


# ---------------------------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class TokenLogprob:
    """A kept token's log-probability under the processed row it was kept from (the card's controls, the never-chosen
    ids and the grammar applied; temperature 1), and that row's `top` most likely tokens as (token, logprob), the
    most likely first (as many as asked for, fewer where the row allows fewer)."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def _token_lp(choice: Choice, i: int, token: int, n: int | None) -> TokenLogprob:
    return TokenLogprob(int(token), choice.logprob(i, int(token)), choice.top(i, n) if n else [])

@dataclass
class GenerationStats:
    mode: str
    prompt_tokens: int = 0
    generated_tokens: int = 0
    forward_passes: int = 0  # every prefill / commit / block_logits call, the prompt's included
    block_passes: int = 0  # the block_logits calls among them
    # drafted / accepted: block-proposed tokens that a causal pass checked, and how many of them it would have chosen
    # itself (draft-self: its verification; diffusion: the commit pass's own choices): the check of the block reading
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    drafts: int = 0  # draft-self blocks verified (draft-self, auto)
    ar_steps: int = 0  # causal steps after a kept token (ar, auto): one token each, and the forced tokens after it
    # tokens the grammar forced (a constraint allowing one continuation alone) that the answer kept, placed without a
    # pass of their own: carried by an AR step's pass after its token, or filling a block's masked positions before a
    # block pass; in generated_tokens, so tokens_per_pass counts them (they are not in drafted_tokens or
    # accepted_tokens, which count the tokens the model proposed)
    forced_tokens: int = 0
    # auto: tokens per second its choices were predicted to give, and gave, both over the moves it made (AR runs and
    # drafts, timed by the decoder's clock); None in the other modes
    predicted_tokens_per_s: float | None = None
    measured_tokens_per_s: float | None = None
    # auto: what a block pass costs in AR steps on this machine, from the pass costs it measured (why it chose AR where
    # it did: a draft pays only when its block passes yield more tokens than that); None in the other modes or until
    # both were timed
    block_pass_ar_steps: float | None = None
    finish_reason: str | None = None  # "stop" (end token) or "length"
    short_blocks: int = 0  # blocks cut to the tokens the answer could still keep (_kept_block)

    @property
    def tokens_per_pass(self) -> float:
        return self.generated_tokens / self.forward_passes if self.forward_passes else 0.0

    @property
    def decode_passes(self) -> int:
        """The passes after the prompt's: every mode starts with one prompt pass (prefill, counted once however
        llama.cpp splits it), which writes no token of its own in the block modes and only the first in AR."""
        return max(self.forward_passes - 1, 0)

    @property
    def tokens_per_decode_pass(self) -> float:
        """Tokens per pass after the prompt's: AR's is 1.00 (its first token comes with the prompt's pass, its last
        pass finds the end token), a block mode's says what its blocks and drafts wrote."""
        return self.generated_tokens / self.decode_passes if self.decode_passes else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def accepted_per_draft(self) -> float | None:
        return self.accepted_tokens / self.drafts if self.drafts else None


@dataclass
class Chunk:
    """Tokens resolved since the previous chunk (never an end token) and the running stats of this run; with
    logprobs, one TokenLogprob per token."""

    tokens: list[int]
    stats: GenerationStats
    finished: bool = False
    logprobs: list[TokenLogprob] | None = None


# ---------------------------------------------------------------------------------------------------------------
# The shared block-resolving loop
# ---------------------------------------------------------------------------------------------------------------
def _first_end(block: list[int], resolved: list[bool], eos: frozenset[int]) -> int | None:
    """Index of the first end token if every position up to it is resolved, else None."""
    for i, (t, r) in enumerate(zip(block, resolved)):
        if not r:
            return None
        if t in eos:
            return i
    return None


# How a block pass may resolve end tokens (docs/tiny-model.md, "The end token in block decoding"):
#   "plain"  the card's rule: an end token is filled like any other token;
#   "prefix" an end token is filled only where every position before it is resolved (or filled in the same pass);
#   "strict" an end token must be more confident than END_THRESHOLD (not just the block threshold) to be filled
#            while positions before it are masked;
#   "tail"   the card's rule, and once an end token is resolved, the masked positions after it are filled with end
#            tokens in the same pass.
END_RULES = ("prefix", "plain", "strict", "tail")
DEFAULT_END_RULE = "prefix"
END_THRESHOLD = 0.999
# The fill threshold of a draft that a causal pass verifies exactly (draft-self with accept="exact", auto's drafts),
# where the caller sets none (runtime: no --threshold): the draft only proposes and the causal pass decides every token,
# so a lower bar than the card's 0.95 (a diffusion rule: there the filled token is the answer) leaves the text as it is
# and spares the block passes that only lift a position from, say, 0.7 to 0.95. Bundled model, 39 held-out prompts x 2:
# the same 17.9 tokens accepted per draft at 0.95 and at 0.5, in 1.52 and 1.02 block passes a draft (docs/runtime.md,
# "Draft threshold").
DRAFT_THRESHOLD = 0.5
# A draft stops at the first block pass that leaves its usable prefix (the resolved positions before the first masked
# one: all a verification can keep) where it was, and is verified then. Such a pass filled positions behind a masked
# one, which count only once a later pass fills the gap; the gap is the position the model is least sure of, where
# the draft tends to go wrong anyway. A head the grammar refused is not a stall (the next pass restricts it).
# bench/drafts.py, the tool model's 150 held-out rows, greedy, exact: resolving every draft whole took 6.27 block
# passes a draft for 8.5 accepted tokens (1.28 tokens a pass, draft-self 0.221x ar); stopping at the first such pass
# 2.37 for 7.0 (2.31 tokens a pass, 0.405x ar); at the second (a trial) 3.49 for 7.5. The bundled model's drafts fill
# in about one pass and are unchanged (1.04 -> 1.03 block passes a draft). docs/runtime.md, "A draft stops at a
# stall". Diffusion never stops so: its filled tokens are the answer. Only drafts that fill at the draft threshold
# (generate's draft_threshold: the runtime's default) stop so; drafts at a given threshold resolve whole, as the card's.
STOP_AT_STALL = True


def _end_rule_fill(end_rule: str, is_end: np.ndarray, conf: np.ndarray, threshold: float) -> list[int]:
    """The masked positions (indices into the pass's masked list, in block order) a pass fills under `end_rule`."""
    over = conf > threshold
    if end_rule == "strict":
        # an end token behind a masked position needs END_THRESHOLD; at the first masked position nothing is behind
        over &= ~is_end | (conf > END_THRESHOLD) | (np.arange(len(conf)) == 0)
    if end_rule == "prefix":
        keep, all_before = [], True  # all_before: every masked position so far is filled in this pass
        for m in range(len(conf)):
            ok = bool(over[m]) and (all_before or not is_end[m])
            keep.append(ok)
            all_before &= ok
        over = np.array(keep, dtype=bool)
    fill = np.flatnonzero(over).tolist()
    if fill:
        return fill
    # none over the threshold: the single most confident position, where the rule lets an end token be
    allowed = np.ones(len(conf), dtype=bool)
    if end_rule in ("prefix", "strict"):
        allowed = ~is_end | (np.arange(len(conf)) == 0)
        if end_rule == "strict":
            allowed |= conf > END_THRESHOLD
    return [int(np.argmax(np.where(allowed, conf, -1.0)))]


def resolve_block(backend: Backend, block: list[int], resolved: list[bool], generated: Sequence[int],
                  threshold: float, sampler: Sampler | Selector | _Passes, processors: Sequence[Processor] = (),
                  stats: GenerationStats | None = None, end_rule: str = DEFAULT_END_RULE,
                  max_passes: int | None = None, track: _Track | None = None, stop_at_stall: bool = False) -> int:
    """Fill the masked positions of `block` in place by block-mode passes (the card's LowConfidence rule).

    Each pass fills every masked position whose confidence exceeds `threshold`, or, if none does, the single most
    confident masked position (the lowest index on ties); end tokens as `end_rule` says (END_RULES). Stops when
    every position is resolved, or when an end token is resolved with every position before it resolved (what
    follows it is never used), or after `max_passes` passes (a bounded draft), or (stop_at_stall, a draft) after a
    pass that left the draft's usable prefix where it was (see STOP_AT_STALL). `sampler`: a sampler (with
    `processors`), or the answer's Selector / passes.
    -> the number of positions that matter: index of the first end token + 1, or len(block); after max_passes or
    a stall with positions still masked, the resolved positions before the first masked one (what a draft can use).
    track: the grammar followed through the block (_Track): before each pass the resolved positions are validated in
    order and the head's row is restricted to the grammar's mask (a wide mask: checked, see CHEAP_MASK_IDS); the
    positions that matter are then all validated (a draft's: up to its first refused token).
    """
    if end_rule not in END_RULES:
        raise ValueError(f"end_rule must be one of {END_RULES}, not {end_rule!r}")
    passes = sampler if isinstance(sampler, _Passes) else _Passes(
        backend, sampler if isinstance(sampler, Selector) else _selector(backend, processors, sampler))
    stats = stats if stats is not None else GenerationStats(mode="diffusion")
    eos = backend.eos_ids
    eos_arr = np.fromiter(sorted(eos), dtype=np.int64, count=len(eos))
    done = 0
    usable = -1  # a draft's resolved positions before its first masked one, before the last pass

    def report() -> None:  # the positions forced tokens filled since the last report
        if track.placed and passes.observe is not None:
            passes.observe({"type": "forced", "filled": list(track.placed),
                            "tokens": [block[i] for i in track.placed]})
        track.placed = []

    while True:
        if track is not None:
            track.validate(block, resolved, backend.mask_token_id)
            report()
            if track.draft and track.refused:  # a draft ends at its first refused token
                return track.n
        end = _first_end(block, resolved, eos)
        if end is not None:
            return end + 1
        if all(resolved):
            return len(block)
        if max_passes is not None and done >= max_passes:
            return resolved.index(False)
        if stop_at_stall:  # (a head the grammar refused is not a stall: the next pass restricts it, track.strict)
            now = resolved.index(False)
            if now == usable and not (track is not None and track.strict):
                return now
            usable = now
        masked, lens, tail = [], [], []  # tail: the resolved tokens in block order; lens: how many precede each
        for i, r in enumerate(resolved):
            if r:
                tail.append(block[i])
            else:
                masked.append(i)
                lens.append(len(tail))
        h = Histories(generated, tail, lens)  # tokens_so_far at each masked position
        masks = check = None
        if track is not None:  # the head is the first masked position (validated up to it)
            head = track.head()
            if head is not None and (track.strict or len(masked) == 1 or head.n_ids() <= CHEAP_MASK_IDS):
                masks = [head] + [None] * (len(masked) - 1)
            else:
                check = head
        choice = passes.block(block, masked, h, masks=masks)  # commits nothing
        done += 1
        stats.forward_passes += 1
        stats.block_passes += 1
        tok, conf = choice.tokens, choice.conf  # [M], [M]
        if check is not None and not check.allows(int(tok[0])):  # the head's choice, unrestricted, is refused:
            conf = conf.copy()  # not filled in this pass; the next restricts it
            conf[0] = -1.0
            track.strict = True
        is_end = (np.asarray(tok)[:, None] == eos_arr).any(axis=1)  # [M] (np.isin costs 5x more on a block's rows)
        for m in _end_rule_fill(end_rule, is_end, conf, threshold):
            block[masked[m]], resolved[masked[m]] = int(tok[m]), True
        if end_rule == "tail":
            first = next((i for i, (t, r) in enumerate(zip(block, resolved)) if r and t in eos), None)
            ends = sorted(eos)
            for m, i in enumerate(masked):
                if first is not None and i > first and not resolved[i]:
                    block[i], resolved[i] = choice.best_of(m, ends), True
        if track is not None:  # validated at once: a token the grammar refuses is never shown filled
            track.validate(block, resolved, backend.mask_token_id)
        if passes.observe is not None:
            new = set(track.placed) if track is not None else ()  # filled by forced tokens after the pass
            filled = [i for i in masked if resolved[i] and i not in new]
            event = {"type": "pass", "filled": filled, "tokens": [block[i] for i in filled],
                     "masked": [i for i in masked if not resolved[i]]}
            if track is not None:  # positions filled by an earlier pass that the grammar refused now: masked again
                gone = set(masked)  # (and maybe filled by forced tokens since: a "forced" event follows)
                event["refused"] = sorted({i for i in track.refusals if i not in gone})
            passes.observe(event)
        if track is not None:
            track.refusals = []
            report()


# ---------------------------------------------------------------------------------------------------------------
# The generators
# ---------------------------------------------------------------------------------------------------------------
def generate(backend: Backend, prompt_ids: Sequence[int], mode: str = "diffusion", max_new_tokens: int = 256,
             block_size: int | None = None, threshold: float = 0.95, accept: str = "exact",
             sampler: Sampler | None = None, logits_processors: Sequence[Processor] = (),
             stats: GenerationStats | None = None, end_rule: str = DEFAULT_END_RULE,
             costs: PassCosts | None = None, policy: AutoPolicy | None = None,
             clock: Callable[[], float] = time.perf_counter, draft_threshold: float | None = None,
             observe: Callable[[dict], None] | None = None, constraint: Constraint | None = None,
             logprobs: int | None = None, never: Sequence[int] = (), forced: bool = True) -> Iterator[Chunk]:
    """Decode an answer after `prompt_ids`, yielding Chunks as tokens resolve; the last one has finished=True.

    mode "ar": one causal pass per token. "diffusion": blocks of `block_size` positions start all-mask and are
    resolved by block passes (resolve_block); a finished block is committed by one causal pass; an end token ends
    the answer. "draft-self": block passes draft, one causal pass verifies (see _draft_self).
    threshold: the confidence a block position must exceed to be filled in a pass (and, with accept="threshold",
    the causal probability a draft token needs to be kept). "auto": per block, AR steps or a draft-self block,
    whichever the measured pass costs and this answer's acceptance say is faster (clover_gguf.auto; `accept` as in
    draft-self, so greedy auto is AR's text). The backend is reset first.
    draft_threshold: the fill threshold of drafts verified exactly (draft-self and auto with accept="exact"; e.g.
    DRAFT_THRESHOLD), in place of `threshold` there; such drafts are also verified at their first stall
    (STOP_AT_STALL). None: drafts fill at `threshold` and resolve their block whole, as the card's (check-block's
    figures, compared with the card's draft acceptance, keep their meaning so).
    observe: called with a plain dict as the answer's passes go (serve's block view; None costs nothing). Positions
    are a block's, 0-based: {"type": "block", "kind": "diffusion"|"draft", "size", "start" (answer tokens before it),
    "known", "tokens"} (a draft knows its position 0, the pending causal token); {"type": "pass", "filled", "tokens",
    "masked"} (a block pass: the positions it filled, their tokens, those still masked; with a constraint also
    "refused": positions an earlier pass filled that the grammar refused, masked again); {"type": "verify", "drafted",
    "accepted", "cut", "ended", "next"} (a draft's causal pass: positions before `cut` kept, `next` the causal token
    at `cut`, None when an accepted end token ended the answer); {"type": "commit", "size", "agreed"} (diffusion's
    commit pass); {"type": "ar", "token"} (one AR step, committing the answer's last token).
    never: ids no pass of this answer may choose, beside the mask token (Selector's `never`): the end tokens make an
    answer that runs to max_new_tokens (serve's ignore_eos; in the block modes no block pass fills them).
    stats: the object to count into (a caller's subclass with more fields, e.g. runtime.RunStats); by default a
    new GenerationStats. The chunks carry it.
    end_rule: how block passes resolve end tokens (END_RULES; "plain" is the card's rule).
    costs: the pass costs to time passes into (auto.PassCosts, kept by the caller across answers; auto makes one when
    none is given). policy: auto's AutoPolicy for this answer (default: a new one over `costs`). clock: the time
    source of both (a test's fake clock).
    constraint: the grammar every kept token must follow (module doc, "Constrained output"), in the state before the
    answer. logprobs: None (off), or the alternatives (0..TOP_LOGPROBS_MAX) each kept token's logprob comes with
    (Chunk.logprobs).
    forced: where the constraint allows one continuation alone, its tokens are placed without a pass of their own
    (module doc, "Forced tokens"); False: every token costs its pass, as without a grammar (the benches' comparison).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if accept not in ACCEPT_MODES:
        raise ValueError(f"accept must be one of {ACCEPT_MODES}, not {accept!r}")
    if end_rule not in END_RULES:
        raise ValueError(f"end_rule must be one of {END_RULES}, not {end_rule!r}")
    if not len(prompt_ids):
        raise ValueError("the prompt is empty")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, (int, np.integer)) or
                                 not 0 <= logprobs <= TOP_LOGPROBS_MAX):
        raise ValueError(f"logprobs must be None or an integer in [0, {TOP_LOGPROBS_MAX}], not {logprobs!r}")
    block_size = int(block_size or backend.block_size)
    if stats is None:
        stats = GenerationStats(mode=mode, prompt_tokens=len(prompt_ids))
    backend.reset()
    if mode == "auto":
        if policy is None:
            policy = AutoPolicy(costs if costs is not None else PassCosts(), block_size)
        costs = policy.costs
    passes = _Passes(backend, _selector(backend, logits_processors, sampler, never), costs, clock, observe,
                     None if logprobs is None else int(logprobs))  # one per answer
    gram = None if constraint is None else _Grammar(constraint, backend.eos_ids, [backend.mask_token_id, *never],
                                                    getattr(backend, "n_vocab", None), forced=forced)
    # a draft's fill threshold (with accept="threshold" the one threshold is also the acceptance's: kept as given)
    fast = draft_threshold is not None and accept == "exact"  # drafts that only propose: see draft_threshold
    fill = draft_threshold if fast else threshold
    stall = fast and STOP_AT_STALL
    if mode == "auto":
        gen = _auto(passes, prompt_ids, max_new_tokens, block_size, fill, accept, stats, end_rule, policy, gram, stall)
    elif mode == "ar":
        passes.grow = max_new_tokens  # each token may add an id to the gathers: their width is set once (_Passes)
        gen = _ar(passes, prompt_ids, max_new_tokens, stats, gram, block_size)
    elif mode == "diffusion":
        gen = _diffusion(passes, prompt_ids, max_new_tokens, block_size, threshold, stats, end_rule, gram)
    else:
        gen = _draft_self(passes, prompt_ids, max_new_tokens, block_size, fill, accept, stats, end_rule, gram, stall)
    yield from gen


def generate_all(backend: Backend, prompt_ids: Sequence[int], **kwargs) -> tuple[list[int], GenerationStats]:
    """Run `generate` to the end -> (answer tokens without the end token, stats)."""
    tokens: list[int] = []
    stats = None
    for chunk in generate(backend, prompt_ids, **kwargs):
        tokens += chunk.tokens
        stats = chunk.stats
    return tokens, stats


def _emit(tokens: list[int], out: list[int], max_new: int, stats: GenerationStats) -> tuple[list[int], bool]:
    """Append tokens (cut at max_new) -> (what was appended, whether the length limit is reached)."""
    take = tokens[:max(0, max_new - len(out))]
    out += take
    stats.generated_tokens = len(out)
    return take, len(out) >= max_new


def _finish(stats: GenerationStats, tokens: list[int], reason: str,
            logprobs: list[TokenLogprob] | None = None) -> Chunk:
    stats.finish_reason = reason
    return Chunk(tokens, stats, finished=True, logprobs=None if logprobs is None else logprobs[:len(tokens)])


def _chunk(tokens: list[int], stats: GenerationStats, logprobs: list[TokenLogprob] | None) -> Chunk:
    return Chunk(tokens, stats, logprobs=None if logprobs is None else logprobs[:len(tokens)])


def _first(passes: _Passes, prompt_ids, out: list[int], gram: _Grammar | None, stats: GenerationStats
           ) -> tuple[int, TokenLogprob | None]:
    """The prompt's pass -> the causal choice of the answer's first token (not committed) and its logprob."""
    lp = passes.logprobs is not None
    choice = passes.prefill(prompt_ids, Histories(out), masks=None if gram is None else [gram.mask()], lp=lp)
    stats.forward_passes += 1
    t = int(choice.tokens[0])
    return t, (_token_lp(choice, 0, t, passes.logprobs) if lp else None)


def _ar(passes: _Passes, prompt_ids, max_new, stats, gram: _Grammar | None = None, block_size: int = 1
        ) -> Iterator[Chunk]:
    out = []
    pending, pending_lp = _first(passes, prompt_ids, out, gram, stats)  # predicts the first answer token
    while True:
        if pending in passes.b.eos_ids:
            yield _finish(stats, [], "stop")
            return
        took, full = _emit([pending], out, max_new, stats)
        lps = None if pending_lp is None else [pending_lp]
        if full:
            yield _finish(stats, took, "length", lps)
            return
        if gram is not None:
            gram.take(pending)
        yield _chunk(took, stats, lps)
        step = _ar_step(passes, out, stats, gram, _forced_room(block_size, max_new, out))
        pending, pending_lp = step.next, step.next_lp
        if step.forced:
            yield _chunk(_emit(step.forced, out, max_new, stats)[0], stats, step.forced_lps)


def _forced_room(block_size: int, max_new: int, out: list[int]) -> int:
    """The forced tokens an AR step may carry after the answer's last token: its pass holds a block's rows at most,
    and the answer keeps room for the choice after them (its last token is chosen, never committed, as without)."""
    return max(0, min(block_size - 1, max_new - len(out) - 1))


@dataclass
class _Step:
    """One AR step: the forced tokens it committed after the answer's last token (accepted into the grammar, not
    yet in the answer) and their logprobs, and the causal choice after them and its logprob."""

    next: int
    next_lp: TokenLogprob | None = None
    forced: list[int] = field(default_factory=list)
    forced_lps: list[TokenLogprob] | None = None


def _ar_step(passes: _Passes, out: list[int], stats: GenerationStats, gram: _Grammar | None = None,
             room: int = 0) -> _Step:
    """Commit the answer's last token (out[-1], already emitted; taken by the grammar) and, where the grammar forces
    the tokens after it, up to `room` of them in the same pass (accepted into the grammar here): row i restricted to
    the grammar's state after the first i of them, so a forced row can choose only its forced token (checked), and
    the last row's choice is the one AR would make after them, one step per token. -> the _Step."""
    lp = passes.logprobs is not None
    forced: list[int] = []
    rows = None if gram is None else [gram.mask()]
    while gram is not None and len(forced) < room:
        run = gram.forced(room - len(forced))
        if not run:
            break
        for t in run:
            gram.take(t)
            forced.append(t)
            rows.append(gram.mask())
    # out holds the token: the history of the next one; row i's also holds the first i forced tokens
    choice = passes.commit([out[-1], *forced], Histories(out, forced, range(len(forced) + 1)), masks=rows, lp=lp)
    stats.forward_passes += 1
    stats.ar_steps += 1
    stats.forced_tokens += len(forced)
    for i, f in enumerate(forced):
        if int(choice.tokens[i]) != f:
            raise RuntimeError(f"a row restricted to the forced token {f} chose {int(choice.tokens[i])}")
    if passes.observe is not None:
        passes.observe({"type": "ar", "token": out[-1], "forced": forced} if forced else
                       {"type": "ar", "token": out[-1]})
    k = len(forced)
    t = int(choice.tokens[k])
    return _Step(t, _token_lp(choice, k, t, passes.logprobs) if lp else None, forced,
                 [_token_lp(choice, i, f, passes.logprobs) for i, f in enumerate(forced)] if lp else None)


def _kept_block(block_size: int, room: int, stats: GenerationStats) -> int:
    """The length of the next block: at most the tokens the answer can still keep (`room`), as the reference's
    generation length never exceeds its blocks. Positions past them are never kept, yet a pass fills one position at
    least: a block of 600 for 64 tokens cost up to 600 passes (over 300 s on a random model). Counted in
    stats.short_blocks."""
    if room >= block_size:
        return block_size
    stats.short_blocks += 1
    return max(1, room)


def _diffusion(passes: _Passes, prompt_ids, max_new, block_size, threshold, stats, end_rule,
               gram: _Grammar | None = None) -> Iterator[Chunk]:
    backend, out = passes.b, []
    lp, n_top = passes.logprobs is not None, passes.logprobs
    pending = None  # (choice, row): the causal row that predicts the next block's first token (logprobs)
    if lp:  # the prompt's row, kept for the first block's first token, chosen only by the block passes
        pending = (passes.prefill(prompt_ids, Histories(out), masks=None if gram is None else [gram.mask()],
                                  lp=True, save=True), 0)
    else:
        passes.prefill_only(prompt_ids)  # commits the prompt; its logits are not used (blocks start all-mask)
    stats.forward_passes += 1
    while True:
        size = _kept_block(block_size, max_new - len(out), stats)
        block, resolved = [backend.mask_token_id] * size, [False] * size
        if passes.observe is not None:
            passes.observe({"type": "block", "kind": "diffusion", "size": size, "start": len(out), "known": [],
                            "tokens": []})
        track = None if gram is None else _Track(gram)
        n = resolve_block(backend, block, resolved, out, threshold, passes, stats=stats, end_rule=end_rule,
                          track=track)
        ended = block[n - 1] in backend.eos_ids
        body = block[:n - 1] if ended else block
        start = len(out)
        lps = None
        if lp:
            # logprobs: the block's first token from the row before it, the rest from one causal pass over the block
            # (the commit itself when the answer goes on, before the block is shown; else a pass over the kept tokens
            # but the last)
            took = body[:max(0, max_new - start)]
            lps = [_token_lp(pending[0], pending[1], took[0], n_top)] if took else []
            going_on = not ended and start + len(block) < max_new  # else this block ends the answer
            over = block if going_on else took[:-1]
            if over:
                rows = None if track is None else track.row_masks(len(over))
                choice = passes.commit(over, Histories(out, over, range(1, len(over) + 1)), want=took[1:],
                                       masks=rows, lp=True, save=going_on)
                stats.forward_passes += 1
                lps += [_token_lp(choice, i, took[i + 1], n_top) for i in range(len(took) - 1)]
                if going_on:
                    pending = (choice, len(block) - 1)
                    _count_commit(passes, stats, block, choice.tokens, _forced_at(track))
        took, full = _emit(body, out, max_new, stats)
        stats.forced_tokens += sum(1 for i in _forced_at(track) if i < len(took))
        if ended and len(took) == len(body):
            yield _finish(stats, took, "stop", lps)
            return
        if full:
            yield _finish(stats, took, "length", lps)
            return
        yield _chunk(took, stats, lps)
        if lp:
            continue  # committed above
        # one causal pass makes the block part of the prefix; its rows' own choices (the sampler's, controls on:
        # row i has the answer up to block[i] as history; the grammar's restrictions, the wide ones checked) say how
        # far the causal path agrees with the block
        rows = None if track is None else _Grammar.split(track.row_masks(len(block)), probs=False)[0]
        target = passes.commit(block, Histories(out[:start], block, range(1, len(block) + 1)), masks=rows).tokens
        stats.forward_passes += 1
        _count_commit(passes, stats, block, target, _forced_at(track))


def _forced_at(track: "_Track | None") -> set[int]:
    """The block positions forced tokens filled."""
    return set() if track is None else track.forced


def _count_commit(passes: _Passes, stats: GenerationStats, block: list[int], target: np.ndarray,
                  forced: frozenset[int] | set[int] = frozenset()) -> None:
    """A diffusion block's commit pass, counted: how far its rows' own choices agree with the block (the block
    tokens, after the first, its rows chose; the `forced` positions, which a grammar placed, are not counted)."""
    agreed = next((i for i in range(len(block) - 1) if block[i + 1] != int(target[i])), len(block) - 1)
    stats.drafted_tokens += len(block) - 1 - sum(1 for i in forced if i >= 1)
    stats.accepted_tokens += agreed - sum(1 for i in forced if 1 <= i <= agreed)
    if passes.observe is not None:
        passes.observe({"type": "commit", "size": len(block), "agreed": agreed})


@dataclass
class _Draft:
    """One verified draft-self block: the tokens it keeps (the pending causal token first, an accepted end token
    last), the causal choice after them, and its counts; with logprobs, the kept tokens' (an end token's not) and
    the next pending token's."""

    kept: list[int]
    next_pending: int
    proposed: int  # draft tokens the model proposed and the causal pass checked (forced ones not counted)
    accepted: int
    block_passes: int
    logprobs: list[TokenLogprob] | None = None
    next_lp: TokenLogprob | None = None
    forced: list[int] = field(default_factory=list)  # the kept positions forced tokens filled


def _draft_block(passes: _Passes, out: list[int], pending: int, block_size: int, threshold: float, accept: str,
                 stats: GenerationStats, end_rule: str, max_passes: int | None = None,
                 settle: bool = False, gram: _Grammar | None = None, pending_lp: TokenLogprob | None = None,
                 stop_at_stall: bool = False) -> _Draft:
    """Draft a block after the answer `out` whose first position is the pending causal token (block passes, at
    most max_passes; stop_at_stall: until a pass leaves its usable prefix unchanged), verify it with one causal pass,
    roll back what is not kept (settle: at once). With a grammar
    the draft is validated as it resolves (every draft token allowed where it stands), verification row i is
    restricted to the grammar's state after the draft's first i + 1 tokens, and the grammar is rolled back to what
    is kept; a row whose wide restriction was only checked and refused its choice ends the draft there, and that
    row is chosen again, restricted, by a one-token causal pass."""
    backend = passes.b
    eos = backend.eos_ids
    lp = passes.logprobs is not None
    block = [pending] + [backend.mask_token_id] * (block_size - 1)  # [B]
    resolved = [True] + [False] * (block_size - 1)
    if passes.observe is not None:
        passes.observe({"type": "block", "kind": "draft", "size": block_size, "start": len(out), "known": [0],
                        "tokens": [pending]})
    before = stats.block_passes
    track = None if gram is None else _Track(gram, draft=True)
    d = resolve_block(backend, block, resolved, out, threshold, passes, stats=stats, end_rule=end_rule,
                      max_passes=max_passes, track=track, stop_at_stall=stop_at_stall)
    draft = block[:d]  # [D]: draft[0] = pending, draft[1:] proposed; ends at the first end token if any
    rows = applied = checked = None
    if track is not None:
        rows = track.row_masks(d)
        applied, checked = _Grammar.split(rows, probs=accept == "threshold" or lp)
    # verify: one causal pass commits all D tokens; row i predicts the token after draft[i], its history is the
    # answer plus draft[:i + 1]
    causal = passes.commit(draft, Histories(out, draft, range(1, d + 1)),
                           want=draft[1:] if accept == "threshold" else (), probs=accept == "threshold", draft=True,
                           masks=applied, lp=lp)
    stats.forward_passes += 1
    target = causal.tokens  # [D]: target[i] = causal choice for position i + 1

    def unknown(i: int) -> bool:  # row i's restriction was only checked, and refused the row's choice
        return checked is not None and checked[i] is not None and not checked[i].allows(int(target[i]))

    if accept == "exact":
        ok = [draft[i + 1] == int(target[i]) and not unknown(i) for i in range(d - 1)]  # [D-1]
    else:
        ok = [causal.prob(i, draft[i + 1]) >= threshold for i in range(d - 1)]
    n_ok = next((i for i, good in enumerate(ok) if not good), d - 1)  # accepted draft tokens
    keep = 1 + n_ok  # [pending] + accepted proposals
    ended = draft[keep - 1] in eos  # an accepted end token (verified as the causal choice) ends the answer
    redo = not ended and unknown(keep - 1)  # the row after the kept tokens must be chosen again, restricted
    if track is not None:  # the grammar back to the kept tokens (an end token was never accepted)
        gram.rollback(track.accepted - (keep - ended))
    # forget the rejected suffix (and an accepted end token; and with a redo the last kept token, decoded again
    # with its row: settled now, while the verification's backup is the one to return to); an answer that ends
    # needs no settling
    passes.rollback(d - keep + ended + redo, keep - ended - redo, now=(settle or redo) and not ended)
    forced = _forced_at(track)  # positions a grammar placed: checked by the verification, but not the model's
    proposed = d - 1 - sum(1 for i in forced if 1 <= i < d)
    accepted = n_ok - sum(1 for i in forced if 1 <= i <= n_ok)
    stats.drafted_tokens += proposed
    stats.accepted_tokens += accepted
    stats.drafts += 1
    lps = next_lp = None
    if lp:
        lps = [pending_lp] + [_token_lp(causal, i, draft[i + 1], passes.logprobs) for i in range(n_ok)]
    if redo:
        again = passes.commit([draft[keep - 1]], Histories(out, draft, [keep]), masks=[rows[keep - 1]], lp=lp)
        stats.forward_passes += 1
        nxt, (src, row) = int(again.tokens[0]), (again, 0)
    else:
        nxt, (src, row) = int(target[keep - 1]), (causal, keep - 1)
    if lp and not ended:
        next_lp = _token_lp(src, row, nxt, passes.logprobs)
    if passes.observe is not None:
        passes.observe({"type": "verify", "drafted": d - 1, "accepted": n_ok, "cut": keep, "ended": ended,
                        "next": None if ended else nxt})
    return _Draft(draft[:keep], nxt, proposed, accepted, stats.block_passes - before, lps, next_lp,
                  sorted(i for i in forced if i < keep))


def _emit_draft(draft: _Draft, eos: frozenset[int], out: list[int], max_new: int, stats: GenerationStats
                ) -> tuple[Chunk, bool]:
    """Append a draft's kept tokens -> (the chunk to yield, whether the answer is finished)."""
    if draft.kept[-1] in eos:
        took, _ = _emit(draft.kept[:-1], out, max_new, stats)
        stats.forced_tokens += sum(1 for i in draft.forced if i < len(took))
        reason = "stop" if len(took) == len(draft.kept) - 1 else "length"
        return _finish(stats, took, reason, draft.logprobs), True
    took, full = _emit(draft.kept, out, max_new, stats)
    stats.forced_tokens += sum(1 for i in draft.forced if i < len(took))
    return (_finish(stats, took, "length", draft.logprobs), True) if full else \
        (_chunk(took, stats, draft.logprobs), False)


def _draft_self(passes: _Passes, prompt_ids, max_new, block_size, threshold, accept, stats, end_rule,
                gram: _Grammar | None = None, stall: bool = False) -> Iterator[Chunk]:
    out, eos = [], passes.b.eos_ids
    # the causal choice after the prompt, not committed
    pending, pending_lp = _first(passes, prompt_ids, out, gram, stats)
    while pending not in eos:
        draft = _draft_block(passes, out, pending, block_size, threshold, accept, stats, end_rule, gram=gram,
                             pending_lp=pending_lp, stop_at_stall=stall)
        chunk, finished = _emit_draft(draft, eos, out, max_new, stats)
        yield chunk
        if finished:
            return
        # causal choice after the kept tokens: the correction or the bonus
        pending, pending_lp = draft.next_pending, draft.next_lp
    yield _finish(stats, [], "stop")


def _auto(passes: _Passes, prompt_ids, max_new, block_size, threshold, accept, stats, end_rule,
          policy: AutoPolicy, gram: _Grammar | None = None, stall: bool = False) -> Iterator[Chunk]:
    """AR runs and draft-self blocks as `policy` plans them (clover_gguf.auto), each exact: the text is the one
    either mode alone gives (AR's, greedy). The policy is told what each move yielded and how long it took."""
    out, eos, clock = [], passes.b.eos_ids, passes.clock
    pending, pending_lp = _first(passes, prompt_ids, out, gram, stats)
    tokens, predicted_s, measured_s = 0, 0.0, 0.0

    def account(n: int, plan: Plan, seconds: float) -> None:
        nonlocal tokens, predicted_s, measured_s
        tokens, measured_s = tokens + n, measured_s + seconds
        if plan.predicted_tok_s:
            predicted_s += n / plan.predicted_tok_s
        stats.measured_tokens_per_s = tokens / measured_s if measured_s > 0 else None
        stats.predicted_tokens_per_s = tokens / predicted_s if predicted_s > 0 else None
        t_block, t_ar = policy.costs.predict("block", block_size), policy.ar_step_seconds()
        stats.block_pass_ar_steps = t_block / t_ar if t_block and t_ar else None

    while pending not in eos:
        plan = policy.plan()
        t0 = clock()
        if plan.kind == "draft":
            draft = _draft_block(passes, out, pending, block_size, threshold, accept, stats, end_rule,
                                 max_passes=plan.max_passes, settle=True, gram=gram, pending_lp=pending_lp,
                                 stop_at_stall=stall)
            seconds = clock() - t0
            policy.observe_draft(len(draft.kept), draft.proposed, draft.accepted, draft.block_passes, seconds,
                                 plan.probe)
            account(len(draft.kept), plan, seconds)
            chunk, finished = _emit_draft(draft, eos, out, max_new, stats)
            yield chunk
            if finished:
                return
            pending, pending_lp = draft.next_pending, draft.next_lp
            continue
        steps, seconds = 0, 0.0  # the steps' own time, not the reader's between two chunks
        for _ in range(plan.steps):
            took, full = _emit([pending], out, max_new, stats)
            lps = None if pending_lp is None else [pending_lp]
            if full:  # the run so far still counts, for the stats and the next answer
                policy.observe_ar(steps, seconds)
                account(steps + 1, plan, seconds)
                yield _finish(stats, took, "length", lps)
                return
            if gram is not None:
                gram.take(pending)
            yield _chunk(took, stats, lps)
            t0 = clock()
            step = _ar_step(passes, out, stats, gram, _forced_room(block_size, max_new, out))
            seconds += clock() - t0
            pending, pending_lp = step.next, step.next_lp
            steps += 1
            if step.forced:
                steps += len(step.forced)  # tokens the steps yielded: auto weighs AR's tokens per second
                yield _chunk(_emit(step.forced, out, max_new, stats)[0], stats, step.forced_lps)
            if pending in eos:
                break
        policy.observe_ar(steps, seconds)
        account(steps, plan, seconds)
    yield _finish(stats, [], "stop")
