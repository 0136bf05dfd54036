"""`clover-gguf check-block`: does the file's reading of the block tensors hold for its weights?

The math of the real checkpoint's block tensors is not published; clover-gguf reads them in one of a few ways, its
readings (docs/architecture.md 3b; the file's is stamped into the GGUF as `clover_moe.diffusion.softmax_form`). The model's
causal path needs no reading, so it can judge the block path: draft-self (exact) drafts each block with the block
path and keeps only what the causal path would have written itself. Under a right reading most of a trained model's drafts are accepted (the llama.cpp PR's
draft-self on the real model: 82.6%; our trained tiny model: 99%); under a wrong one the block path proposes noise
and almost nothing is accepted. The answers are the causal path's either way.

`--reading all` (rank_readings) does that once under every reading this version knows (metadata.READINGS) and ranks
them; llama.cpp computes every reading (one runtime each, the key overridden); a reading it does not compute would run
on the PyTorch reference holding the file's weights. Readings the prompts cannot tell apart are said to be so, never
ranked as a winner by a tie. `--write` stamps the best into the file's header, in place (export.restamp), when it
holds (in a tie: the file's own reading when it is among the tied, else nothing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from clover_gguf.errors import UserError
from clover_gguf.metadata import BLOCK_READING, BLOCK_READING_VERIFIED, READINGS, check_reading
from clover_gguf.offload import Offload

# the share of drafted tokens the causal path accepts, and what it says about the reading
HOLDS, UNCLEAR = 0.5, 0.2
VERDICTS = {
    "holds": "the reading holds: the block path drafts what the causal path writes",
    "unclear": "unclear: the block path agrees only in part; try more prompts, and report it",
    "wrong": "the reading does not fit these weights: block modes would write noise (AR is unaffected)",
}
# The built-in prompts (check_block's default): they must fit the model, since a model drafts well only on text like
# its training data. General questions for the 35B (and any model of general text); for a file of the bundled tiny
# Clover's shape, its own held-out prompts (it was trained on counting, sums, copying, reversing and key look-ups
# only: on general questions its drafts say nothing about the reading).
DEFAULT_PROMPTS = (
    "Why is the sky blue? Answer in three sentences.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Count from 1 to 30, separated by spaces.",
    "Translate to French: The weather is nice today and we are going to the beach.",
    "List five prime numbers and explain why each is prime.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
)
BUNDLED = Path(__file__).resolve().parent / "assets" / "tiny-clover"
BUNDLED_EVERY = 15  # every 15th single-turn row of its eval set: 12 prompts, every kind of task
GENERAL_NOTE = ("the built-in prompts are general questions written for the 35B: for a model trained on other "
                "text, give prompts like its training data with --prompts FILE")


def verdict(acceptance: float) -> str:
    return "holds" if acceptance >= HOLDS else "unclear" if acceptance >= UNCLEAR else "wrong"


@dataclass
class CheckResult:
    model: str
    reading: str | None
    trained_under_reading: bool
    drafted: int = 0
    accepted: int = 0
    per_prompt: list[dict[str, Any]] = field(default_factory=list)
    prompt_set: str = "yours"  # "yours" (--prompts), "general" (DEFAULT_PROMPTS) or "bundled" (its eval prompts)
    note: str | None = None  # why the verdict may need the user's prompts
    backend: str = "llama.cpp"  # what decoded the reading: llama.cpp, or the PyTorch reference (a reading it lacks)
    block_passes: int = 0  # the block passes its drafts took (fewer for the same drafts: a more confident block path)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def verdict(self) -> str:
        return verdict(self.acceptance)

    @property
    def accepted_per_pass(self) -> float:
        """Accepted draft tokens per block pass: the ranking's second key (readings whose drafts are accepted
        alike differ in how many passes their block path needs to fill them)."""
        return self.accepted / self.block_passes if self.block_passes else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "reading": self.reading, "trained_under_reading": self.trained_under_reading,
                "backend": self.backend,
                "prompts": len(self.per_prompt), "prompt_set": self.prompt_set, "drafted": self.drafted,
                "accepted": self.accepted, "acceptance": round(self.acceptance, 4), "verdict": self.verdict,
                "block_passes": self.block_passes, "accepted_per_pass": round(self.accepted_per_pass, 4),
                "note": self.note, "per_prompt": self.per_prompt}

    def format(self) -> str:
        lines = [f"{p['acceptance']:6.1%}  {p['accepted']:>5}/{p['drafted']:<5} {p['prompt'][:60]}"
                 for p in self.per_prompt]
        lines.append(f"reading {self.reading}: {self.accepted} of {self.drafted} drafted tokens accepted by the "
                     f"causal path ({self.acceptance:.1%}) over {len(self.per_prompt)} prompts "
                     f"({PROMPT_SETS[self.prompt_set]})")
        lines.append(f"verdict: {VERDICTS[self.verdict]}")
        if self.note:
            lines.append(f"note: {self.note}")
        return "\n".join(lines)


def read_prompts(path: Path) -> list[str]:
    """One prompt per line (blank lines skipped); a .jsonl file: each row's "prompt" (or "messages"' last user
    message)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read the prompts file {path}: {getattr(e, 'strerror', None) or e}") from None
    if Path(path).suffix == ".jsonl":
        from clover_gguf.config import parse_json

        prompts = []
        for i, line in enumerate(l for l in text.splitlines() if l.strip()):
            where = f"{path}: row {i + 1}"
            prompt = _row_prompt(parse_json(line.encode("utf-8", "surrogatepass"), where, "a JSON row"))
            if prompt is None:
                raise UserError(f"{where} has no prompt (a \"prompt\" string, or \"messages\" whose last user "
                                "message has string content)")
            prompts.append(prompt)
    else:
        prompts = [l.strip() for l in text.splitlines() if l.strip()]
    if not prompts:
        raise UserError(f"{path} holds no prompt")
    return prompts


