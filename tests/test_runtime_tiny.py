"""The runtime on the bundled trained model: llama.cpp decodes like the reference, draft-self (exact) gives the AR
text, the figures docs/tiny-model.md states hold on llama.cpp on the whole held-out eval set (single-turn,
multi-turn and no-think rows), and a three-turn chat answers every turn in every mode."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from clover_gguf.chat import ChatSession
from clover_gguf.decoding import MODES, generate_all
from clover_gguf.reference import ReferenceBackend
from clover_gguf.runtime import CloverRuntime
from clover_gguf.testing.device import env_offload_kwargs
from clover_gguf.testing.train_tiny import (ASSET_DIR, EVAL_ROWS, chat_prompt, load_eval, load_tiny,
                                            row_conversation, row_kind, strip_thinking)

pytestmark = pytest.mark.slow  # minutes of decoding on the trained model: `make test` runs it

STRIDE = 12  # every 12th eval row: 25 rows, all three kinds and all five tasks
TARGET_ACCURACY = 0.95
CONTROLS_ON_NO_THINK_ACCURACY = 0.85  # see test_no_think_answers_hold_no_thinking_tags
THREE_TURNS = [("What is 7 + 8?", "7 + 8 = 15"), ("Count from 33 to 37.", "33 34 35 36 37"),
               ("Reverse: c l o v e r", "r e v o l c")]


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    model, tok, rows = load_tiny(ASSET_DIR)
    return model, tok, rows[::STRIDE]


@pytest.fixture(scope="module")
def ggufs(bundled_gguf, tmp_path_factory) -> dict[str, Path]:
    from clover_gguf.quantize import quantize

    q8 = tmp_path_factory.mktemp("tiny-gguf") / "tiny-q8_0.gguf"
    quantize(bundled_gguf, q8, "Q8_0", quiet=True)
    return {"f32": bundled_gguf, "q8_0": q8}


def _decode_all(backend, tok, rows, **kw):
    outs, passes = [], []
    for row in rows:
        ids = tok.encode(row_conversation(row).prompt_text()).ids
        out, stats = generate_all(backend, ids, max_new_tokens=96, **kw)
        outs.append(out)
        passes.append(stats.forward_passes)
    return outs, passes


def _correct(tok, rows, outs) -> int:
    return sum(r["answer"] in strip_thinking(tok.decode(o, skip_special_tokens=True)) for r, o in zip(rows, outs))


def test_training_renders_the_prompt_the_runtime_sends(ggufs):
    """train_tiny's prompts (history without thinking, enable_thinking on and off) are the runtime's, token for token."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ASSET_DIR / "tokenizer.json"))
    rows = [r for r in load_eval(ASSET_DIR) if len(row_conversation(r).turns) == 3][:4]
    rows += [r for r in load_eval(ASSET_DIR) if row_kind(r) == "single"][:2]
    with CloverRuntime(ggufs["f32"], n_ctx=512, n_threads=2) as rt:
        for row in rows:
            conv = row_conversation(row)
            for think in (True, False):
                text = rt.render(conv.messages, think=think)
                assert text == chat_prompt(conv.messages, think)
                assert rt.ctx.tokenize(text, special=True) == tok.encode(text).ids
    assert "<think>\n\n</think>\n\n" in chat_prompt(conv.messages, False)


def test_llama_diffusion_matches_the_reference_decode(tiny, ggufs):
    model, tok, rows = tiny
    ref_out, ref_passes = _decode_all(ReferenceBackend(model), tok, rows, mode="diffusion", threshold=0.95)
    with CloverRuntime(ggufs["f32"], n_ctx=512, exact=True, n_threads=2, **env_offload_kwargs()) as rt:
        out, passes = _decode_all(rt.backend, tok, rows, mode="diffusion", threshold=0.95)
    assert out == ref_out
    assert passes == ref_passes


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
@pytest.mark.parametrize("rollback", ["redecode", "snapshot"])
def test_draft_self_exact_equals_ar(tiny, ggufs, kind, rollback):
    _, tok, rows = tiny
    with CloverRuntime(ggufs[kind], n_ctx=512, rollback=rollback, n_threads=2, **env_offload_kwargs()) as rt:
        ar, _ = _decode_all(rt.backend, tok, rows, mode="ar")
        ds, _ = _decode_all(rt.backend, tok, rows, mode="draft-self", accept="exact")
    assert ds == ar
    assert _correct(tok, rows, ar) / len(rows) >= TARGET_ACCURACY


