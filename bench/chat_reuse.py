"""Time to first token of a chat's 10th turn, with prefix reuse (what `clover-gguf chat` does) and without it.

    python bench/chat_reuse.py [--gguf PATH] [--system-tokens 1800] [--rounds 5] [--threads 2] [--mode ar]

The conversation: a long system prompt (a paragraph repeated to about --system-tokens tokens: the bundled model's own
prefill is fast, so the conversation is grown to make it count) and nine turns of questions from the bundled model's
eval prompts, answered by the model (AR, greedy, at most 48 tokens each); about 2,000 tokens in all. Then turn 10,
timed from the request to the first token of the answer (RunStats.time_to_first_token_s), --rounds times each way,
interleaved:
  reuse     a runtime made with keep_prefix that has just answered turn 9: turn 10 decodes only its new message
  full      a runtime without a kept prefix: turn 10's whole prompt is prefilled
Medians and their ratio. Goal (issue 26): reuse at least 5x sooner. Figures are printed, nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from clover_gguf.runtime import CloverRuntime  # noqa: E402

PARAGRAPH = ("You are a careful assistant. Answer the question that is asked, briefly and exactly. When asked to "
             "count, count. When asked to add, add. When asked to reverse letters, reverse them. ")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, help="a Clover GGUF (default: the bundled model, converted to F32 once)")
    ap.add_argument("--workdir", type=Path, default=ROOT / "out" / "bench-chat-reuse")
    ap.add_argument("--system-tokens", type=int, default=1800)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mode", default="ar")
    ap.add_argument("--exact", action="store_true", help="flash attention off, F32 K/V (llama.cpp's CPU flash attention "
                    "is slow per token for a few tokens over a long cache: 0.6 ms a token at 2,000 cells, here)")
    a = ap.parse_args()
    gguf = a.gguf
    if gguf is None:
        from clover_gguf.convert import convert

        gguf = a.workdir / "tiny-clover-f32.gguf"
        if not gguf.is_file():
            a.workdir.mkdir(parents=True, exist_ok=True)
            convert(ROOT / "clover_gguf" / "assets" / "tiny-clover", gguf, outtype="f32", quiet=True)
    prompts = [json.loads(ln)["prompt"] for ln in
               (ROOT / "clover_gguf" / "assets" / "tiny-clover" / "eval.jsonl").read_text().splitlines() if ln.strip()]
    kw = dict(n_ctx=8192, n_threads=a.threads, n_threads_batch=a.threads, exact=a.exact)
    with CloverRuntime(gguf, keep_prefix=True, **kw) as reuse, CloverRuntime(gguf, **kw) as full:
        n_par = max(1, a.system_tokens // len(reuse.ctx.tokenize(PARAGRAPH, special=False)))
        messages = [{"role": "system", "content": PARAGRAPH * n_par}]

        def turn(rt: CloverRuntime, msgs: list[dict], max_new: int):
            ids, keep = rt.prompt_and_keep(msgs, think=False)
            text, stats = "", None
            for piece, stats in rt.stream_ids(ids, mode=a.mode, max_new_tokens=max_new, keep=keep):
                text += piece
            return text, stats

        for q in prompts[:9]:
            messages.append({"role": "user", "content": q})
            text, _ = turn(reuse, messages, 48)
            answer = text.split("</think>")[-1].strip()
            messages.append({"role": "assistant", "content": answer})
        tenth = messages + [{"role": "user", "content": prompts[9]}]
        times: dict[str, list[float]] = {"reuse": [], "full": []}
        for _ in range(a.rounds):
            turn(reuse, messages[:-1], 1)  # turn 9 again: the kept state is after its messages, as in a chat
            _, st = turn(reuse, tenth, 4)
            times["reuse"].append(st.time_to_first_token_s)
            reused, prompt = st.reused_tokens, st.prompt_tokens
            _, st = turn(full, tenth, 4)
            assert st.reused_tokens == 0
            times["full"].append(st.time_to_first_token_s)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model {gguf.name}, mode {a.mode}, threads {a.threads}, flash attention {'off' if a.exact else 'auto'}: "
          f"turn 10 of a {prompt}-token conversation "
          f"({reused} tokens continued from the kept state)")
    print(f"{'run':<8} {'time to first token (ms, median of ' + str(a.rounds) + ')':>44}")
    for k in ("full", "reuse"):
        print(f"{k:<8} {1000 * med[k]:44.2f}")
    print(f"reuse is {med['full'] / med['reuse']:.1f}x sooner (goal: at least 5x)")


if __name__ == "__main__":
    main()
