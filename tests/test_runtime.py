"""The runtime on the patched llama.cpp: rollback leaves no trace, refusals, the CLI and the chat."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from clover_gguf.convert import convert
from clover_gguf.errors import UserError
from clover_gguf.runtime import CloverRuntime
from clover_gguf.testing.device import env_offload_kwargs


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="module")
def tiny_gguf(make_checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rt") / "tiny.gguf"
    convert(make_checkpoint(seed=1), out, outtype="f32", quiet=True)
    return out


@pytest.fixture(scope="module")
def plain_gguf(make_checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rt") / "plain.gguf"
    convert(make_checkpoint(seed=2, plain_qwen=True), out, outtype="f32", quiet=True)
    return out


PROMPT = [5, 77, 120, 9, 31, 200, 14, 3, 99, 41, 250, 8]
DRAFT = [17, 230, 4, 56, 91, 140, 12]


@pytest.mark.parametrize("strategy", ["redecode", "snapshot"])
@pytest.mark.parametrize("rejected", [1, 4, 6])
def test_partial_rejection_leaves_no_trace(tiny_gguf, strategy, rejected):
    """After committing a draft and rolling back its rejected tail, the next logits equal a run that never saw
    the rejected tokens (and block passes see the same prefix)."""
    kept = DRAFT[:len(DRAFT) - rejected]
    nxt = [61]
    with CloverRuntime(tiny_gguf, n_ctx=256, rollback=strategy, exact=True, n_threads=2, **env_offload_kwargs()) as rt:
        b = rt.backend
        b.reset()
        b.prefill(PROMPT)
        b.commit(DRAFT)
        b.rollback(rejected)
        assert b.n_past == len(PROMPT) + len(kept)
        got_block = b.block_logits([rt.mask_token_id] * 4)
        got = b.commit(nxt)
        # a run that never saw the rejected tokens
        b.reset()
        b.prefill(PROMPT)
        b.commit(kept)
        want_block = b.block_logits([rt.mask_token_id] * 4)
        want = b.commit(nxt)
    assert rel_err(got, want) <= 1e-5
    assert rel_err(got_block, want_block) <= 1e-5
    if strategy == "redecode":
        np.testing.assert_array_equal(got, want)  # same batches, same arithmetic: identical


@pytest.mark.slow
def test_draft_self_exact_equals_ar_on_random_weights(tiny_gguf):
    with CloverRuntime(tiny_gguf, n_ctx=512, exact=True, n_threads=2, **env_offload_kwargs()) as rt:
        ar = rt.generate("Count from 3 to 9.", mode="ar", max_new_tokens=24)
        ds = rt.generate("Count from 3 to 9.", mode="draft-self", max_new_tokens=24, block_size=8)
    assert ds.raw == ar.raw
    assert ds.stats.generated_tokens == ar.stats.generated_tokens


def test_context_limit_is_refused_before_decoding(tiny_gguf):
    with CloverRuntime(tiny_gguf, n_ctx=128, n_threads=2, **env_offload_kwargs()) as rt:
        with pytest.raises(UserError, match=r"request needs \d+ tokens .* more than the context"):
            rt.generate("hello", mode="ar", max_new_tokens=rt.n_ctx)
        with pytest.raises(UserError, match="to resolve a final block"):
            rt.generate("hello", mode="diffusion", max_new_tokens=rt.n_ctx - 20)
        assert rt.backend.n_past == 0  # nothing was decoded


def test_block_mode_refused_without_extras(plain_gguf):
    """A plain Qwen3.5-MoE conversion refuses the block modes and decodes AR: the greedy tokens of a loop written
    here on the raw context (controls off, so the argmax is the whole rule)."""
    with CloverRuntime(plain_gguf, n_ctx=256, n_threads=2, **env_offload_kwargs()) as rt:
        with pytest.raises(UserError, match="has no block-mode tensors.*clover-gguf graft"):
            rt.generate("hello", mode="draft-self", max_new_tokens=8)
        got = rt.generate("hello", mode="ar", max_new_tokens=6, controls=rt.controls.off())
        ids = rt.prompt_ids("hello")
        rt.ctx.clear()
        logits, want = rt.ctx.decode(ids, 0, 0)[-1], []
        while len(want) < 6 and int(np.argmax(logits)) not in rt.eos_ids:
            want.append(int(np.argmax(logits)))
            logits = rt.ctx.decode(want[-1:], len(ids) + len(want) - 1, 0)[-1]
        assert got.raw == rt.detokenize(want) and got.stats.generated_tokens == len(want) >= 1


def test_not_a_clover_gguf(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(UserError, match="not a readable GGUF"):
        CloverRuntime(bad)


def test_the_prompts_tokens_decide_the_thinking_split(tiny_gguf):
    """The GGUF's own <think> tokens: a prompt that opens the span makes `plan</think>answer` (plan, answer)."""
    with CloverRuntime(tiny_gguf, n_ctx=256, n_threads=2) as rt:
        opened = rt.raw_prompt_ids("<|im_start|>assistant\n<think>\n")
        closed = rt.prompt_ids("hi", think=False)  # the template writes <think>\n\n</think>
        assert rt.thinking_at_start(opened) and not rt.thinking_at_start(closed)
        assert not rt.thinking_at_start(rt.prompt_ids("hi"))


def _cli(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clover_gguf", *map(str, args)], capture_output=True, text=True,
                          input=stdin, timeout=300)