@pytest.fixture(scope="module")
def full_eval(ggufs):
    """Every eval row in every mode through llama.cpp (F32, greedy, controls off), as docs/tiny-model.md reports."""
    _, tok, _ = load_tiny(ASSET_DIR)
    rows = load_eval(ASSET_DIR)
    out = {}
    with CloverRuntime(ggufs["f32"], n_ctx=512, n_threads=2) as rt:
        for mode in MODES:
            toks, passes = _decode_all(rt.backend, tok, rows, mode=mode)
            out[mode] = dict(tokens=toks, passes=sum(passes), generated=sum(len(t) for t in toks),
                             ok=[r["answer"] in strip_thinking(tok.decode(t, skip_special_tokens=True))
                                 for r, t in zip(rows, toks)])
    return rows, out


@pytest.mark.parametrize("mode", MODES)
def test_eval_accuracy_per_row_kind(full_eval, mode):
    rows, out = full_eval
    for kind in EVAL_ROWS:
        ok = [good for r, good in zip(rows, out[mode]["ok"]) if row_kind(r) == kind]
        assert ok and sum(ok) / len(ok) >= TARGET_ACCURACY, (mode, kind, sum(ok), len(ok))


def test_eval_diffusion_tokens_per_pass(full_eval):
    _, out = full_eval
    d = out["diffusion"]
    assert d["generated"] / d["passes"] >= 3.0


@pytest.mark.parametrize("mode", ["draft-self", "auto"])
def test_eval_exact_modes_give_the_ar_text_on_every_row(full_eval, mode):
    rows, out = full_eval
    differ = [r["prompt"] for r, a, b in zip(rows, out["ar"]["tokens"], out[mode]["tokens"]) if a != b]
    assert not differ


def test_generate_with_the_cards_controls_answers(ggufs, tiny):
    """The user-facing path (GGUF chat template, llama tokenizer, the card's controls on) answers correctly."""
    _, _, rows = tiny
    with CloverRuntime(ggufs["f32"], n_ctx=512, n_threads=2, **env_offload_kwargs()) as rt:
        for row in rows[::3]:
            conv = row_conversation(row)
            for mode in MODES:
                a = rt.generate(conv.messages, mode=mode, max_new_tokens=96, think=conv.think)
                assert row["answer"] in a.text, (mode, row, a.raw)
                assert a.stats.finish_reason == "stop"


@pytest.mark.parametrize("think", [True, False])
@pytest.mark.parametrize("mode", MODES)
def test_three_turn_chat_answers_every_turn(ggufs, mode, think):
    """ChatSession fed three lines as a user types them: each answer right; with --no-think no thinking tag anywhere."""
    out = io.StringIO()
    s = ChatSession(ggufs["f32"], mode=mode, max_new_tokens=96, think=think, n_ctx=1024,
                    inp=io.StringIO("".join(p + "\n" for p, _ in THREE_TURNS)), out=out)
    s.loop()
    answers = [m["content"] for m in s.messages if m["role"] == "assistant"]
    assert len(answers) == 3
    for (prompt, want), got in zip(THREE_TURNS, answers):
        assert want in got, (mode, think, prompt, got)
    if not think:
        assert "<think>" not in out.getvalue() and "</think>" not in out.getvalue()
        assert not any("think>" in a for a in answers)


@pytest.mark.parametrize("mode", MODES)
def test_no_think_answers_hold_no_thinking_tags(ggufs, mode):
    """With thinking off (the template's empty span, what --no-think sends), the generated text of every no-think
    eval row in every mode holds neither <think> nor </think>, and the answer is right."""
    rows = [r for r in load_eval(ASSET_DIR) if row_kind(r) == "no-think"]
    with CloverRuntime(ggufs["f32"], n_ctx=512, n_threads=2) as rt:
        raws = [rt.generate(row_conversation(r).messages, mode=mode, max_new_tokens=96, think=False).raw
                for r in rows]
    tagged = [raw for raw in raws if "<think>" in raw or "</think>" in raw]
    assert not tagged
    # the user's path has the card's controls on (the eval's >= 95% is with them off, test_eval_accuracy_per_row_kind);
    # measured with them on: ar and draft-self >= 95%, diffusion 68/75 = 90.7%
    assert sum(r["answer"] in raw for r, raw in zip(rows, raws)) / len(rows) >= CONTROLS_ON_NO_THINK_ACCURACY
