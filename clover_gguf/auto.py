"""How `auto` decoding chooses, block by block, between plain AR steps and a draft-self block (docs/runtime.md,
"auto").

Block decoding pays only where a block pass costs less than the tokens it yields, which depends on the device (a
32-row pass costs about 1.5 AR steps on a big GPU, about 9 on a 2-core CPU at the 35B's widths) and on whether the
block tensors are read as the weights were trained (a wrong reading makes every draft a rejected one). Neither is
known in advance, so both are measured while answering:

* `PassCosts`: seconds per pass of each kind (causal, block, rollback) as a function of its rows, measured on this
  device from the passes themselves and kept current (the median of the last WINDOW timings per row count, a
  least-squares line a + b * rows across row counts). A median, not a mean: on a machine that other programs share,
  a pass whose thread was descheduled takes 10-1000x its price once in a while, and that is an outlier, not the new
  price (a stall must not send auto to the slower move for hundreds of tokens). It lives as long as the model is
  loaded: the next answer starts knowing them.
* `AutoPolicy`: per answer, the running acceptance of drafts (tokens kept per draft, block passes per draft, each an
  exponential average over the recent drafts; seconds per token of a draft, the median of the recent drafts) against
  the AR step's cost (the median of the recent AR runs). When one of the two moves' cost drifts (DRIFT) while the
  other is not being measured, the other is measured again: a few AR steps, or a probe draft. A draft is chosen when
  its measured (or, before any, predicted) tokens per second are at least AR's; otherwise a run of AR steps, and
  a probe draft after 1, 2, 4, ... PROBE_MAX runs, so that drafts that start to pay (code after prose) are noticed;
  where even a perfect draft could not pay on this device (one block pass costs more than a block of AR steps), a
  one-pass probe only every COST_PROBE_GAP runs, to see whether the costs changed.
  The block passes a draft may take are bounded by the same costs: no more than the AR steps that the draft's
  expected tokens would have cost.

Nothing here touches the model: `decoding._auto` asks `plan()` what to do next and reports what it did and what it
cost (`observe_*`). The policy is lossless by construction: both of its moves are exact (a greedy answer is AR's
text whatever it chooses).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

KINDS = ("causal", "block", "rollback")
WINDOW = 9  # a pass cost is the median of this many timings (a lasting change moves it within WINDOW // 2 + 1)
MOVE_WINDOW = 5  # the same for the cost of AR runs and of drafts: a change of topic shows within 3 drafts
KNOWN = 3  # warm values a cost rests on before it decides for long (fewer: the lowest of them stands for it)
DRIFT = 1.5  # a move's cost this far (either way) from where it was when the other move was last measured: re-measure
DRAFT_DECAY = 0.5  # weight of the past in the drafts' running averages of tokens and acceptance (no clock in them):
# a change of topic (drafts that start or stop paying) shows within a few
PROBE_MAX = 8  # this many AR runs between two probe drafts when drafts do not pay (at least: see PROBE_SHARE)
# while drafts do not pay, probes take at most this share of the time: a probe costs a draft's passes and the graph
# rebuilds around them (about 10 AR steps on the bundled model on a CPU), so it waits at least that many AR steps / 0.02
PROBE_SHARE = 0.02
# drafts stay chosen until their rate falls this far below AR's: one short draft at an answer's end (5 tokens for a
# block pass and a verification) must not send the next answers to AR
HYSTERESIS = 0.85
# AR runs between two probes where the pass costs say that even a draft accepted whole after one block pass would not
# pay (a CPU): acceptance cannot change that, only the costs can, and they are re-measured this rarely
COST_PROBE_GAP = 32
FIRST_AR_STEPS = 2  # an answer whose AR step cost is unknown measures it with this many AR steps first
PROBE_PASSES = 2  # block passes a draft may take while block passes have never been timed


class _Average:
    """An exponential running mean, for counts (tokens, passes, acceptance), never for times. The first value stands
    alone until the second replaces it (see _Recent)."""

    __slots__ = ("value", "n")

    def __init__(self) -> None:
        self.value: float | None = None
        self.n = 0

    def add(self, x: float, decay: float = DRAFT_DECAY) -> None:
        self.value = x if self.n < 2 else decay * self.value + (1.0 - decay) * x
        self.n += 1

    def carry(self, src: "_Average") -> None:
        """Start from another answer's figure: warm (two values or more), as one value that the next averages with;
        a single one, perhaps cold, as one that the next replaces."""
        self.value, self.n = src.value, min(src.n, 2)


class _Recent:
    """The median of the last `size` values: what a time costs on a machine whose other programs now and then take
    the core from the one that runs the model (an outlier then moves nothing, a lasting change moves it within
    size // 2 + 1 values). With fewer than 3 values, the lowest: a stall only ever makes a pass longer, so of two
    values the higher is the likelier outlier. The first value stands alone until the second replaces it: a process's
    first pass of a kind builds and allocates its graph and touches cold memory (a 5-token pass measured 30 ms cold
    against 1 ms warm on the bundled model), and it must not weigh on the figures that follow."""

    __slots__ = ("values", "n", "size")

    def __init__(self, size: int = WINDOW) -> None:
        self.values: list[float] = []
        self.n = 0
        self.size = size

    def add(self, x: float) -> None:
        if self.n == 1:  # the cold first value
            self.values.clear()
        self.values.append(float(x))
        del self.values[:-self.size]
        self.n += 1

    @property
    def value(self) -> float | None:
        if len(self.values) < KNOWN:
            return min(self.values) if self.values else None
        return statistics.median(self.values)

    def spread(self) -> tuple[float, float] | None:
        """(lowest, highest) of the values the median is taken over."""
        return (min(self.values), max(self.values)) if self.values else None

    def carry(self, src: "_Recent") -> None:
        """Start from another answer's values: warm ones as they are, a single (perhaps cold) one to be replaced."""
        self.values, self.n = list(src.values), min(src.n, 2)

    def restart(self) -> None:
        """Forget the values (they were measured on a machine that has changed since): the next value stands alone."""
        self.values.clear()
        self.n = 2 if self.n else 0  # a re-measurement is a warm one

@dataclass
class PassCosts:
    """Seconds per pass by kind ("causal", "block", "rollback") and rows, measured on the running device.

    predict(kind, rows): the least-squares line through the kind's per-row-count medians (each weighted by how often
    it was seen, at most 8), or the one median when a single row count was seen; None before any pass of the kind.
    A line's slope is never taken below 0 (a pass with more rows never costs less)."""

    buckets: dict[tuple[str, int], _Recent] = field(default_factory=dict)

    def observe(self, kind: str, rows: int, seconds: float) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown pass kind {kind!r}")
        if rows < 1 or not math.isfinite(seconds) or seconds < 0:
            return
        key = (kind, int(rows))
        avg = self.buckets.get(key)
        if avg is None:
            avg = self.buckets[key] = _Recent()
        avg.add(float(seconds))

    def warm(self, kind: str) -> bool:
        """A pass of this kind was timed at least twice at some row count (the first is a cold one)."""
        return any(k == kind and a.n >= 2 for (k, _), a in self.buckets.items())

    def predict(self, kind: str, rows: int) -> float | None:
        pts = [(r, a.value, min(a.n, 8)) for (k, r), a in self.buckets.items() if k == kind]
        if not pts:
            return None
        exact = next((v for r, v, _ in pts if r == rows), None)
        if exact is not None:
            return exact
        if len(pts) == 1:
            return pts[0][1]
        w = sum(n for _, _, n in pts)
        mr = sum(r * n for r, _, n in pts) / w
        mv = sum(v * n for _, v, n in pts) / w
        var = sum(n * (r - mr) ** 2 for r, _, n in pts)
        slope = max(0.0, sum(n * (r - mr) * (v - mv) for r, v, n in pts) / var) if var > 0 else 0.0
        return max(0.0, mv + slope * (rows - mr))

    def to_json(self) -> dict[str, dict[str, float]]:
        """{kind: {rows: milliseconds}} (the medians), as fit --measure and --json print them."""
        out: dict[str, dict[str, float]] = {}
        for (k, r), a in sorted(self.buckets.items()):
            out.setdefault(k, {})[str(r)] = round(a.value * 1e3, 4)
        return out

    def spread_json(self) -> dict[str, dict[str, list[float]]]:
        """{kind: {rows: [lowest ms, highest ms, timings]}} over the values each median is taken over."""
        out: dict[str, dict[str, list[float]]] = {}
        for (k, r), a in sorted(self.buckets.items()):
            lo, hi = a.spread()
            out.setdefault(k, {})[str(r)] = [round(lo * 1e3, 4), round(hi * 1e3, 4), len(a.values)]
        return out


@dataclass(frozen=True)
class Plan:
    """What auto does next: `steps` AR steps ("ar"), or one draft-self block of at most `max_passes` block passes
    ("draft"; probe: chosen to measure, not because drafts were predicted to pay)."""

    kind: str
    steps: int = 0
    max_passes: int = 0
    probe: bool = False
    predicted_tok_s: float | None = None


# what a new answer takes over as it is from the previous answer's policy (besides the figures, taken as warm ones)
CARRIED = ("gap", "steps_since_draft", "probe_seconds", "drafts_seen", "last_kind", "draft_at_ar", "ar_at_draft")
FIGURES = ("ar_step", "kept", "passes", "per_token", "ok", "cut")


class AutoPolicy:
    """One answer's choices (see the module's docstring). `costs` outlives the answer; so may `prior`, the draft
    averages of the previous answer on this model (a new answer starts from them, then its own drafts take over).

    block_size: the draft's length (tokens of a block, the pending causal token first). ar_run: AR steps per run
    between two decisions (default block_size: a decision costs nothing, but a run must be long enough for a probe
    at the lowest rate to cost little)."""

    def __init__(self, costs: PassCosts, block_size: int, ar_run: int | None = None,
                 prior: "AutoPolicy | None" = None):
        self.costs = costs
        self.block_size = int(block_size)
        self.ar_run = int(ar_run or block_size)
        self.ar_step = _Recent(MOVE_WINDOW)  # seconds per AR step (per run), the host's work for it included
        # per draft: tokens it yielded (the pending causal token plus accepted proposals), block passes; and its
        # seconds per token yielded (its block passes, verification and rollback)
        self.kept, self.passes, self.per_token = _Average(), _Average(), _Recent(MOVE_WINDOW)
        # acceptance per proposal, geometric: accepted proposals against drafts cut by a rejection (recent first)
        self.ok, self.cut = _Average(), _Average()
        self.gap = 1  # AR runs before the next probe draft, doubled after each probe that did not pay
        # AR steps since the last draft: the probe waits for gap runs' worth of them (answers shorter than a run
        # would otherwise probe once an answer at the lowest rate)
        self.steps_since_draft = 0
        self.probe_seconds = 0.0  # what the last probe that did not pay cost
        self.last_kind = ""  # the kind of the last move ("ar" or "draft")
        self.drafts_seen = 0  # drafts this model's answers made so far (this one's and, with a prior, the earlier)
        # where each move's cost stood when the other was last measured (DRIFT: re-measure the other when it moved)
        self.draft_at_ar: float | None = None  # seconds per drafted token when the AR step was last measured
        self.ar_at_draft: float | None = None  # seconds per AR step when a draft was last measured
        if prior is not None:  # the last answer's view of the moves
            for name in FIGURES:
                # warm (two values or more): this answer's values join them; a single value, perhaps a cold one (a
                # process's first draft: 47 ms against 5 on the bundled model), stays one that the next value
                # replaces, as it would have in the answer that measured it
                getattr(self, name).carry(getattr(prior, name))
            for name in CARRIED:  # where the probes and the last move stand
                setattr(self, name, getattr(prior, name))

    # ---- what the decoder reports ------------------------------------------------------------------------------
    def observe_ar(self, steps: int, seconds: float) -> None:
        """A run of `steps` AR steps that took `seconds` (the steps alone)."""
        if steps:
            self.ar_step.add(seconds / steps)
            self.draft_at_ar = _warm(self.per_token)
        self.steps_since_draft += steps
        self.last_kind = "ar"

    def observe_draft(self, kept: int, proposed: int, accepted: int, passes: int, seconds: float,
                      probe: bool) -> None:
        """A draft-self block: `kept` tokens yielded (pending + accepted), `proposed` draft tokens checked, of them
        `accepted`, after `passes` block passes, in `seconds` (its block passes, verification and rollback)."""
        self.drafts_seen += 1
        self.last_kind = "draft"
        self.kept.add(kept)
        self.passes.add(passes)
        self.per_token.add(seconds / max(kept, 1))
        self.ar_at_draft = _warm(self.ar_step)
        if self.draft_at_ar is None:  # drafts since the AR step was measured: their first warm level
            self.draft_at_ar = _warm(self.per_token)
        self.ok.add(accepted)
        self.cut.add(1.0 if accepted < proposed else 0.0)
        self.steps_since_draft = 0
        if probe:  # did it pay? one that did not waits twice as long for the next one
            ar, draft = self.ar_rate(), self.draft_rate()
            paid = draft is not None and ar is not None and draft >= ar
            # or would it have, at the warm pass costs (a probe's own time may be a cold one, or a stalled one): the
            # tokens drafts yield against what their passes cost. Not "its proposals were accepted": a draft whose
            # pass resolved 4 sure positions and stopped had them all accepted, and 4 tokens for a block pass and a
            # verification lose to AR on a CPU (the agent traces: probes every AR run, auto 0.93x AR)
            t = self.predict_draft_seconds()
            paid = paid or (ar is not None and bool(t) and self.kept.value / t >= ar)
            self.gap = 1 if paid else min(PROBE_MAX, self.gap * 2)
            # its cost as the pass costs say (warm), when they can: the probe itself may have been a cold one
            t_block, t_verify = self.costs.predict("block", self.block_size), self.costs.predict("causal", 2)
            cost = seconds if t_block is None or t_verify is None else min(seconds, t_block + t_verify)
            self.probe_seconds = 0.0 if paid else cost

    # ---- estimates ---------------------------------------------------------------------------------------------
    def ar_step_seconds(self) -> float | None:
        """Measured AR steps (their host work included), else the causal pass line at one row."""
        return self.ar_step.value if self.ar_step.value is not None else self.costs.predict("causal", 1)

    def ar_rate(self) -> float | None:
        t = self.ar_step_seconds()
        return 1.0 / t if t else None

    def acceptance(self) -> float:
        """Per-proposal acceptance under a geometric model: accepted / (accepted + rejections); 0.5 unknown."""
        if self.ok.value is None:
            return 0.5
        denom = self.ok.value + self.cut.value
        # no proposal checked yet (drafts cut before their first resolved position): still unknown
        return self.ok.value / denom if denom > 0 else 0.5

    def expected_tokens(self, length: int) -> float:
        """Tokens a fully drafted block of `length` is expected to yield: the pending token plus the accepted
        proposals, sum over i < length of acceptance^i."""
        a = self.acceptance()
        return float(length) if a >= 1.0 else (1.0 - a ** length) / (1.0 - a)

    def draft_rate(self) -> float | None:
        """Tokens per second of drafts: measured (the median of the recent drafts' seconds per token), else predicted
        from pass costs and the acceptance; None while the block pass was never timed."""
        if self.per_token.value:
            return 1.0 / self.per_token.value
        t = self.predict_draft_seconds()
        return self.expected_tokens(self.block_size) / t if t else None

    def predict_draft_seconds(self) -> float | None:
        t_block = self.costs.predict("block", self.block_size)
        t_verify = self.costs.predict("causal", self.block_size)
        if t_block is None or t_verify is None:
            return None
        passes = self.passes.value if self.passes.value is not None else PROBE_PASSES
        t_rb = self.costs.predict("rollback", max(1, round(self.expected_tokens(self.block_size)))) or 0.0
        return passes * t_block + t_verify + (1.0 - self.acceptance() ** (self.block_size - 1)) * t_rb

    def best_draft_rate(self) -> float | None:
        """Tokens per second of the best draft there can be: one block pass, every proposal accepted."""
        t_block = self.costs.predict("block", self.block_size)
        t_verify = self.costs.predict("causal", self.block_size)
        if t_block is None or t_verify is None:
            return None
        return self.block_size / (t_block + t_verify) if t_block + t_verify > 0 else None

    def max_passes(self) -> int:
        """Block passes a draft may take: while block passes were never timed, PROBE_PASSES; else as many as the AR
        steps for the draft's expected tokens pay for, its verification taken off (at least 1, at most block_size
        - 1: one pass fills at least one position)."""
        t_block = self.costs.predict("block", self.block_size)
        t_ar = self.ar_step_seconds()
        if t_block is None or t_ar is None or t_block <= 0:
            return PROBE_PASSES
        t_verify = self.costs.predict("causal", self.block_size) or t_ar
        budget = self.expected_tokens(self.block_size) * t_ar - t_verify
        return int(max(1, min(self.block_size - 1, budget // t_block)))

    # ---- the choice --------------------------------------------------------------------------------------------
    def plan(self) -> Plan:
        ar, draft = self.ar_rate(), self.draft_rate()
        if ar is None:  # the AR step was never timed on this device: time it (AR steps are never a loss)
            return Plan("ar", steps=FIRST_AR_STEPS, predicted_tok_s=None)
        if draft is None:  # block passes never timed: a short probe draft
            return Plan("draft", max_passes=PROBE_PASSES, probe=True, predicted_tok_s=None)
        if self.drafts_seen < 2:  # the first draft of a process is a cold one: a second, warm one before judging
            return Plan("draft", max_passes=self.max_passes(), probe=True, predicted_tok_s=draft)
        # the machine changed under the move being made (other programs started or stopped): the other move's figure
        # is from before, measure it again (its old values would decide against a machine that is gone)
        if self.last_kind == "draft" and _drifted(self.per_token.value, self.draft_at_ar):
            self.ar_step.restart()
            self.draft_at_ar = self.per_token.value
            return Plan("ar", steps=FIRST_AR_STEPS, predicted_tok_s=ar)
        if self.last_kind == "ar" and self.steps_since_draft >= self.ar_run and \
                _drifted(self.ar_step.value, self.ar_at_draft):
            self.per_token.restart()
            self.ar_at_draft = self.ar_step.value
            return Plan("draft", max_passes=self.max_passes(), probe=True, predicted_tok_s=draft)
        if draft >= ar * (HYSTERESIS if self.last_kind == "draft" else 1.0):
            pass_only = self.costs.predict("causal", 1)  # an AR step's pass alone (robust: a median over steps)
            if self.last_kind == "draft" and len(self.ar_step.values) < KNOWN and \
                    (not pass_only or draft < 1.0 / pass_only):
                # a lasting choice of drafts rests on the AR step's cost, which one stalled AR run can have set: time
                # AR again until KNOWN values say it (unless drafts beat even the AR step's bare pass)
                return Plan("ar", steps=FIRST_AR_STEPS, predicted_tok_s=ar)
            return Plan("draft", max_passes=self.max_passes(), predicted_tok_s=draft)
        # long waits only on warm figures: a process's first block pass builds its graph cold (20 ms against 2 ms), and
        # its first draft is a cold one (23 ms against 4 ms on the bundled model)
        warm = self.costs.warm("block") and self.drafts_seen >= 2
        best = self.best_draft_rate()
        gap = COST_PROBE_GAP if warm and best is not None and best < ar else self.gap
        wait = gap * self.ar_run
        if warm and self.probe_seconds and gap != COST_PROBE_GAP:
            wait = max(wait, self.probe_seconds / (PROBE_SHARE * self.ar_step_seconds()))
        if self.steps_since_draft >= wait:
            return Plan("draft", max_passes=1 if gap == COST_PROBE_GAP else self.max_passes(), probe=True,
                        predicted_tok_s=draft)
        return Plan("ar", steps=self.ar_run, predicted_tok_s=ar)


def _warm(r: _Recent) -> float | None:
    """A figure to compare later ones with: the median, once it rests on 3 warm values or more."""
    return r.value if r.n >= 2 and len(r.values) >= KNOWN else None


def _drifted(now: float | None, then: float | None) -> bool:
    """A cost that moved by more than DRIFT either way since `then` (False while either is unknown)."""
    return bool(now and then) and not 1.0 / DRIFT <= now / then <= DRIFT
