"""The tool-calling tiny Clover (clover_gguf/assets/tiny-clover-tools; docs/tiny-model.md, "The tool-calling tiny
Clover"): its template renders tools, calls and results in the format serve parses and llama.cpp detects; the
trainer's prompts are the runtime's, text and tokens; its eval rows are held out by rule; and through the patched
llama.cpp, on every held-out row, its calls, arguments, final answers and JSON answers hold the bounds below in ar,
draft-self (exact, the AR text token for token) and diffusion."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")

from clover_gguf.serve import tools as serve_tools  # noqa: E402
from clover_gguf.testing import tool_tasks  # noqa: E402
from clover_gguf.testing.tool_tasks import (ASSET_DIR, CALL_KINDS, EVAL_ROWS, KINDS, TEMPLATE_PATH,  # noqa: E402
                                            draw_tool_conversation, make_eval_set, row_conversation)
from clover_gguf.testing.train_tiny import is_held_out, load_eval  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import tiny_eval  # noqa: E402
from test_tiny_model import assert_shipped_asset  # noqa: E402

# Shares of the call rows (call, calls2) with the right tool names / the right arguments, and of the final rows (final,
# final2) with the right answer, per mode, on every STRIDE-th eval row (12 call rows, 18 final rows, 3 long rows).
# Measured on this subset (7,500 training steps, exact settings): names 100% / 100% / 100%, arguments 100% / 100% /
# 91.7% and final answers 50% / 50% / 44.4% in ar / draft-self / diffusion, 2.68 tokens a diffusion pass (the long
# rows left out); the long rows 183-294 tokens, 58 of their 62 lines right (93.5%) in ar and draft-self; on all 165
# rows see docs/tiny-model.md. JSON answers are learnt less (20-30%), so no bound is set on them. The bounds sit under
# the subset's figures; the 1,200-step model (arguments 41.7%, final answers 2%, 1.38 tokens a pass) fails them, and
# the 6,000-step one, which never saw a long text, fails the long ones (2% of the lines right over all 15 long rows).
STRIDE = 5
NAME_BOUNDS = {"ar": 0.9, "draft-self": 0.9, "diffusion": 0.8}
ARGS_BOUNDS = {"ar": 0.75, "draft-self": 0.75, "diffusion": 0.6}
FINAL_BOUND = 0.2
MIN_DIFFUSION_TOKENS_PER_PASS = 2.0
LONG_MIN_TOKENS = 100  # the answers of 100-300 tokens
LONG_LINES_BOUND = 0.7


@pytest.fixture(scope="module")
def rt(tool_gguf):  # conftest's: the asset converted once a session (the agent tests run the same file)
    from clover_gguf.runtime import CloverRuntime

    # exact settings (flash attention off, F32 K/V): draft-self's text is AR's up to float rounding between a 32-row
    # verification and a one-row step, and with CPU flash attention at two threads that flips two near ties (logit
    # gaps 0.017 and 0.059) in two long copies of the 165 rows (docs/runtime.md, "Modes"); here it is AR's on all
    with CloverRuntime(tool_gguf, n_ctx=1024, n_threads=2, exact=True) as r:
        yield r


@pytest.fixture(scope="module")
def rows():
    return load_eval(ASSET_DIR)[::STRIDE]


@pytest.fixture(scope="module")
def results(rt, rows) -> dict:
    """Every eval row decoded in each mode (greedy, the card's controls off, block 32, threshold 0.95)."""
    return {mode: tiny_eval.run_rows(rt, rows, mode) for mode in ("ar", "draft-self", "diffusion")}


def test_asset_is_complete_and_its_template_is_the_family_s():
    assert_shipped_asset(ASSET_DIR)
    assert (ASSET_DIR / "chat_template.jinja").read_text() == TEMPLATE_PATH.read_text()
    assert load_eval(ASSET_DIR) == json.loads(json.dumps(make_eval_set()))  # the rows the rule makes
    kinds = [r["kind"] for r in load_eval(ASSET_DIR)]
    assert {k: kinds.count(k) for k in KINDS} == EVAL_ROWS


def test_the_family_trains_the_shipped_tokenizer(tmp_path):
    """The tokenizer the family's corpus trains is the asset's: a continuation (--resume, which writes the tokenizer
    again) keeps the token ids the weights were trained on. The corpus draws the six first kinds (CORPUS_KINDS); one
    that drew the long kind too would train other merges."""
    from clover_gguf.testing.tokenizer import write_tokenizer

    fam = tool_tasks.FAMILY
    write_tokenizer(tmp_path, corpus=fam.corpus(), n_merges=fam.n_merges, template=fam.template(),
                    exact_split=fam.exact_split)
    trained, shipped = (json.loads((d / "tokenizer.json").read_text()) for d in (tmp_path, ASSET_DIR))
    assert trained == shipped


def test_eval_rows_are_held_out_and_training_never_sees_one():
    rows = make_eval_set()
    assert all(is_held_out(r["messages"][0]["content"]) for r in rows)
    assert all(m["role"] != "user" for r in rows for m in r["messages"][1:])  # one user message per conversation
    rng = random.Random(0)
    train = [draw_tool_conversation(rng) for _ in range(3000)]
    assert not any(is_held_out(c.messages[0]["content"]) for c in train)
    assert {c.kind for c in train} == set(KINDS) and {c.think for c in train} == {True, False}
    held = {r["messages"][0]["content"] for r in rows}
    assert not held & {c.messages[0]["content"] for c in train}


def test_the_template_renders_tools_calls_and_results():
    """Tools as one JSON line each inside <tools>; each call's name and arguments in the call format; each tool
    result inside a <tool_response> block of one user turn; serve sees the template as tool-aware (so it adds
    nothing); and llama.cpp's markers of the Qwen3-Coder XML format are in it (common/chat.cpp)."""
    src = TEMPLATE_PATH.read_text()
    for marker in ("<tool_call>", "<function=", "<parameter=", "<think>"):
        assert marker in src
    assert "'<tool_call><function=' ~" not in src
    assert serve_tools.template_support(
        lambda msgs, t: tool_tasks.render(msgs, t, add_generation_prompt=False)) == (True, True)
    for row in make_eval_set():
        text = tool_tasks.render(row["messages"], row["tools"], row["think"])
        for t in row["tools"]:
            assert "\n" + json.dumps(t) + "\n" in text
        for m in row["messages"]:
            if m["role"] == "tool":
                assert f"<tool_response>\n{m['content']}\n</tool_response>" in text
            for c in m.get("tool_calls", []):
                assert serve_tools.render_call(c["function"]["name"], c["function"]["arguments"]) in text
        results = [m for m in row["messages"] if m["role"] == "tool"]
        assert text.count("<|im_start|>user\n") == 1 + (1 if results else 0)


def test_a_call_answer_renders_back_as_the_template_writes_it():
    """What the model is trained to write for a call turn is what the template writes when that answer comes back
    as an assistant message with tool_calls (serve's shape), so the next turn's prompt continues it exactly; and
    serve's parser reads it back to the same calls."""
    for row in make_eval_set():
        if row["kind"] not in CALL_KINDS:
            continue
        c = row_conversation(row)
        back = c.messages + ({"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": call} for i, call in enumerate(row["calls"])]},)
        full = tool_tasks.render(list(back), list(c.tools), c.think, add_generation_prompt=False)
        prompt = c.prompt_text()
        if not c.think:  # the generation prompt's empty thinking span is not part of a history answer
            prompt = prompt[:-len("<think>\n\n</think>\n\n")]
        assert full == prompt + c.answer + "<|im_end|>\n"
        content, calls = serve_tools.parse_answer(c.answer, serve_tools.read_tools(row["tools"]))
        assert content == "" and [(x.name, x.arguments) for x in calls] == [(w["name"], w["arguments"])
                                                                            for w in row["calls"]]


