"""`ignore_eos` (serve's request field, llama-server's of the same name; runtime.stream_pieces(ignore_eos=True)): the
end tokens are never chosen, through the one path that keeps the mask token out (decoding.generate's `never`,
controls.Selector), so an answer runs to max_tokens in every mode: AR never takes an end token, the block modes never
fill one. bench/serve.py relies on it for a fixed amount of work per request on both servers.

On the bundled trained model, greedy: the answer has exactly max_tokens tokens, and where the normal answer did not
end, it is that answer: its first tokens are the normal answer's (AR's argmax is the same wherever it was not an end
token; draft-self and auto keep AR's text). Diffusion's fills are the softmax without the end tokens, so a block could
in principle resolve in another order; on this model's confident blocks it does not, and the test holds it to that.
"""

from __future__ import annotations

import httpx
import pytest

from clover_gguf.decoding import MODES
from clover_gguf.runtime import CloverRuntime
from clover_gguf.testing.device import env_offload_kwargs

# past every normal answer of these rows (14-29 tokens), not a multiple of the block size; past its end the model
# writes text it was never trained on, which its blocks resolve about a token per pass: the block modes' slow part
MAX_NEW = 37


@pytest.fixture(scope="module")
def rows(bundled_eval) -> list[dict]:
    """Single-turn questions (no history), 5 of the five tasks."""
    return [r for r in bundled_eval if "history" not in r and "think" not in r][::31]


@pytest.fixture(scope="module")
def runtimes(bundled_gguf):
    """Selection in llama.cpp's graph (serve's) and on the host (dense numpy)."""
    made = {}
    yield lambda sel: made.get(sel) or made.setdefault(sel, CloverRuntime(
        bundled_gguf, n_ctx=256, exact=True, n_threads=1, selection=sel, **env_offload_kwargs()))
    for r in made.values():
        r.close()


def _tokens(rt, ids, mode, **kw) -> tuple[list[int], str]:
    out, stats = [], None
    for piece in rt.stream_pieces(ids, mode=mode, max_new_tokens=MAX_NEW, **kw):
        out += piece.tokens
        stats = piece.stats
    return out, stats.finish_reason


@pytest.mark.parametrize("mode, selection", [(m, "graph") for m in MODES] + [("ar", "numpy"), ("diffusion", "numpy")])
def test_ignore_eos_runs_to_max_tokens_with_the_normal_answer_first(runtimes, rows, mode, selection):
    rt = runtimes(selection)
    for row in rows:
        ids = rt.prompt_ids([{"role": "user", "content": row["prompt"]}])
        normal, why = _tokens(rt, ids, mode)
        assert why == "stop" and len(normal) < MAX_NEW  # the normal answer ends by an end token, before the budget
        longer, why = _tokens(rt, ids, mode, ignore_eos=True)
        assert (len(longer), why) == (MAX_NEW, "length"), row
        assert not set(longer) & set(rt.eos_ids)
        assert longer[:len(normal)] == normal, (mode, row["prompt"])


def test_ignore_eos_over_http_in_every_mode(bundled_gguf, rows):
    """The request field: completion_tokens = max_tokens, finish_reason length, streamed and not, chat and
    completions; the raw completion's text starts with the normal one's. With constrained output it is a 400."""
    from clover_gguf.serve import create_app
    from test_server import _Server

    s = _Server(create_app(bundled_gguf, mode="auto", parallel=2, ctx=256,
                           runtime_kwargs={"exact": True, "n_threads": 1}))
    try:
        for mode in MODES:
            for row in rows[:1]:
                msgs = [{"role": "user", "content": row["prompt"]}]
                body = {"messages": msgs, "max_tokens": MAX_NEW, "mode": mode, "ignore_eos": True}
                r = httpx.post(s.base + "/v1/chat/completions", json=body, timeout=60).json()
                assert r["usage"]["completion_tokens"] == MAX_NEW and r["choices"][0]["finish_reason"] == "length"
                usage = None
                with httpx.stream("POST", s.base + "/v1/chat/completions", timeout=60,
                                  json={**body, "stream": True, "stream_options": {"include_usage": True}}) as st:
                    for line in st.iter_lines():
                        if line.startswith("data: {") and '"usage"' in line:
                            usage = httpx.Response(200, content=line[6:]).json().get("usage") or usage
                assert usage["completion_tokens"] == MAX_NEW
                prompt = f"<|im_start|>user\n{row['prompt']}<|im_end|>\n<|im_start|>assistant\n"
                normal = httpx.post(s.base + "/v1/completions", timeout=60,
                                    json={"prompt": prompt, "max_tokens": MAX_NEW, "mode": mode}).json()
                longer = httpx.post(s.base + "/v1/completions", timeout=60,
                                    json={"prompt": prompt, "max_tokens": MAX_NEW, "mode": mode,
                                          "ignore_eos": True}).json()
                assert normal["choices"][0]["finish_reason"] == "stop"
                assert longer["usage"]["completion_tokens"] == MAX_NEW
                assert longer["choices"][0]["text"].startswith(normal["choices"][0]["text"]), (mode, row)
        r = httpx.post(s.base + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "ignore_eos": True,
                             "response_format": {"type": "json_object"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos"
    finally:
        s.stop()