@pytest.mark.slow
def test_generate_json_cli(tiny_gguf):
    p = _cli("generate", tiny_gguf, "-p", "Count from 3 to 9.", "-n", "12", "--mode", "diffusion", "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert {"text", "thinking", "stats"} <= set(out)
    for key in ("prompt_tokens", "generated_tokens", "forward_passes", "tokens_per_pass", "acceptance_rate",
                "tokens_per_s", "decode_tokens_per_s", "prompt_seconds"):
        assert key in out["stats"]
    st = out["stats"]
    assert st["generated_tokens"] >= 1
    assert 0 < st["prompt_seconds"] < st["seconds"] and st["decode_tokens_per_s"] > st["tokens_per_s"] > 0
    p = _cli("generate", tiny_gguf, "-p", "x", "-n", "100000")
    assert p.returncode == 2 and "more than the model's context" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_chat_session_commands(tiny_gguf):
    from clover_gguf.chat import ChatSession

    out = io.StringIO()
    inp = io.StringIO("/mode ar\nhello\n/stats\n/mode nonsense\n/reset\n/quit\n")
    s = ChatSession(tiny_gguf, max_new_tokens=6, out=out, inp=inp)
    s.loop()
    text = out.getvalue()
    assert "(mode: ar)" in text and "(conversation cleared)" in text and "(unknown mode 'nonsense'" in text
    line = f"({s.last.summary()})"
    assert line.startswith("(ar: ") and " tokens/pass over " in line and line.count(" tok/s") == 1
    assert text.count(line) == 2  # after the answer, and for /stats: the one summary line, no JSON
    assert "{" not in text
    assert s.messages == []
    # --json-stats: the same stats as one JSON object; Ctrl-D (end of input) ends the prompt's line
    out = io.StringIO()
    s = ChatSession(tiny_gguf, max_new_tokens=6, out=out, inp=io.StringIO("/mode ar\nhello\n"), json_stats=True)
    s.loop()
    assert json.loads(out.getvalue().splitlines()[-2]) == s.last.to_json()
    assert out.getvalue().endswith("> \n")


def test_thinking_renderer_dims_or_hides():
    from clover_gguf.chat import DIM, RESET, ThinkingRenderer
    from clover_gguf.thinking import ThinkSplitter

    for show, color in ((True, True), (False, False)):
        out = io.StringIO()
        r, split = ThinkingRenderer(out, show, color), ThinkSplitter(False)
        for piece in ["<thi", "nk>\nplan", "ning</th", "ink>\n\nThe answer"]:
            r.write(*split.feed(piece))
        r.write(*split.close())
        s = out.getvalue()
        assert "<think>" not in s and "</think>" not in s and s.endswith("The answer")
        assert s.replace(DIM, "").replace(RESET, "") == ("planning\nThe answer" if show else "The answer")
        assert (DIM in s) == (show and color)


def test_token_pieces_are_llamas_and_a_long_piece_is_read_whole(tiny_gguf):
    """token_to_piece keeps each token's text once read: the kept text is what llama.cpp writes for every token, and
    a piece longer than the first buffer (llama.cpp answers -n, the bytes it needs) is read whole, not as b""."""
    import ctypes
    from types import SimpleNamespace

    with CloverRuntime(tiny_gguf, n_ctx=256) as rt:
        ctx = rt.ctx
        L = ctx.L

        def direct(t: int) -> bytes:
            buf = ctypes.create_string_buffer(1024)
            n = L.llama_token_to_piece(ctx.vocab, t, buf, len(buf), 0, True)
            assert n >= 0
            return buf.raw[:n]

        for t in range(ctx.n_vocab):
            assert ctx.token_to_piece(t, special=True) == direct(t)
        assert ctx.token_to_piece(7, special=True) is ctx.token_to_piece(7, special=True)  # kept, not read again
        long_piece = b"x" * 300
        calls = []

        def piece(vocab, token, buf, size, lstrip, special):  # llama.cpp's contract for a piece that does not fit
            calls.append(size)
            if size < len(long_piece):
                return -len(long_piece)
            ctypes.memmove(buf, long_piece, len(long_piece))
            return len(long_piece)

        ctx.L = SimpleNamespace(**{k: getattr(L, k) for k in dir(L) if not k.startswith("__")})
        ctx.L.llama_token_to_piece = piece
        try:
            assert ctx.token_to_piece(ctx.n_vocab - 1, special=False) == long_piece
            assert calls == [256, 300]
        finally:
            ctx.L = L


def test_drafts_fill_at_the_draft_threshold_unless_a_threshold_is_given(bundled_gguf, bundled_eval):
    """The runtime's draft-self and auto (exact) draft at decoding.DRAFT_THRESHOLD when no threshold is given, and at
    the given one otherwise: on the bundled model fewer block passes per draft than at the card's 0.95, the same text
    (the causal pass decides every token), and diffusion unchanged (the card's threshold fills its answer)."""
    from clover_gguf.decoding import DRAFT_THRESHOLD

    assert DRAFT_THRESHOLD < 0.95
    with CloverRuntime(bundled_gguf, n_ctx=512, n_threads=2) as rt:
        assert rt.threshold == pytest.approx(0.95)  # the card's, from the GGUF (f32)
        passes = {None: [0, 0], 0.95: [0, 0]}
        for row in bundled_eval[::40][:8]:
            ar = rt.generate(row["prompt"], mode="ar", max_new_tokens=48).raw
            for thr in passes:
                a = rt.generate(row["prompt"], mode="draft-self", max_new_tokens=48, threshold=thr)
                assert a.raw == ar
                passes[thr][0] += a.stats.block_passes
                passes[thr][1] += a.stats.drafts
            diff = [rt.generate(row["prompt"], mode="diffusion", max_new_tokens=48, threshold=thr).raw
                    for thr in (None, 0.95)]
            assert diff[0] == diff[1]
    per_draft = {thr: p / d for thr, (p, d) in passes.items()}
    assert per_draft[None] < per_draft[0.95], per_draft
