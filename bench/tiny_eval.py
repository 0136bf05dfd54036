"""The bundled tiny Clover's held-out eval through the patched llama.cpp, and the end-token study of block decoding.

    python bench/tiny_eval.py [--model clover_gguf/assets/tiny-clover] [--workdir out/tiny-eval] [--limit N]
                              [--rules prefix,plain,strict,strict@0.99,tail] [--controls]
    python bench/tiny_eval.py --model clover_gguf/assets/tiny-clover-tools --rules prefix   # the tool model

A tool model's rows (clover_gguf.testing.tool_tasks: rows with `messages` and `tools`) are rendered with their tools
and judged by tool_tasks.judge (calls read by serve's parser): per mode, the share of call rows with the right tool
names and the right arguments, of final rows with the right answer, of JSON rows with the right object, and of a long
write_file's lines written right at their place.

Converts the checkpoint to an F32 GGUF, then decodes every eval row (greedy; the card's controls off unless
--controls) with the runtime's chat template and tokenizer:
1. ar, and draft-self (exact acceptance, the default end rule) compared token for token with ar;
2. diffusion under each end rule of clover_gguf.decoding.END_RULES ("strict@X" sets END_THRESHOLD to X), and
   draft-self's tokens per pass under each.
Per rule it counts the blocks and rows in which a block pass was handed an end token with a masked position before
it (an end token resolved early), the wrong rows among those, and the "cut" rows: wrong, with an early end, and the
answer text a strict prefix of the right answer (the answer ended too soon; for a thinking row, no answer at all
after a cut thinking span counts too). Accuracy is per row kind (single, multi, no-think; train_tiny.row_kind).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clover_gguf import decoding  # noqa: E402
from clover_gguf.convert import convert  # noqa: E402
from clover_gguf.runtime import CloverRuntime  # noqa: E402
from clover_gguf.testing import tool_tasks  # noqa: E402
from clover_gguf.testing.train_tiny import ASSET_DIR, load_eval, row_conversation, row_kind  # noqa: E402


class EarlyEndProbe:
    """Wraps a backend's block passes (block_logits, and block_rows when decoding selects in the graph): counts block
    passes handed an end token with a masked position before it. install() / remove() put it on the backend."""

    METHODS = ("block_logits", "block_rows")

    def __init__(self, backend):
        self.backend = backend
        self.inner = {m: getattr(backend, m) for m in self.METHODS if callable(getattr(backend, m, None))}
        self.blocks_seen: set[int] = set()
        self.events = 0
        self.block_id = 0
        self._last: list[int] | None = None

    def install(self) -> None:
        for m, fn in self.inner.items():
            setattr(self.backend, m, lambda block, *a, _fn=fn, **kw: (self.see(block), _fn(block, *a, **kw))[1])

    def remove(self) -> None:
        for m in self.inner:
            delattr(self.backend, m)

    def see(self, block) -> None:
        b = list(block)
        mask, eos = self.backend.mask_token_id, self.backend.eos_ids
        first_mask = next((i for i, t in enumerate(b) if t == mask), None)
        if self._last is None or sum(t == mask for t in b) >= sum(t == mask for t in self._last):
            self.block_id += 1  # a new block (no fewer masks than the last pass)
        self._last = b
        if first_mask is not None and any(t in eos for t in b[first_mask + 1:]):
            self.events += 1
            self.blocks_seen.add(self.block_id)


def answer_of(text: str, think: bool) -> str:
    """The answer part of a decoded text; a thinking row whose thinking never closed has none."""
    if "</think>" in text:
        return text.split("</think>", 1)[1].strip()
    return "" if think else text.strip()


def is_tool_row(row: dict) -> bool:
    return "messages" in row


def row_prompt(rt: CloverRuntime, row: dict) -> tuple[str, bool]:
    """-> (the row's prompt as the runtime renders it, whether it thinks)."""
    if is_tool_row(row):
        return rt.render(row["messages"], think=row.get("think", True), tools=row["tools"]), row.get("think", True)
    conv = row_conversation(row)
    return rt.render(conv.messages, think=conv.think), conv.think


def max_new_tokens(rows) -> int:
    """96 for the bundled tasks; the tool model's answers run to about 310 tokens with their thinking (the long
    write_file calls)."""
    return 384 if any(is_tool_row(r) for r in rows) else 96


def run_rows(rt: CloverRuntime, rows, mode: str, end_rule: str = decoding.DEFAULT_END_RULE, controls: bool = False,
             max_new: int | None = None, threshold: float = 0.95):
    from clover_gguf.controls import make_processors

    out = []
    max_new = max_new or max_new_tokens(rows)
    for row in rows:
        prompt, think = row_prompt(rt, row)
        ids = rt.ctx.tokenize(prompt, special=True)
        procs = make_processors(rt.controls, rt.eos_ids, rt.think_id, rt.think_end_id, False) if controls else ()
        probe = EarlyEndProbe(rt.backend)
        probe.install()
        rt.backend.keep_backup = mode == "draft-self"
        try:
            toks, stats = decoding.generate_all(rt.backend, ids, mode=mode, max_new_tokens=max_new,
                                                threshold=threshold, end_rule=end_rule, logits_processors=procs)
        finally:
            probe.remove()
        text = rt.detokenize(toks)
        if text.endswith("<|im_end|>"):
            text = text[:-len("<|im_end|>")]
        ans = answer_of(text, think)
        checks = tool_tasks.judge(row, ans) if is_tool_row(row) else {}
        ok = checks["ok"] if checks else row["answer"] in ans
        early = probe.events > 0
        cut = early and not ok and row["answer"].startswith(ans) and ans != row["answer"]
        out.append(dict(kind=row["kind"] if checks else row_kind(row), ok=ok, checks=checks, tokens=toks,
                        generated=stats.generated_tokens,
                        passes=stats.forward_passes, early_blocks=len(probe.blocks_seen), early=early, cut=cut,
                        drafted=stats.drafted_tokens, accepted=stats.accepted_tokens, text=text))
    return out


def summary(res) -> dict:
    kinds = defaultdict(lambda: [0, 0])
    for r in res:
        kinds[r["kind"]][0] += r["ok"]
        kinds[r["kind"]][1] += 1
    gen, passes = sum(r["generated"] for r in res), sum(r["passes"] for r in res)
    drafted = sum(r["drafted"] for r in res)
    checks = {}
    for name in ("name", "args", "answer", "json"):  # the tool rows' checks, over the rows each applies to
        seen = [r["checks"][name] for r in res if r["checks"] and r["checks"][name] is not None]
        if seen:
            checks[name] = f"{sum(seen)}/{len(seen)} = {100 * sum(seen) / len(seen):.1f}%"
    lines = [r["checks"]["lines"] for r in res if r["checks"] and r["checks"].get("lines") is not None]
    if lines:  # long copies: their lines right at their place, over the lines they should have
        right, total = sum(a for a, _ in lines), sum(b for _, b in lines)
        checks["lines"] = f"{right}/{total} = {100 * right / total:.1f}%"
    return {"accuracy": round(sum(r["ok"] for r in res) / len(res), 4), "n": len(res), **checks,
            "by_kind": {k: f"{c}/{n} = {100 * c / n:.1f}%" for k, (c, n) in sorted(kinds.items())},
            "tokens_per_pass": round(gen / passes, 3), "generated": gen, "passes": passes,
            "acceptance": round(sum(r["accepted"] for r in res) / drafted, 4) if drafted else None,
            "rows_with_early_end": sum(r["early"] for r in res), "blocks_with_early_end": sum(r["early_blocks"]
                                                                                            for r in res),
            "early_end_rows_wrong": sum(r["early"] and not r["ok"] for r in res),
            "cut_rows": sum(r["cut"] for r in res)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ASSET_DIR)
    ap.add_argument("--workdir", type=Path, default=ROOT / "out" / "tiny-eval")
    ap.add_argument("--limit", type=int, default=None, help="every k-th row so that about N rows are decoded")
    ap.add_argument("--rules", default="prefix,plain,strict,strict@0.99,tail")
    ap.add_argument("--modes", default="ar,draft-self,diffusion")
    ap.add_argument("--controls", action="store_true", help="the card's controls on (off by default)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--show-misses", action="store_true")
    ap.add_argument("--threshold", type=float, default=0.95, help="block-pass confidence threshold (the card's 0.95)")
    a = ap.parse_args(argv)
    rows = load_eval(a.model)
    if a.limit:
        rows = rows[::max(1, len(rows) // a.limit)]
    a.workdir.mkdir(parents=True, exist_ok=True)
    gguf = a.workdir / "tiny-f32.gguf"
    convert(a.model, gguf, outtype="f32", quiet=True, force=True)
    report: dict = {"rows": len(rows)}
    modes = a.modes.split(",")
    with CloverRuntime(gguf, n_ctx=1024, n_threads=a.threads) as rt:
        t0 = time.time()
        ar = run_rows(rt, rows, "ar", controls=a.controls) if "ar" in modes else None
        if ar is not None:
            report["ar"] = summary(ar)
        for spec in a.rules.split(","):
            rule, _, thr = spec.partition("@")
            saved = decoding.END_THRESHOLD
            decoding.END_THRESHOLD = float(thr) if thr else saved
            try:
                for mode in ("diffusion", "draft-self"):
                    if mode not in modes:
                        continue
                    res = run_rows(rt, rows, mode, rule, controls=a.controls, threshold=a.threshold)
                    s = summary(res)
                    if mode == "draft-self" and ar is not None:
                        s["rows_differing_from_ar"] = sum(x["tokens"] != y["tokens"] for x, y in zip(ar, res))
                    report[f"{mode} [{spec}]"] = s
                    print(f"{mode} [{spec}]: {json.dumps(s)}", file=sys.stderr, flush=True)
                    if a.show_misses:
                        for row, r in zip(rows, res):
                            if not r["ok"]:
                                print(f"  MISS {r['kind']} {row.get('prompt') or row['messages'][0]['content']!r} "
                                  f"want {row['answer']!r} got "
                                      f"{r['text']!r}{' (early end)' if r['early'] else ''}", file=sys.stderr)
            finally:
                decoding.END_THRESHOLD = saved
        report["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
