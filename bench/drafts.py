"""Draft-self's drafts on a trained tiny Clover's held-out rows: when a draft is verified (decoding.STOP_AT_STALL).

    python bench/drafts.py [--model clover_gguf/assets/tiny-clover-tools] [--kinds call,json] [--limit N]
                           [--threads 1] [--workdir out/bench-drafts] [--by-position | --oracle]
                           [--attention exact|fa-off|defaults] [--json]

Converts the model folder to an F32 GGUF and decodes every held-out row (or --kinds' rows; --limit: the first N) in
the exact settings (flash attention off, F32 K/V; --attention: fa-off, flash attention off with F16 K/V, or defaults,
llama.cpp's: flash attention auto, F16 K/V), greedy, the card's controls as the runtime applies them: ar, then
draft-self with every draft resolved whole (STOP_AT_STALL off: the rule before), then draft-self verified at the
first block pass that leaves the draft's usable prefix unchanged (on), then auto the same two ways (one runtime: each
auto answer starts from what the one before measured, whichever way it drafted), each row's prompt decoded once
first and the five in that order row by row. Per configuration: block passes per draft, tokens accepted per draft,
tokens per pass (the prompt's pass not counted), tok/s against ar's, and the rows whose text is ar's token for token.
Figures only, no asserts on timing; the load average at the start and the end is printed beside them.

--by-position: instead, how far ahead one block pass sees. At every BLOCK_STRIDE-th token of each row's AR answer, one
block pass after the prompt and the answer before that token, over [that token, masks], as a draft's first pass is:
per block position, the share of passes whose greedy choice (raw logits) is the AR answer's token there (the answer
greedy on raw logits too: bench/tiny_eval.py's, the card's controls off), and the
mean length of the agreeing prefix (what a verification would keep of a draft stopped after its first pass).

--oracle: instead, the ceiling of any drafter on these answers on this machine. Each row's answer is decoded in AR
(greedy on raw logits, no controls), then twice more, interleaved: in AR again and in draft-self over `Oracle`, whose
block passes run (their cost paid) but propose the AR answer's tokens, sure: every draft resolves in one block pass
and is accepted whole by the model's own verification, 32 tokens for a block pass and a causal pass of 32 rows. Both
on dense logits (the oracle's rows are ours), the prompt's pass not counted. Per kind and in all: tokens, tok/s of
each, the oracle's over AR's, block passes and tokens per pass; the rows whose oracle text is AR's (all, or the
oracle was not one).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from clover_gguf import decoding  # noqa: E402
from clover_gguf.convert import convert  # noqa: E402
from clover_gguf.offload import Offload  # noqa: E402
from clover_gguf.runtime import CloverRuntime  # noqa: E402
from clover_gguf.testing.tool_tasks import ASSET_DIR as TOOL_MODEL  # noqa: E402
from clover_gguf.testing.train_tiny import load_eval  # noqa: E402
from contention import loadavg  # noqa: E402
from tiny_eval import max_new_tokens, row_prompt, run_rows  # noqa: E402

ATTENTION = ("exact", "fa-off", "defaults")  # --attention: exact, --flash-attn off (F16 K/V), the defaults
BLOCK_STRIDE = 24  # --by-position: a block pass every this many answer tokens

CONFIGS = (("ar", "ar", None), ("draft-self, resolved whole", "draft-self", False),
           ("draft-self, verified at a stall", "draft-self", True), ("auto, resolved whole", "auto", False),
           ("auto, verified at a stall", "auto", True))


def decode(rt: CloverRuntime, ids: list[int], mode: str, max_new: int) -> tuple[list[int], object, float]:
    t0, toks, stats = time.perf_counter(), [], None
    for piece in rt.stream_pieces(ids, mode=mode, max_new_tokens=max_new):
        toks += piece.tokens
        stats = piece.stats
    return toks, stats, time.perf_counter() - t0


def run(rt: CloverRuntime, rows: list[dict]) -> dict:
    tally = {name: {"tokens": 0, "passes": 0, "block_passes": 0, "seconds": 0.0, "drafts": 0, "accepted": 0,
                    "same": 0} for name, _, _ in CONFIGS}
    max_new = max_new_tokens(rows)
    for row in rows:
        prompt, _ = row_prompt(rt, row)
        ids = rt.ctx.tokenize(prompt, special=True)
        decode(rt, ids, "ar", 1)  # the prompt's state kept: no configuration pays its pass for another
        texts = {}
        for name, mode, stall in CONFIGS:
            keep = decoding.STOP_AT_STALL
            decoding.STOP_AT_STALL = bool(stall)
            try:
                toks, st, seconds = decode(rt, ids, mode, max_new)
            finally:
                decoding.STOP_AT_STALL = keep
            texts[name] = toks
            t = tally[name]
            t["tokens"] += len(toks)
            t["passes"] += st.forward_passes - 1
            t["block_passes"] += st.block_passes
            t["seconds"] += seconds
            t["drafts"] += st.drafts or 0
            t["accepted"] += st.accepted_tokens or 0
            t["same"] += toks == texts["ar"]
    ar_rate = tally["ar"]["tokens"] / tally["ar"]["seconds"]
    out = {}
    for name, t in tally.items():
        d = t["drafts"]
        out[name] = {"block_passes_per_draft": t["block_passes"] / d if d else None,
                     "accepted_per_draft": t["accepted"] / d if d else None,
                     "tokens_per_pass": t["tokens"] / max(1, t["passes"]),
                     "tok_s_x_ar": t["tokens"] / t["seconds"] / ar_rate, "text_equal_ar": t["same"], **t}
    return out


def one_pass_agreement(backend, ids: list[int], answer: list[int], block_size: int, stride: int = BLOCK_STRIDE
                       ) -> tuple[list[int], list[int], list[int]]:
    """One block pass at every stride-th answer position (see the module docstring) -> (hits, tries) per block
    position (index 0, the given token, stays 0) and each pass's agreeing prefix (proposals before the first miss)."""
    hits, tries, prefixes = [0] * block_size, [0] * block_size, []
    for start in range(0, len(answer) - block_size + 1, stride):
        backend.reset()
        backend.prefill(list(ids) + answer[:start])
        choice = np.asarray(backend.block_logits([answer[start]] + [backend.mask_token_id] * (block_size - 1)))
        agree = [int(choice[j].argmax()) == answer[start + j] for j in range(1, block_size)]
        for j, ok in enumerate(agree, 1):
            hits[j] += ok
            tries[j] += 1
        prefixes.append(next((i for i, ok in enumerate(agree) if not ok), len(agree)))
    return hits, tries, prefixes