def _row_prompt(row: Any) -> str | None:
    """A JSONL row's prompt: its "prompt" string, or the content string of the last "user" message of its
    "messages" list; None when it has neither (a number, null, NaN, a list, content parts)."""
    if not isinstance(row, dict):
        return None
    if "prompt" in row:
        prompt = row["prompt"]
    else:
        messages = row.get("messages")
        users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"] \
            if isinstance(messages, list) else []
        prompt = users[-1].get("content") if users else None
    return prompt if isinstance(prompt, str) else None


PROMPT_SETS = {"yours": "yours", "general": "the built-in general questions",
               "bundled": "the bundled tiny Clover's own held-out prompts"}


def _bundled_shape(rt) -> bool:
    """The file has the bundled tiny Clover's shape (layers, width, experts, vocabulary): a conversion of it."""
    import json

    from clover_gguf import metadata as md

    cfg = json.loads((BUNDLED / "config.json").read_text())
    return (rt.ctx.n_vocab == cfg["vocab_size"] and
            all(rt.meta.get(md.hparam(k)) == cfg[f] for k, f in (("block_count", "num_hidden_layers"),
                                                                  ("embedding_length", "hidden_size"),
                                                                  ("expert_count", "num_experts"))))


def default_prompts(rt) -> tuple[list[str], str]:
    """The built-in prompts that fit the runtime's model -> (prompts, PROMPT_SETS key)."""
    if _bundled_shape(rt):
        rows = [r for r in _eval_rows(BUNDLED / "eval.jsonl") if "history" not in r]
        return [r["prompt"] for r in rows[::BUNDLED_EVERY]], "bundled"
    return list(DEFAULT_PROMPTS), "general"


def _eval_rows(path: Path) -> list[dict[str, Any]]:
    """A bundled eval set's rows (package data: well-formed)."""
    import json

    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def check_block(model: Path, prompts: Path | None = None, max_new_tokens: int = 128, n_ctx: int | None = None,
                offload: Offload | None = None) -> CheckResult:
    """The file's own reading, checked (what `check-block FILE` prints)."""
    return rank_readings(model, None, prompts, max_new_tokens, n_ctx, offload).results[0]


# Two readings' accepted tokens per block pass this close (a share of the larger) count as alike (indistinguishable)
PER_PASS_APART = 0.1
SEPARATE = ("what would separate them: prompts on which their block passes draft differently, if any exist (more "
            "prompts, longer answers: --prompts FILE, --max-new-tokens N; two readings can be one function on some "
            "weights)")


def indistinguishable(a: CheckResult, b: CheckResult) -> bool:
    """Two readings these prompts cannot tell apart: the same counts, or shares of accepted drafts within two standard
    errors of their difference (binomial, the pooled share) and accepted tokens per block pass within PER_PASS_APART
    of each other (the ranking's second key)."""
    if (a.accepted, a.drafted, a.block_passes) == (b.accepted, b.drafted, b.block_passes):
        return True
    if not a.drafted or not b.drafted:
        return False
    pooled = (a.accepted + b.accepted) / (a.drafted + b.drafted)
    se = (pooled * (1 - pooled) * (1 / a.drafted + 1 / b.drafted)) ** 0.5
    hi = max(a.accepted_per_pass, b.accepted_per_pass)
    return (abs(a.acceptance - b.acceptance) <= 2 * se
            and (hi == 0 or abs(a.accepted_per_pass - b.accepted_per_pass) <= PER_PASS_APART * hi))


