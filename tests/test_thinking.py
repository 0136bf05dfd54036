"""The one <think> splitter (clover_gguf.thinking): expected splits written out by hand, any chunking, and the
callers that must agree on `plan</think>answer` after a prompt that opened the span."""

from __future__ import annotations

import random

import pytest

from clover_gguf.thinking import ThinkSplitter, prompt_opens_thinking, split_thinking

THINK, THINK_END = 42, 43

# raw model text, thinking_at_start (True/False from the prompt, None: unknown), expected (thinking, answer)
CASES = [
    ("<think>\nLet me work it out.\n</think>\n\n55 + 54 = 109", False, ("Let me work it out.", "55 + 54 = 109")),
    ("plan</think>answer", True, ("plan", "answer")),  # the prompt opened the span
    ("plan</think>answer", None, ("plan", "answer")),  # text only: a </think> first means it was thinking
    ("plan</think>answer", False, ("", "plananswer")),  # the prompt closed it: a stray </think> closes nothing
    ("no thinking at all  ", False, ("", "no thinking at all")),
    ("no thinking at all  ", None, ("", "no thinking at all")),
    ("still thinking when cut", True, ("still thinking when cut", "")),
    ("<think>\nunfinished thought <thi", False, ("unfinished thought <thi", "")),
    ("  </think> answer with </thi inside", True, ("", "answer with </thi inside")),
    ("<think>a</think>b <think>c</think> d", False, ("ac", "b  d")),
    ("\n\n<think>x</think>\n\ny", None, ("x", "y")),
]


def _chunks(raw: str, rng: random.Random) -> list[str]:
    if len(raw) < 2:
        return [raw]
    cuts = sorted(rng.sample(range(1, len(raw)), k=min(rng.randint(1, 8), len(raw) - 1)))
    return [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)])]


@pytest.mark.parametrize("raw,at_start,want", CASES)
def test_split_is_the_rule_for_any_chunking(raw, at_start, want):
    assert split_thinking(raw, at_start) == want
    rng = random.Random(0)
    for _ in range(30):
        s = ThinkSplitter(at_start)
        out = [s.feed(x) for x in _chunks(raw, rng)] + [s.close()]
        assert ("".join(o[0] for o in out), "".join(o[1] for o in out)) == want


def test_a_known_prompt_never_holds_back_more_than_a_partial_tag():
    s = ThinkSplitter(False)
    assert s.feed("the answer ") == ("", "the answer")  # streamed at once (the trailing space waits)
    assert s.feed("is 4</th") == ("", " is 4")
    s = ThinkSplitter(None)  # unknown prompt: held until a tag decides
    assert s.feed("plan ") == ("", "")
    assert s.feed("</think> answer") == ("plan", "answer")


def test_stop_strings_cut_the_answer_only_across_chunks():
    s = ThinkSplitter(True, stop=["STOP", "42"])
    out = [s.feed(x) for x in ["why 42 ", "here</th", "ink>\n\nthe answer is 4", "1 or S", "TOP and more"]]
    assert "".join(o[0] for o in out) == "why 42 here"  # stop strings do not apply to the thinking
    assert "".join(o[1] for o in out) == "the answer is 41 or"
    assert s.stopped and s.matched == "STOP"
    raw = ThinkSplitter(stop=["\n\n"], tags=False)  # raw completions: no tags, no stripping
    assert raw.feed(" a\n") == ("", " a") and raw.feed("\nb") == ("", "") and raw.stopped
    assert ThinkSplitter(tags=False).feed(" <think>x ") == ("", " <think>x ")


# constrained answers (reopen=False): once the answer has begun, a tag is the grammar's text, never a span
GRAMMAR_CASES = [
    ('{"why": "m9<think>"}', False, ("", '{"why": "m9<think>"}')),  # the seed that lost `"}` to a span
    ('{"a": "x</think>y<think>z"}', False, ("", '{"a": "x</think>y<think>z"}')),
    ('plan</think>{"a": "<think>b"}', True, ("plan", '{"a": "<think>b"}')),  # the prompt's span still closes
    ('<think>t</think> {"a": 1}', False, ("t", '{"a": 1}')),  # an optional span before the answer still is one
]


@pytest.mark.parametrize("raw,at_start,want", GRAMMAR_CASES)
def test_a_constrained_answer_is_the_grammars_text_whole(raw, at_start, want):
    rng = random.Random(1)
    for _ in range(30):
        s = ThinkSplitter(at_start, reopen=False)
        out = [s.feed(x) for x in _chunks(raw, rng)] + [s.close()]
        assert ("".join(o[0] for o in out), "".join(o[1] for o in out)) == want
    assert split_thinking(raw, at_start) != want or "<think>" not in want[1]  # the free rule splits them


@pytest.mark.parametrize("prompt,want", [
    ([1, 2, THINK], True), ([1, THINK, 5, 6], True), ([THINK, 5, THINK_END, 7], False), ([1, 2], False),
    ([THINK_END, THINK], True), ([], False),
])
def test_the_prompt_decides_whether_a_span_is_open(prompt, want):
    assert prompt_opens_thinking(prompt, THINK, THINK_END) is want
    assert prompt_opens_thinking(prompt, None, None) is False  # a vocabulary without the tags never thinks


def test_the_trainer_uses_the_same_split():
    from clover_gguf.testing.train_tiny import strip_thinking

    assert strip_thinking("plan</think>answer") == "answer"
    assert strip_thinking("<think>\nLet me work it out.\n</think>\n\n3 4 5") == "3 4 5"