def by_position(rt: CloverRuntime, rows: list[dict]) -> dict:
    """--by-position over the rows: {"agreement": [per block position 1..B-1], "mean_prefix", "passes"}. The AR
    answers are tiny_eval's (greedy, the card's controls off), so that they and the block passes' raw greedy choices
    are taken alike."""
    b = rt.backend.block_size
    hits, tries, prefixes = [0] * b, [0] * b, []
    for row, ar in zip(rows, run_rows(rt, rows, "ar")):
        prompt, _ = row_prompt(rt, row)
        h, t, p = one_pass_agreement(rt.backend, rt.ctx.tokenize(prompt, special=True), ar["tokens"], b)
        hits, tries, prefixes = [x + y for x, y in zip(hits, h)], [x + y for x, y in zip(tries, t)], prefixes + p
    return {"agreement": [h / t if t else None for h, t in zip(hits[1:], tries[1:])],
            "mean_prefix": sum(prefixes) / len(prefixes) if prefixes else None, "passes": len(prefixes)}


class Oracle:
    """A backend over a real one whose block passes propose a known answer (module doc, --oracle): the real pass runs
    and its rows are dropped; row j says the answer's token at the block's position j (the end token past the
    answer), sure. Every other pass is the real backend's. Not a GraphBackend (no *_rows passes): the decoders
    select on its dense logits, so its rows are the ones read."""

    SURE = 50.0  # the answer's logit in a row of zeros: softmax 1 - V * e^-50, a certain position

    def __init__(self, backend, n_prompt: int, answer: list[int]):
        self.b, self.n_prompt, self.answer = backend, n_prompt, list(answer)
        self.mask_token_id, self.eos_ids, self.block_size = backend.mask_token_id, backend.eos_ids, backend.block_size
        self.end = min(backend.eos_ids)
        self.select_in_graph = False
        self.prefill_seconds = 0.0

    @property
    def n_past(self) -> int:
        return self.b.n_past

    @property
    def n_vocab(self) -> int:
        return self.b.n_vocab

    @property
    def keep_backup(self) -> bool:
        return self.b.keep_backup

    @keep_backup.setter
    def keep_backup(self, value: bool) -> None:
        self.b.keep_backup = value

    def reset(self) -> None:
        self.b.reset()

    def prefill(self, ids):
        t0 = time.perf_counter()
        try:
            return self.b.prefill(ids)
        finally:
            self.prefill_seconds += time.perf_counter() - t0

    def commit(self, ids):
        return self.b.commit(ids)

    def rollback(self, n: int) -> None:
        self.b.rollback(n)

    def settle(self) -> None:
        self.b.settle()

    def block_logits(self, block):
        self.b.block_logits(block)
        start = self.n_past - self.n_prompt  # answer tokens committed before the block
        rows = np.zeros((len(block), self.n_vocab), dtype=np.float32)
        for j in range(len(block)):
            rows[j, self.answer[start + j] if start + j < len(self.answer) else self.end] = self.SURE
        return rows


def oracle_row(backend, ids: list[int], max_new: int) -> tuple[list[int], dict]:
    """One row of --oracle -> (the AR answer, {"ar" | "draft-self": (tokens, stats, seconds after the prompt pass)}):
    the answer decoded in AR first, then AR again and draft-self over an Oracle of it."""
    answer, _ = decoding.generate_all(Oracle(backend, len(ids), []), ids, mode="ar", max_new_tokens=max_new)
    got = {}
    for mode in ("ar", "draft-self"):
        o = Oracle(backend, len(ids), answer)
        t0 = time.perf_counter()
        toks, st = decoding.generate_all(o, ids, mode=mode, max_new_tokens=max_new)
        got[mode] = (toks, st, time.perf_counter() - t0 - o.prefill_seconds)
    return answer, got