@dataclass
class Ranking:
    """check-block --reading: one CheckResult per reading, best first (by draft acceptance, then accepted tokens per
    block pass; equal ones: the file's own reading first, then metadata.READINGS' order). Readings the prompts cannot
    tell apart from the first (indistinguishable) are `tied`: no winner among them."""

    model: str
    file_reading: str
    results: list[CheckResult]
    written: str | None = None  # what --write did: None (not asked), "in place", "rewritten", or why nothing

    @property
    def leader(self) -> CheckResult:
        return self.results[0]

    @property
    def tied(self) -> list[CheckResult]:
        """The results these prompts cannot tell apart from the first one's (the first included)."""
        return [r for r in self.results if indistinguishable(r, self.results[0])]

    @property
    def winner(self) -> CheckResult | None:
        """The best reading, when the prompts tell it apart from every other; None for a tie."""
        return self.results[0] if len(self.tied) == 1 else None

    @property
    def pick(self) -> CheckResult | None:
        """The reading --write stamps: the winner; in a tie, the file's own reading when it is among the tied (the
        prompts say it fits as well as any), else none."""
        if self.winner is not None:
            return self.winner
        return next((r for r in self.tied if r.reading == self.file_reading), None)

    @property
    def margin(self) -> float | None:
        """The first's acceptance less the runner-up's (None with one reading)."""
        return self.results[0].acceptance - self.results[1].acceptance if len(self.results) > 1 else None

    def to_json(self) -> dict[str, Any]:
        lead = self.leader
        return {"model": self.model, "file_reading": self.file_reading,
                "winner": None if self.winner is None else self.winner.reading,
                "tied": [r.reading for r in self.tied] if self.winner is None else [],
                "verdict": lead.verdict, "margin": None if self.margin is None else round(self.margin, 4),
                "written": self.written, "ranking": [r.to_json() for r in self.results]}

    def format(self) -> str:
        lines = [f"{'reading':<15} {'accepted':>9} {'drafted':>8}  {'share':>6}  {'per pass':>8}  verdict  (backend)"]
        for r in self.results:
            mark = "  <- the file's" if r.reading == self.file_reading else ""
            lines.append(f"{r.reading:<15} {r.accepted:>9} {r.drafted:>8}  {r.acceptance:6.1%}  "
                         f"{r.accepted_per_pass:8.2f}  {r.verdict:<7}  ({r.backend}){mark}")
        lead, w = self.leader, self.winner
        prompts = f"{len(lead.per_prompt)} prompts ({PROMPT_SETS[lead.prompt_set]})"
        if w is not None:
            lines.append(f"best: {w.reading} ({READINGS[w.reading]})" +
                         ("" if self.margin is None else f", {self.margin:+.1%} over {self.results[1].reading}") +
                         f" over {prompts}")
        else:
            tied = [r.reading for r in self.tied]
            names = ", ".join(tied[:-1]) + f" and {tied[-1]}"
            same = len({(r.accepted, r.drafted) for r in self.tied}) == 1
            how = f"{lead.accepted} of {lead.drafted} drafts accepted each" if same else "within the counts' noise"
            lines.append(f"no best reading: {names} cannot be told apart on these {prompts}: {how}")
            lines.append(SEPARATE)
        lines.append(f"verdict: {VERDICTS[lead.verdict]}")
        if lead.note:
            lines.append(f"note: {lead.note}")
        if self.written:
            pick = self.pick
            lines.append(self.written if self.written.startswith("nothing") or pick is None else
                         f"wrote {BLOCK_READING} = {pick.reading} into {Path(self.model).name} ({self.written})")
        return "\n".join(lines)


def parse_readings(spec: str | None) -> tuple[str, ...] | None:
    """--reading: "all", one name, or None (the file's own)."""
    if spec is None:
        return None
    return tuple(READINGS) if spec == "all" else (check_reading(spec, "--reading"),)