def test_training_renders_the_prompt_the_runtime_sends(rt):
    """The trainer's prompt text is CloverRuntime.render's over the GGUF's template (with the tools), and the
    tokenizer the trainer uses splits it as llama.cpp does: every kind, thinking on and off."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ASSET_DIR / "tokenizer.json"))
    rows = make_eval_set()
    picked = [next(r for r in rows if r["kind"] == k and r["think"] == t) for k in KINDS for t in (True, False)]
    for row in picked:
        c = row_conversation(row)
        text = rt.render(list(c.messages), think=c.think, tools=list(c.tools))
        assert text == c.prompt_text()
        assert rt.ctx.tokenize(text, special=True) == tok.encode(text).ids
        answer = c.target_text()
        assert rt.ctx.tokenize(text + answer, special=True) == tok.encode(text + answer).ids


@pytest.mark.parametrize("mode", list(NAME_BOUNDS))
def test_held_out_calls(results, mode):
    """Every call row's answer (call, calls2) parses (serve's parser) to calls; the names and arguments right at least
    as often as the bounds say."""
    res = [r for r in results[mode] if r["checks"]["name"] is not None and r["kind"] != "long"]
    names = sum(r["checks"]["name"] for r in res) / len(res)
    args = sum(r["checks"]["args"] for r in res) / len(res)
    print(f"{mode}: names {names:.3f} args {args:.3f} of {len(res)} call rows")
    assert len(res) >= 10 and names >= NAME_BOUNDS[mode] and args >= ARGS_BOUNDS[mode], (names, args)


@pytest.mark.parametrize("mode", list(NAME_BOUNDS))
def test_held_out_final_answers(results, mode):
    """After a tool's result, the final answer restates it (the model cannot compute it: it copies it) at least as
    often as FINAL_BOUND says."""
    res = [r for r in results[mode] if r["checks"].get("answer") is not None]
    right = sum(r["checks"]["answer"] for r in res) / len(res)
    print(f"{mode}: final answers {right:.3f} of {len(res)} rows")
    assert len(res) >= 15 and right >= FINAL_BOUND, right


@pytest.mark.parametrize("mode", ["ar", "draft-self"])
def test_long_calls(results, mode):
    """The long rows (a write_file of 14-30 lines the user gave): answers of at least LONG_MIN_TOKENS tokens, each a
    write_file call to the right path (serve's parser), its content's lines right at their place at least as often
    as LONG_LINES_BOUND says (a whole copy right is rarer: the model often writes on past the text's end)."""
    res = [r for r in results[mode] if r["kind"] == "long"]
    lines = [r["checks"]["lines"] for r in res]
    right = sum(a for a, _ in lines) / sum(b for _, b in lines)
    print(f"{mode}: {len(res)} long rows, {[r['generated'] for r in res]} tokens, lines right {right:.3f}")
    assert len(res) >= 3 and all(r["generated"] >= LONG_MIN_TOKENS for r in res)
    assert all(r["checks"]["name"] for r in res) and right >= LONG_LINES_BOUND, (right, lines)


def test_draft_self_exact_gives_the_ar_text(results):
    differing = [i for i, (a, b) in enumerate(zip(results["ar"], results["draft-self"])) if a["tokens"] != b["tokens"]]
    assert not differing


def test_diffusion_fills_several_tokens_a_pass(results):
    """On the rows but the long ones: diffusion does not finish a long copy (docs/tiny-model.md)."""
    s = tiny_eval.summary([r for r in results["diffusion"] if r["kind"] != "long"])
    assert s["tokens_per_pass"] >= MIN_DIFFUSION_TOKENS_PER_PASS