def oracle(rt: CloverRuntime, rows: list[dict]) -> dict:
    """--oracle over the rows: {kind: tally}, "all" last."""
    max_new = max_new_tokens(rows)
    kinds: dict = {}
    for row in rows:
        prompt, _ = row_prompt(rt, row)
        answer, got = oracle_row(rt.backend, rt.ctx.tokenize(prompt, special=True), max_new)
        for key in (row["kind"], "all"):
            t = kinds.setdefault(key, {"rows": 0, "tokens": 0, "ar_s": 0.0, "oracle_s": 0.0, "block_passes": 0,
                                       "passes": 0, "same": 0})
            t["rows"] += 1
            t["tokens"] += len(answer)
            t["ar_s"] += got["ar"][2]
            t["oracle_s"] += got["draft-self"][2]
            t["block_passes"] += got["draft-self"][1].block_passes
            t["passes"] += got["draft-self"][1].forward_passes - 1
            t["same"] += got["draft-self"][0] == answer == got["ar"][0]
    kinds["all"] = kinds.pop("all")
    for t in kinds.values():
        t["x_ar"] = t["ar_s"] / t["oracle_s"]
        t["tokens_per_pass"] = t["tokens"] / max(1, t["passes"])
    return kinds


def print_oracle(res: dict, rows: list[dict]) -> None:
    print("\n| rows | answers | tokens | ar tok/s | oracle drafts tok/s | x ar | block passes | tokens per pass | "
          "text = ar |\n|---|---|---|---|---|---|---|---|---|")
    for kind, t in res.items():
        print(f"| {kind} | {t['rows']} | {t['tokens']} | {t['tokens'] / t['ar_s']:.1f} | "
              f"{t['tokens'] / t['oracle_s']:.1f} | {t['x_ar']:.3f} | {t['block_passes']} | "
              f"{t['tokens_per_pass']:.2f} | {t['same']}/{t['rows']} |")


def print_by_position(res: dict, rows: list[dict]) -> None:
    print(f"\n{res['passes']} block passes; their greedy choice = the AR answer's token, by block position:")
    print(" ".join(f"{j}: {x:.2f}" for j, x in enumerate(res["agreement"], 1) if x is not None))
    print(f"mean agreeing prefix: {res['mean_prefix']:.2f} tokens")


def print_run(res: dict, rows: list[dict]) -> None:
    print("\n| mode, drafts | block passes per draft | tokens accepted per draft | tokens per pass | tok/s x ar | "
          "text = ar |\n|---|---|---|---|---|---|")
    for name, r in res.items():
        per = (f"{r['block_passes_per_draft']:.2f} | {r['accepted_per_draft']:.1f}" if r["drafts"] else "- | -")
        print(f"| {name} | {per} | {r['tokens_per_pass']:.2f} | {r['tok_s_x_ar']:.3f} | "
              f"{r['text_equal_ar']}/{len(rows)} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=TOOL_MODEL)
    ap.add_argument("--kinds", help="only these row kinds (comma-separated)")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--workdir", type=Path, default=ROOT / "out" / "bench-drafts")
    ap.add_argument("--by-position", action="store_true", help="how far ahead one block pass sees (the docstring)")
    ap.add_argument("--oracle", action="store_true", help="the ceiling of any drafter (the docstring)")
    ap.add_argument("--attention", choices=ATTENTION, default="exact",
                    help="exact: flash attention off, F32 K/V (the default); fa-off: off, F16 K/V; defaults: "
                         "llama.cpp's (flash attention auto, on a CPU on; F16 K/V)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    a.workdir.mkdir(parents=True, exist_ok=True)
    gguf = a.workdir / f"{a.model.name}-f32.gguf"
    convert(a.model, gguf, outtype="f32", quiet=True, force=True)
    rows = [r for r in load_eval(a.model) if not a.kinds or r["kind"] in a.kinds.split(",")][:a.limit]
    print(f"drafts: {len(rows)} rows of {a.model.name}, {a.threads} thread(s), attention {a.attention}, "
          f"load average {loadavg()}, {time.strftime('%Y-%m-%d %H:%M')}")
    rt = CloverRuntime(gguf, n_ctx=2048, exact=a.attention == "exact", n_threads=a.threads, n_threads_batch=a.threads,
                       offload=Offload(flash_attn="off" if a.attention == "fa-off" else "auto"))
    count, show = ((by_position, print_by_position) if a.by_position else (oracle, print_oracle) if a.oracle else
                   (run, print_run))
    try:
        res = count(rt, rows)
    finally:
        rt.close()
    show(res, rows)
    print(f"\nload average at the end: {loadavg()}")
    if a.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