def rank_readings(model: Path, readings: Sequence[str] | None = None, prompts: Path | None = None,
                  max_new_tokens: int = 128, n_ctx: int | None = None, offload: Offload | None = None,
                  write: bool = False) -> Ranking:
    """Decode the prompts in draft-self (exact) under each reading (None: the file's own) and rank the readings by
    the share of drafted tokens the causal path accepts: one check-block run per reading. A reading llama.cpp
    computes runs there (the file's on the first runtime, another on a runtime of its own, opened after the first
    is closed, with clover_moe.diffusion.softmax_form overridden); any other on the PyTorch reference holding the file's
    weights (reference.load_gguf, loaded once). write: stamp the winner into the file's header (export.restamp:
    in place, whole or not at all) when its verdict is "holds"."""
    from clover_gguf.runtime import CloverRuntime, no_block_tensors

    texts = read_prompts(prompts) if prompts is not None else None
    results = []
    elsewhere: list[CheckResult] = []  # readings llama.cpp computes, not the file's: each on a runtime of its own
    with CloverRuntime(model, n_ctx=n_ctx, offload=offload) as rt:
        if not rt.block_mode:  # one line and the fix (check-block has no other mode to offer)
            raise UserError(no_block_tensors(rt.path, None))
        file_reading = rt.reading
        wanted = tuple(readings) if readings is not None else (file_reading,)
        if texts is None:
            texts, prompt_set = default_prompts(rt)
        else:
            prompt_set = "yours"
        reference = None
        for reading in wanted:
            res = CheckResult(str(model), reading, rt.reading_verified and reading == file_reading,
                              prompt_set=prompt_set)
            if reading == file_reading and reading in rt.backend.READINGS:
                _decode(rt, texts, max_new_tokens, res)
            elif reading in rt.backend.READINGS:
                elsewhere.append(res)
                continue
            else:
                if reference is None:
                    from clover_gguf.reference import ReferenceBackend, load_gguf

                    reference = ReferenceBackend(load_gguf(model), eos_ids=rt.eos_ids)
                reference.model.reading = reading
                res.backend = "PyTorch reference"
                with rt.running_on(reference, reading):
                    _decode(rt, texts, max_new_tokens, res)
            res.note = general_note(res, Path(model))
            results.append(res)
        verified = rt.reading_verified
    for res in elsewhere:
        with CloverRuntime(model, n_ctx=n_ctx, offload=offload, reading=res.reading) as other:
            _decode(other, texts, max_new_tokens, res)
        res.note = general_note(res, Path(model))
        results.append(res)
    order = {r: i for i, r in enumerate(READINGS)}
    results.sort(key=lambda r: (-r.acceptance, -r.accepted_per_pass, r.reading != file_reading,
                                order.get(r.reading, len(order))))
    ranking = Ranking(str(model), file_reading, results)
    if write:
        ranking.written = stamp(Path(model), ranking, file_reading, verified)
    return ranking


def stamp(model: Path, ranking: Ranking, file_reading: str, verified: bool) -> str:
    """Stamp the ranking's pick into the file (--write) when it holds -> what was done, for Ranking.written."""
    from clover_gguf.export import restamp
    from clover_gguf.gguf_header import BOOL, STRING

    winner = ranking.pick
    if winner is None:
        return (f"nothing written: {', '.join(r.reading for r in ranking.tied)} cannot be told apart on these "
                f"prompts ({file_reading} stays)")
    if winner.verdict != "holds":
        return f"nothing written: no reading holds on these prompts ({file_reading} stays)"
    if winner.reading == file_reading and verified:
        return f"nothing written: {file_reading} is the file's reading already"
    return restamp(model, {BLOCK_READING: (STRING, winner.reading), BLOCK_READING_VERIFIED: (BOOL, True)})


def _decode(rt, texts: Sequence[str], max_new_tokens: int, res: CheckResult) -> None:
    rt.check_request(1, 1, "draft-self", rt.block_size)
    for text in texts:
        # the card's fill threshold, not the faster draft one: the figures keep the meaning docs/runtime.md gives them
        ans = rt.generate(text, mode="draft-self", accept="exact", max_new_tokens=max_new_tokens,
                          threshold=rt.threshold)
        st = ans.stats
        res.drafted += st.drafted_tokens
        res.accepted += st.accepted_tokens
        res.block_passes += st.block_passes
        res.per_prompt.append({"prompt": text, "drafted": st.drafted_tokens, "accepted": st.accepted_tokens,
                               "acceptance": st.accepted_tokens / st.drafted_tokens if st.drafted_tokens else 0.0})


def general_note(res: CheckResult, model: Path) -> str | None:
    """GENERAL_NOTE for a verdict short of "holds" on the general questions for a model that is not the 35B: the
    verdict may then say more about the prompts than about the reading."""
    from clover_gguf.runtime import has_35b_hparams

    if res.prompt_set == "general" and res.verdict != "holds" and not has_35b_hparams(model):
        return GENERAL_NOTE
    return None



